"""``val_chain_tau``: ``dflash eval``'s anchor rule over the validation split's teacher-forced drafts,
against a chain walked by hand over the drafts of the inference path; the best export and early stop
follow it; a checkpoint whose tracker predates it still resumes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_offline.cache.reader import CacheReader
from dflash_offline.drafter.export import load_exported_drafter
from dflash_offline.errors import ResumeError
from dflash_offline.train import trainer
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import ValidationMetrics, read_metrics, validation_records
from dflash_offline.train.validation import (
    ValidationTracker,
    acceptance_at_every_anchor,
    answer_turns,
    chain_window,
    walk_chain,
)
from tests.train.helpers import assert_export_equals_checkpoint, flat_config_json
from tests.train.learnable_task import embedding as learnability_embedding
from tests.train.learnable_task import synthetic_setup as learnability_setup
from tests.train.learnable_task import write_cache as learnability_cache

CHAIN_TOKENS = 5
"""--val-chain-tokens of the runs here: shorter than most turns of the two-turn cache (3 to 11 answer
tokens each), longer than some."""


def test_turns_windows_and_the_walk_on_a_hand_made_sample() -> None:
    """Two prompt tokens, a 7-token answer, a user token, a 3-token answer; runs written out by hand."""
    mask = [False, False] + [True] * 7 + [False] + [True] * 3
    first, second = answer_turns(mask)
    assert (first, second) == (range(2, 9), range(10, 13))
    runs = {2: 1, 3: 0, 4: 2, 5: 0, 6: 0, 7: 1, 10: 0, 11: 1}  # an anchor needs a next answer token
    # eval --max-new-tokens M: the prefill gives the answer's first token, cycles follow while < M out.
    assert walk_chain(runs, chain_window(first, 1)) == []  # the prefill's token is all
    assert walk_chain(runs, chain_window(first, 2)) == [1]  # 1 + 2 tokens
    assert walk_chain(runs, chain_window(first, 4)) == [1, 2]  # 3, then 6 tokens: the last block overruns
    assert walk_chain(runs, first) == [1, 2, 1]  # positions 2, 4, 7; then 9 ends the turn
    assert walk_chain(runs, chain_window(first, 100)) == [1, 2, 1]
    assert walk_chain(runs, chain_window(second, 256)) == [0, 1]
    # In a packed row, a turn ends where its document does.
    assert answer_turns([True] * 4 + [False], doc_ids=[0, 0, 1, 1, -1]) == [range(0, 2), range(2, 4)]


def _config(cache: Path, out: Path, **overrides: object) -> TrainConfig:
    base = TrainConfig.from_options(
        cache_dir=cache,
        out_dir=out,
        num_layers=1,
        block_size=4,
        num_anchors=4096,
        tokens_per_microbatch=600,
        grad_accum=1,
        lr=1e-2,
        epochs=100,
        max_steps=6,
        checkpoint_every=100,
        loader_threads=2,
        prefetch=2,
        progress=False,
        deterministic=True,
        threads_per_worker=1,
        val_samples=10,
        val_every=3,
        val_chain_tokens=CHAIN_TOKENS,
        final_norm_init=0.1,
        tensorboard=False,
    )
    return base.with_options(**overrides)


@pytest.fixture
def two_turn_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The learnability task's cache with two answers per sample and token 0 at 60 % of the positions
    (a few steps teach the drafter to propose it: runs of every length), and its well-conditioned head
    installed as the target's."""
    monkeypatch.setattr(trainer, "build_drafter_setup", learnability_setup)
    return learnability_cache(
        tmp_path / "cache", zero_features=False, num_samples=60, two_turns=True, common_token_share=0.6
    )


def _runs_by_inference(model: Any, cache: Path, sample_ids: list[str]) -> dict[str, dict[int, int]]:
    """Sample id → {anchor position: leading run of correct drafts} over every eligible anchor, each
    drafted alone by the inference path (``draft_logits`` over the sample's features before the anchor)."""
    B = model.config.block_size
    with CacheReader.open(cache) as reader:
        row_of = {s: i for i, s in enumerate(reader.samples.sample_id.tolist())}
        samples = reader.read_rows([row_of[s] for s in sample_ids])
    out = {}
    for sample in samples:
        ids, mask, feats = sample.input_ids_T.long(), sample.loss_mask_T.bool(), sample.features_TF.float()
        T, runs = len(ids), {}
        for a in range(T - 1):
            if not (mask[a] and mask[a + 1]):
                continue
            logits = model.draft_logits(
                context_features_CF=feats[:a], anchor_token=int(ids[a]), anchor_position=a
            )
            run = 0
            while run + 1 < B and a + run + 1 < T and bool(mask[a + run + 1]):
                if int(logits[run].argmax()) != int(ids[a + run + 1]):
                    break
                run += 1
            runs[a] = run
        out[sample.sample_id] = runs
    return out


