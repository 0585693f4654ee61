"""Train's validation chain τ and ``dflash eval``'s measured τ are equal on the same records, end to end.

The production chain on the random:tiny target: ``dflash regenerate`` writes the target's own greedy
answers to a few prompts, ``dflash generate`` caches them, ``dflash train`` trains a drafter on them
(far enough that most drafts are accepted, not so far that every block is), and
``dflash eval --bench validation`` decodes the run's validation records speculatively. Each prompt is
in the data twice, under two record ids of which one falls in the validation split and the other in
training (``--val-group root-id`` holds out by record id, which a test can choose): the validation
records hold exactly what the drafter trained on, yet they are the run's held-out split, so both
commands measure the same samples through their supported paths.

The reference is brute force: the training forward (the validation split's packing, the cached features,
the training masks and positions) run at every eligible anchor of the validation samples
(``train/validation.py:acceptance_at_every_anchor``). Its leading
runs of correct block positions reproduce train's reported ``val_block_tau`` exactly (the reference is the
validator's computation), and at the anchors eval's cycles started from, they equal the accepted drafts
eval measured, cycle by cycle (float32 on the CPU: both sides are greedy over the same weights). Any
train/inference mismatch (features, positions, the mask token, the anchor rule, the chat template, the
export) changes an accepted count on some cycle. Checked by breaking eval's drafting on purpose: a
mask token one id off, block positions one off, or context features written one position late each made
2 to 29 cycles differ. A memorised drafter is the wrong probe: 100 steps gave simulated τ 4.0 and eval
τ 4.0 (B = 4), and it still drafted every block whole with the wrong mask token.

Train's ``val_chain_tau`` walks eval's anchor rule over the same teacher-forced drafts, so with
``--val-chain-tokens`` = eval's ``--max-new-tokens`` it equals eval's measured τ, and its cycle count eval's,
exactly. That needs the cached answers to cover every block eval verifies: eval's last cycle may draft up
to B − 1 tokens past ``--max-new-tokens`` and verifies them against the target's own continuation, where a
cache cut at ``--max-new-tokens`` holds the end-of-turn token instead. Regenerate therefore writes B more
tokens than eval decodes, and no cycle is excluded. The prompts are one user turn each, so eval's
``--turns all`` (the validation τ's every turn) decodes the same as ``--turns first``; a second turn would
follow eval's answer cut at ``--max-new-tokens`` in eval and the longer cached answer in the cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash_offline.decode import DecodeResult, SingleSequence
from dflash_offline.eval.config import EvalConfig
from dflash_offline.eval.run import load_drafter_for, run_eval
from dflash_offline.generate.run import run_generate
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.run import run_regenerate
from dflash_offline.target_model.loader import load_target
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.snapshot import validation_key
from dflash_offline.train.validation import acceptance_at_every_anchor
from tests.eval.helpers import one_thread
from tests.generate.helpers import tiny_config
from tests.train.helpers import train_config

PROMPTS = ("Write a poem about the sea.", "hex bad jokes quietly", "What is a fox?", "Count to ten.")
"""Prompts whose random:tiny greedy answers re-tokenize to the same tokens: a random target's greedy
tokens are not always the tokenizer's own split of their text (regenerate writes the ids beside the text
and the cache holds those, ``tests/regenerate/test_answer_ids.py``; this test keeps to answers where
both agree)."""
NEW_TOKENS = 24
"""Eval's --max-new-tokens and train's --val-chain-tokens."""
BLOCK = 4
REGENERATED_TOKENS = NEW_TOKENS + BLOCK
"""Regenerate's --max-new-tokens: the cached answers cover every block of eval's last cycle."""
VAL_FRACTION = 0.5
STEPS = 80


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


def _record_id(prompt: int, *, held_out: bool) -> str:
    """A record id whose conversation root (the id itself) lands in the validation split or out of it."""
    prefix = "val" if held_out else "train"
    j = 0
    while (validation_key(f"{prefix}{prompt}-{j}") < VAL_FRACTION) != held_out:
        j += 1
    return f"{prefix}{prompt}-{j}"


def _reference_runs(run: Path, model: Any) -> tuple[dict[str, dict[int, int]], dict[str, list[int]]]:
    """The training forward over the run's validation split at every eligible anchor: sample id →
    {position in the sample: leading run of correct block positions}, and sample id → cached token ids."""
    acceptance = acceptance_at_every_anchor(run, model, attention="sdpa")
    runs = {
        sample_id: a.accepted_by_position for sample_id, a in acceptance.items() if a.accepted_by_position
    }
    return runs, {sample_id: a.input_ids for sample_id, a in acceptance.items()}


@pytest.mark.slow
def test_eval_tau_equals_the_training_forward_at_evals_anchors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regenerate: the target answers each prompt (twice: a validation copy and a training copy).
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i, text in enumerate(PROMPTS):
            for held_out in (True, False):
                record = {
                    "id": _record_id(i, held_out=held_out),
                    "messages": [{"role": "user", "content": text}],
                }
                f.write(json.dumps(record) + "\n")
    answers = tmp_path / "answers.jsonl"
    regenerated = run_regenerate(
        RegenerateConfig(
            target="random:tiny",
            data=str(prompts),
            out=answers,
            max_new_tokens=REGENERATED_TOKENS,
            batch_size=2 * len(PROMPTS),
            decontaminate=False,
            progress=False,
        )
    )
    assert regenerated is not None
    by_prompt: dict[str, set[str]] = {}
    for line in answers.read_text().splitlines():
        messages = json.loads(line)["messages"]
        by_prompt.setdefault(messages[0]["content"], set()).add(messages[-1]["content"])
    assert all(len(texts) == 1 for texts in by_prompt.values()), "the two copies got different answers"

    # Generate, then train on the training copies (80 steps: validation τ ≈ 3.5 of 4, measured).
    cache = tmp_path / "cache"
    assert run_generate(tiny_config(cache, answers)).status == "finished"
    run = tmp_path / "run"
    run_training(
        train_config(
            cache,
            run,
            block_size=BLOCK,
            num_anchors=512,  # more than a sample's eligible anchors: validation uses every one
            tokens_per_microbatch=2048,  # one microbatch: all training samples in every step
            # A large final norm: random:tiny's head rows are tiny (std 0.02), so logits need a large
            # hidden to separate (with 0.1 the loss barely moved in 100 steps).
            final_norm_init=20.0,
            lr=2e-2,
            warmup_ratio=0.02,
            max_steps=STEPS,
            val_every=STEPS,  # one validation, at the end: RUN/drafter holds the last weights
            checkpoint_every=10 * STEPS,
            val_group="root-id",
            val_fraction=VAL_FRACTION,
            val_chain_tokens=NEW_TOKENS,
            loader_threads=1,
            tensorboard=False,
        )
    )
    validation: dict[str, Any] = [r for r in read_metrics(run / "metrics.jsonl") if "val_block_tau" in r][-1]

    # Eval on the run's validation records, recording each speculative decode's cycles.
    decoded: list[tuple[tuple[int, ...], DecodeResult]] = []
    speculative = SingleSequence.speculative

    def recording(self: SingleSequence, prompt_ids: Any, drafter: Any, **kw: Any) -> DecodeResult:
        result = speculative(self, prompt_ids, drafter, **kw)
        decoded.append((tuple(prompt_ids), result))
        return result

    monkeypatch.setattr(SingleSequence, "speculative", recording)
    report = run_eval(
        EvalConfig(
            target="random:tiny",
            drafter_dir=run / "drafter",
            bench=("validation",),
            turns="all",
            max_new_tokens=NEW_TOKENS,
            device="cpu",
            warmup=False,
            progress=False,
        )
    )
    monkeypatch.undo()
    assert [p.bench for p in report.prompts] == ["validation"] * len(PROMPTS)
    assert len(decoded) == len(PROMPTS)

    # The reference: the training forward of the exported drafter, read back as eval reads it.
    target = load_target("random:tiny", device="cpu", dtype=torch.float32)
    model = load_drafter_for(target, run / "drafter", dtype=torch.float32)
    runs, cached = _reference_runs(run, model)
    assert {p.sample_id for p in report.prompts} == set(runs)
    every_run = [r for sample in runs.values() for r in sample.values()]
    assert len(every_run) == validation["val_num_blocks"]
    assert 1 + np.mean(every_run) == pytest.approx(validation["val_block_tau"], abs=1e-12)

    eval_accepted: list[int] = []
    for prompt, (prompt_ids, result) in zip(report.prompts, decoded, strict=True):
        ids, P = cached[prompt.sample_id], len(prompt_ids)
        # The cache trains on the eval prompt followed by eval's greedy answer, token for token.
        assert ids[:P] == list(prompt_ids), f"{prompt.record_id}: the prompt renders differently"
        assert ids[P : P + len(result.tokens)] == list(result.tokens), f"{prompt.record_id}: answer differs"
        assert len(result.tokens) == NEW_TOKENS
        assert prompt.tau == result.tau
        assert len(ids) > P + REGENERATED_TOKENS  # the whole regenerated answer is cached
        n = P
        for cycle, accepted in enumerate(result.accepted_per_cycle):
            assert n + BLOCK - 1 < P + REGENERATED_TOKENS  # every block's labels are cached answer tokens
            expected = runs[prompt.sample_id][n]
            assert accepted == expected, f"{prompt.record_id} cycle {cycle} at answer token {n - P}"
            eval_accepted.append(accepted)
            n += accepted + 1
    eval_tau = 1 + float(np.mean(eval_accepted))
    assert eval_tau == pytest.approx(report.mean.tau)
    assert len(eval_accepted) >= 4 * len(PROMPTS)
    # Train's own number, computed by the validator over the cached features: eval's τ, cycle for cycle.
    assert validation["val_chain_cycles"] == len(eval_accepted)
    assert validation["val_chain_tau"] == pytest.approx(eval_tau, abs=1e-12)
    # Trained, not saturated: a drafter that drafts every block whole would hide a small mismatch (a
    # memorised drafter still drafts right with a wrong mask token), so some cycles must accept part.
    partial = sum(0 < a < BLOCK - 1 for a in eval_accepted)
    assert validation["val_block_tau"] > 2, validation
    assert eval_tau > 2
    assert partial >= 4, eval_accepted
