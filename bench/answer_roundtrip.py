"""How often the target's greedy answer tokens differ from what ``dflash generate`` caches for them.

``dflash regenerate`` writes the target's answers as text; ``dflash generate`` renders the conversation
with the chat template and tokenizes it. Where the target's greedy tokens are not the tokenizer's own
split of their text, the cache (without token ids in the data) trains on a sequence the target never
produces. This script answers the first user turn of ``--limit`` records through regenerate's engine, then
compares, per answer, the engine's ids with the answer tokens of ``tokenize_conversation`` over the same
turn (the template's tokens before and after cut off), and prints the counts and every differing stretch;
``answers_affected_with_token_ids`` counts the same with the ids given beside the text, as ``dflash
regenerate`` writes them (0 when generate caches the target's own tokens):

  python bench/answer_roundtrip.py --target default --limit 20 --max-new-tokens 64     # SmolLM2, CPU
  python bench/answer_roundtrip.py --target random:tiny --limit 16 --max-new-tokens 24  # smoke

Counted per answer: affected when the two id sequences differ; tokens affected = engine tokens outside
the stretches both sequences share (difflib's opcodes), with the canonical tokens they re-split into.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.first_turns import first_turns  # noqa: E402
from dflash_offline.data.conversations import Conversation, Message  # noqa: E402
from dflash_offline.data.template import tokenize_conversation  # noqa: E402
from dflash_offline.regenerate.engine_protocol import EngineOptions  # noqa: E402
from dflash_offline.regenerate.generation import GeneratedTokens, GenerationSettings  # noqa: E402
from dflash_offline.regenerate.slot_engine import SlotEngine  # noqa: E402
from dflash_offline.target_model.loader import load_target, stop_token_ids  # noqa: E402


def answer(model: Any, prompts: list[list[int]], settings: GenerationSettings, batch: int) -> list[Any]:
    options = EngineOptions(
        batch_size=batch,
        kv_tokens=batch * (max(map(len, prompts)) + settings.max_new_tokens + 1),
        max_batch_tokens=2048,
        max_prompt_tokens=max(map(len, prompts)),
        cuda_graphs=False,
    )
    engine = SlotEngine(model, settings, options)
    answers: dict[int, GeneratedTokens] = {}
    try:
        for i, p in enumerate(prompts):
            engine.submit(str(i), p)
        while len(answers) < len(prompts):
            for f in engine.poll(timeout=0.5):
                answers[int(f.key)] = f.tokens
    finally:
        engine.close()
    return [answers[i] for i in range(len(prompts))]


def kinds(text: str) -> list[str]:
    """What a differing stretch holds: space, newline, digit, non-ASCII (its Unicode category), other."""
    found = set()
    for ch in text:
        if ch == "\n":
            found.add("newline")
        elif ch.isspace():
            found.add("space")
        elif ch.isdigit() and ch.isascii():
            found.add("digit")
        elif not ch.isascii():
            found.add(f"non-ascii:{unicodedata.category(ch)}")
        elif not ch.isalnum():
            found.add("punctuation")
        else:
            found.add("letter")
    return sorted(found)


def cached_answer_ids(
    tokenizer: Any,
    conv: Conversation,
    group: tuple[Message, ...],
    text: str,
    prompt: list[int],
    token_ids: tuple[int, ...] | None = None,
) -> list[int] | None:
    """The answer tokens ``dflash generate`` caches for this turn (with the answer's ``token_ids`` when
    given, as ``dflash regenerate`` writes them): the conversation's tokens after the prompt, up to (not
    including) the template's end-of-turn token; None when the prompt renders differently inside the
    conversation."""
    messages = (*group, Message(role="assistant", content=text, token_ids=token_ids))
    sample = tokenize_conversation(
        tokenizer,
        Conversation(sample_id=conv.sample_id, source_index=0, record_id="", messages=messages),
        max_length=1 << 20,
        too_long="truncate",
    )
    ids = sample.input_ids_T.tolist()  # type: ignore[union-attr]
    mask = sample.loss_mask_T.tolist()  # type: ignore[union-attr]
    if ids[: len(prompt)] != prompt:
        return None
    trained = [t for t, m in zip(ids[len(prompt) :], mask[len(prompt) :], strict=True) if m]
    return trained[:-1]  # the end-of-turn token is trained too, after the answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--data", default=None, help="chat data (default: the embedded ShareGPT file)")
    ap.add_argument("--limit", type=int, default=20, help="first user turns answered")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    target = load_target(args.target, device=torch.device("cpu"), dtype=torch.float32)
    tokenizer = target.tokenizer
    turns = first_turns(tokenizer, args.data, max_prompt_tokens=args.max_prompt_tokens, limit=args.limit)
    stop = stop_token_ids(tokenizer, target.model)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_ids=stop)
    generated = answer(target.model, [turn.prompt_ids for turn in turns], settings, args.batch_size)
    seconds = time.perf_counter() - t0

    affected = with_ids_affected = tokens = engine_tokens_affected = canonical_tokens_affected = unaligned = 0
    by_kind: dict[str, int] = {}
    stretches = []
    for turn, gen in zip(turns, generated, strict=True):
        conv, group, prompt = turn.conversation, turn.messages, turn.prompt_ids
        engine_ids = list(gen.token_ids)
        text = tokenizer.decode(engine_ids, skip_special_tokens=False)
        tokens += len(engine_ids)
        cached = cached_answer_ids(tokenizer, conv, group, text, prompt)
        if cached is None:
            unaligned += 1
            continue
        with_ids = cached_answer_ids(tokenizer, conv, group, text, prompt, tuple(engine_ids))
        with_ids_affected += with_ids != engine_ids
        if cached == engine_ids:
            continue
        affected += 1
        matcher = difflib.SequenceMatcher(a=engine_ids, b=cached, autojunk=False)
        for op, a0, a1, b0, b1 in matcher.get_opcodes():
            if op == "equal":
                continue
            engine_ids_part, cached_part = engine_ids[a0:a1], cached[b0:b1]
            engine_tokens_affected += len(engine_ids_part)
            canonical_tokens_affected += len(cached_part)
            stretch_text = tokenizer.decode(engine_ids_part, skip_special_tokens=False)
            for k in kinds(stretch_text):
                by_kind[k] = by_kind.get(k, 0) + 1
            stretches.append(
                {
                    "record": conv.record_id,
                    "at_token": a0,
                    "text": stretch_text,
                    "engine": [tokenizer.convert_ids_to_tokens(engine_ids_part)],
                    "cached": [tokenizer.convert_ids_to_tokens(cached_part)],
                    "kinds": kinds(stretch_text),
                }
            )
    result = {
        "target": args.target,
        "answers": len(turns),
        "answer_tokens": tokens,
        "answers_affected": affected,
        "engine_tokens_affected": engine_tokens_affected,
        "cached_tokens_instead": canonical_tokens_affected,
        "prompt_renders_differently": unaligned,
        "answers_affected_with_token_ids": with_ids_affected,
        "stretches_by_kind": dict(sorted(by_kind.items())),
        "seconds": round(seconds, 1),
    }
    for s in stretches:
        print(json.dumps(s, ensure_ascii=False))
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "stretches": stretches}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
