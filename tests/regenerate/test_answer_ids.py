"""The cache holds the tokens the target generated, not the tokenizer's own split of their text.

``dflash regenerate`` writes each answer's token ids beside its text; ``dflash generate`` caches those ids
for the answer (the chat template's tokens around them as before). On random:tiny two of the prompts
below get greedy answers that the tokenizer splits otherwise when it re-encodes their text (asserted, so
the test cannot pass vacuously); the third re-encodes to the same ids. The reference for "the tokens the
target generated" is eval's batch-1 KV-cache greedy loop, not regenerate's engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import iter_records
from dflash_offline.generate.run import run_generate
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.run import render_prompt, run_regenerate
from dflash_offline.target_model.loader import load_target, stop_token_ids
from tests.eval.helpers import one_thread
from tests.generate.helpers import features_by_id, tiny_config
from tests.oracles.reference_decode import TargetCaller, target_only_decode

RESPLIT = ("List three colours.", "Say something.")
"""random:tiny's 16-token greedy answers to these re-encode to other ids (measured; asserted below)."""
SAME = "Count to ten."
NEW_TOKENS = 16


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.mark.slow  # regenerate, then generate (about 30 s of CPU)
def test_the_cache_holds_the_targets_own_answer_tokens(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i, text in enumerate((*RESPLIT, SAME)):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}) + "\n")
    answers = tmp_path / "answers.jsonl"
    run_regenerate(
        RegenerateConfig(
            target="random:tiny",
            data=str(prompts),
            out=answers,
            max_new_tokens=NEW_TOKENS,
            batch_size=3,
            decontaminate=False,
            progress=False,
        )
    )
    target = load_target("random:tiny", device="cpu")
    tokenizer = target.tokenizer
    caller, stop = TargetCaller(target.model), stop_token_ids(tokenizer, target.model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    lines = {json.loads(line)["id"]: json.loads(line) for line in answers.read_text().splitlines()}
    records = {c.record_id: c for c in iter_records(answers) if isinstance(c, Conversation)}
    assert run_generate(tiny_config(tmp_path / "cache", answers)).status == "finished"
    cached = features_by_id(tmp_path / "cache")
    assert len(cached) == 3

    resplit = 0
    for i, text in enumerate((*RESPLIT, SAME)):
        prompt = render_prompt(tokenizer, [{"role": "user", "content": text}])
        greedy = [
            t
            for t in target_only_decode(caller, prompt, max_new_tokens=NEW_TOKENS, stop_ids=stop).tokens
            if t not in stop
        ]
        answer = tokenizer.decode(greedy, skip_special_tokens=False)
        reencoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        assert (reencoded != greedy) == (text in RESPLIT), text  # the premise: which answers re-split
        resplit += reencoded != greedy

        _, ids_T, mask_T = cached[records[f"p{i}"].sample_id]
        # The prompt as the target read it, then its own tokens, then the template's end of turn.
        assert ids_T.tolist()[: len(prompt)] == prompt
        assert ids_T.tolist()[len(prompt) : len(prompt) + len(greedy) + 1] == [*greedy, im_end]
        assert mask_T.tolist()[len(prompt) :] == [1] * (len(greedy) + 1) + [0] * (
            len(ids_T) - len(prompt) - len(greedy) - 1
        )
        assert mask_T[: len(prompt)].sum() == 0
        # The line carries the ids beside the text.
        message = lines[f"p{i}"]["messages"][-1]
        assert message == {"role": "assistant", "content": answer, "token_ids": greedy}
    assert resplit == len(RESPLIT)