def _eval_cycles_by_hand(
    runs: dict[int, int], mask: list[bool], max_new_tokens: int
) -> list[tuple[int, int]]:
    """Each answer (a run of the loss mask) decoded as ``dflash eval --max-new-tokens M`` decodes one: the
    prefill gives its first token; a cycle at token n accepts runs[n] drafts and the target's next token,
    and the next cycle starts at the last token out, until M tokens are out or the answer (its drafts)
    ends. Each cycle as (the answer's ordinal in the sample, 1-based; its accepted drafts)."""
    cycles = []
    ordinal = 0
    for start in range(len(mask)):
        if not mask[start] or (start > 0 and mask[start - 1]):
            continue  # not an answer's first token
        ordinal += 1
        out, n = 1, start
        while out < max_new_tokens and n in runs:
            cycles.append((ordinal, runs[n]))
            out += runs[n] + 1
            n += runs[n] + 1
    return cycles


def test_val_chain_tau_equals_evals_rule_walked_by_hand(two_turn_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = _config(two_turn_cache, run)
    run_training(config)
    last = validation_records(read_metrics(run / "metrics.jsonl"))[-1]  # type: ignore[arg-type]
    assert last["step"] == config.optimizer.max_steps  # the weights of RUN/drafter-last

    embed = learnability_embedding()
    model = load_exported_drafter(run / "drafter-last", embed_VH=embed, lm_head_VH=embed)
    acceptance = acceptance_at_every_anchor(run, model)
    runs = {sample_id: a.accepted_by_position for sample_id, a in acceptance.items()}
    assert runs == _runs_by_inference(model, two_turn_cache, sorted(runs))
    by_turn = [
        c
        for sample_id, a in acceptance.items()
        for c in _eval_cycles_by_hand(runs[sample_id], a.loss_mask, CHAIN_TOKENS)
    ]
    cycles = [run for _, run in by_turn]
    assert last["val_chain_cycles"] == len(cycles)
    assert float(last["val_chain_tau"]) == pytest.approx(1 + np.mean(cycles), abs=1e-12)  # type: ignore[arg-type]
    # By turn, as eval reports it: each sample's first answer, its second (these samples have two).
    first = [run for ordinal, run in by_turn if ordinal == 1]
    second = [run for ordinal, run in by_turn if ordinal == 2]
    assert first
    assert second
    assert len(first) + len(second) == len(cycles)
    assert last["val_chain_tau_by_turn"] == [
        pytest.approx(1 + np.mean(first), abs=1e-12),
        pytest.approx(1 + np.mean(second), abs=1e-12),
        None,
    ]

    # What the walk must get right is there: accepted drafts, turns past M tokens and turns shorter
    # than M, second turns.
    assert sum(c > 0 for c in cycles) >= 5, cycles
    turn_lengths = [
        sum(1 for _ in group)
        for a in acceptance.values()
        for value, group in itertools.groupby(a.loss_mask)
        if value
    ]
    assert max(turn_lengths) > CHAIN_TOKENS > min(turn_lengths)
    assert len(turn_lengths) == 2 * len(acceptance)
    # Another number than the uniform draw's.
    assert float(last["val_chain_tau"]) != pytest.approx(float(last["val_block_tau"]))  # type: ignore[arg-type]


def _metrics(step: int, *, chain_tau: float, simulated_tau: float) -> ValidationMetrics:
    return ValidationMetrics(
        step=step,
        loss=1.0,
        acc_by_position=[0.5],
        simulated_tau=simulated_tau,
        block_tau=simulated_tau - 0.1,
        chain_tau=chain_tau,
        chain_cycles=10,
        num_blocks=10,
        num_samples=2,
        num_tokens=100,
    )


def test_the_tracker_follows_chain_tau() -> None:
    """Simulated and per-block τ rise all along; chain τ peaks at step 2: the best is step 2, and early
    stopping counts the evaluations since."""
    tracker = ValidationTracker(chain_tokens=CHAIN_TOKENS)
    chain = {1: 1.5, 2: 1.9, 3: 1.8, 4: 1.9, 5: 1.7}
    bests = [tracker.update(_metrics(s, chain_tau=t, simulated_tau=2.0 + s)) for s, t in chain.items()]
    assert bests == [True, True, False, False, False]  # a tie is no improvement
    assert (tracker.best_tau, tracker.best_step, tracker.evals_since_best) == (1.9, 2, 3)
    assert not tracker.should_stop(4)
    assert tracker.should_stop(3)
    restored = ValidationTracker(chain_tokens=CHAIN_TOKENS)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert (restored.best_tau, restored.best_step, restored.evals_since_best) == (1.9, 2, 3)
    assert restored.restarted is None


def test_a_tracker_of_another_criterion_is_set_aside() -> None:
    """A state written before chain τ (version 1: simulated τ) or over another --val-chain-tokens holds a
    best of other units: no best yet, and the next evaluation is the best."""
    old = {"version": 1, "best_tau": 3.9, "best_step": 40, "evals_since_best": 2}
    other = {**ValidationTracker(chain_tokens=64).state_dict(), "best_tau": 2.5, "best_step": 40}
    for state, why in ((old, "simulated τ"), (other, "chain τ over 64 tokens")):
        tracker = ValidationTracker(chain_tokens=CHAIN_TOKENS)
        tracker.load_state_dict(state)
        assert (tracker.best_tau, tracker.best_step, tracker.evals_since_best) == (None, 0, 0)
        assert tracker.restarted is not None
        assert why in tracker.restarted
        assert "step 40" in tracker.restarted
        assert tracker.update(_metrics(41, chain_tau=1.2, simulated_tau=2.0))
        assert not tracker.should_stop(1)
    with pytest.raises(ResumeError, match="validation tracker has version 7"):
        ValidationTracker(chain_tokens=CHAIN_TOKENS).load_state_dict({**old, "version": 7})


def _as_written_before_chain_tau(run: Path, *, best_simulated_tau: float) -> None:
    """Make ``run`` look written by the version before chain τ: the tracker state of its checkpoints
    (version 1: the best simulated τ, here ``best_simulated_tau`` at step 2), a config.json without
    --val-chain-tokens, metrics lines without chain τ."""
    for _step, checkpoint in list_checkpoints(run):
        state = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=False)
        state["validation"] = {
            "version": 1,
            "best_tau": best_simulated_tau,
            "best_step": 2,
            "evals_since_best": state["validation"]["evals_since_best"],
        }
        torch.save(state, checkpoint / "state.pt")
    config = flat_config_json(json.loads((run / "config.json").read_text()))
    del config["val_chain_tokens"]
    (run / "config.json").write_text(json.dumps(config))
    lines = read_metrics(run / "metrics.jsonl")
    for line in lines:
        line.pop("val_chain_tau", None)
        line.pop("val_chain_cycles", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_resume_from_a_checkpoint_before_chain_tau(
    two_turn_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The run resumes; the old best (a simulated τ of B, every draft right: no chain τ can beat it) is set
    aside, said once, so the first validation after the resume is exported as the best and early stopping
    counts afresh (kept, it would never be beaten: RUN/drafter would stay the old export and the run would
    stop early)."""
    run = tmp_path / "run"
    config = _config(two_turn_cache, run, max_steps=4, val_every=2, checkpoint_every=2, keep_checkpoints=100)
    run_training(config)
    _as_written_before_chain_tau(run, best_simulated_tau=float(config.drafter.block_size))
    capfd.readouterr()
    result = run_training(config.with_options(max_steps=8, early_stop=2))
    assert result is not None
    assert "best validation simulated τ (step" in capfd.readouterr().err
    assert not result.stopped_early
    assert result.global_step == 8
    records = {int(r["step"]): r for r in validation_records(read_metrics(run / "metrics.jsonl"))}  # type: ignore[call-overload]
    assert sorted(records) == [2, 4, 6, 8]
    assert "val_chain_tau" not in records[4]
    chain = {s: float(records[s]["val_chain_tau"]) for s in (6, 8)}  # type: ignore[arg-type]
    best_step = 8 if chain[8] > chain[6] else 6
    assert (result.best_validation_step, result.best_validation_tau) == (best_step, chain[best_step])
    exported = load_file(str(run / "drafter" / "model.safetensors"))
    checkpoint = torch.load(
        dict(list_checkpoints(run))[best_step] / "state.pt", map_location="cpu", weights_only=False
    )
    assert_export_equals_checkpoint(exported, checkpoint["model"])
