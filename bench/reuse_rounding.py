"""How far a continuation's keys and values (reused slot + prefill past the common prefix) are from the same
prompt prefilled whole, in float32 on the CPU, beside today's engine against itself at another prefill
chunk size.

A two-turn conversation of random tokens: turn 1 (``--prompt-tokens`` tokens, ``--answer-tokens`` new
ones) parks its slot; turn 2 = turn 1's prompt + its answer + a random user turn, continued from the slot
(engine A) and prefilled whole (engine B, chunks of ``--chunk`` tokens; engine C: chunks of 16). Printed per
region of turn 2's prompt: the largest absolute K/V difference over every layer, and the first answer
token of each engine.

  python bench/reuse_rounding.py --target random:smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.decode import DecodeEngine, EngineSettings  # noqa: E402
from dflash_offline.target_model.loader import load_target  # noqa: E402


def run_to_end(engine: DecodeEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.pending():
        out.update({d.key: list(d.token_ids) for d in engine.poll(timeout=5.0)})
    return out


def max_diff(a: DecodeEngine, b: DecodeEngine, start: int, end: int) -> float:
    """Largest |K − K'| or |V − V'| of slot 0 at positions start..end−1, over every layer."""
    pairs = zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values, strict=True)
    return max(float((x[0, :, start:end] - y[0, :, start:end]).abs().max()) for x, y in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=195)
    ap.add_argument("--answer-tokens", type=int, default=40)
    ap.add_argument("--user-tokens", type=int, default=190)
    ap.add_argument("--chunk", type=int, default=64, help="prefill tokens per forward")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_target(args.target, device="cpu")
    g = torch.Generator().manual_seed(1)
    vocab = target.info.vocab_size
    first = torch.randint(10, vocab - 10, (args.prompt_tokens,), generator=g).tolist()
    user = torch.randint(10, vocab - 10, (args.user_tokens,), generator=g).tolist()
    max_len = args.prompt_tokens + args.answer_tokens + args.user_tokens + 8

    def engine(chunk: int) -> DecodeEngine:
        settings = EngineSettings(
            num_slots=1, max_len=max_len, max_new_tokens=args.answer_tokens, stop_ids=frozenset(),
            prefill_tokens=chunk,
        )  # fmt: skip
        return DecodeEngine(target.model, settings)

    reused = engine(args.chunk)
    reused.submit("t0", first, keep_slot=True)
    answer = run_to_end(reused)["t0"]
    second = first + answer + user
    reused.submit("t1", second, max_new_tokens=1, continues="t0")
    firsts = {"reused": run_to_end(reused)["t1"]}
    whole, other_chunks = engine(args.chunk), engine(16)
    for name, e in (("whole", whole), ("whole, chunks of 16", other_chunks)):
        e.submit("t1", second, max_new_tokens=1)
        firsts[name] = run_to_end(e)["t1"]
    n1, na, n = len(first), len(answer), len(second)
    # The reused slot holds turn 1's prompt and answer but its last token; the rest is prefilled anew.
    report = {
        "target": args.target,
        "reused_tokens": reused.num_reused_tokens,
        "reused vs whole: turn 1's prompt": max_diff(reused, whole, 0, n1),
        "reused vs whole: turn 1's answer (decode steps vs prefill)": max_diff(
            reused, whole, n1, n1 + na - 1
        ),
        "reused vs whole: the continuation": max_diff(reused, whole, n1 + na - 1, n),
        "whole vs whole in chunks of 16 (today's engine)": max_diff(other_chunks, whole, 0, n),
        "max |K/V|": max(float(x[0, :, :n].abs().max()) for x in whole.cache.keys + whole.cache.values),
        "first answer token": firsts,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
