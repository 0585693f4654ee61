"""The segments of ``dflash train --follow`` are one optimization (train/prepare.py, docs/follow.md):
one LR schedule over the run's global steps (warm-up once, no drop at a segment's end, the decay over
the final segment), one optimizer whose state continues across a segment boundary, and a run stopped
inside a segment and resumed ends where the uninterrupted run ends, bit for bit (CPU, deterministic).

The window cache is written first; generate is then staged by hand: each segment begins when two more
of its stores are sealed, and generate finishes while the second segment trains, so three segments
form: two on the stable LR and a final one that decays."""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.window import is_validation_store, read_seals
from dflash_offline.generate.run import run_generate
from dflash_offline.train import follow, trainer
from dflash_offline.train.checkpoint import list_checkpoints, load_latest_checkpoint
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.follow import (
    FollowResult,
    FollowState,
    GenerateProgress,
    read_follow_state,
    run_follow,
    segment_dir,
)
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.step import OptimizerStep
from tests.generate.helpers import make_chat_jsonl, tiny_config
from tests.train.helpers import assert_export_equals_checkpoint
from tests.train.test_follow import SMALL_FILES, VAL_FRACTION, check_followed, follow_config

STORES_PER_SEGMENT = 2
WARMUP_RATIO = 0.5  # a warm-up of several steps, all inside the first segment
REAL_NEW_STORES = follow.new_stores


def write_staged_cache(root: Path) -> Path:
    """A finished window cache of six training stores (about 4 samples each) and a validation store."""
    data = make_chat_jsonl(root / "chat.jsonl", 30, seed=3)
    config = tiny_config(
        root / "cache",
        data,
        window_limit=10**9,
        store_size=200_000,
        val_fraction=VAL_FRACTION,
        flush_seconds=0.2,
        **SMALL_FILES,
    )
    assert run_generate(config).status == "finished"
    training = [s for s in read_seals(root / "cache") if not is_validation_store(s)]
    assert len(training) == 3 * STORES_PER_SEGMENT
    return root / "cache"


def cache_copy(staged: Path, tmp_path: Path) -> Path:
    """Each run retires (deletes) the stores it trained: a copy of the cache for each."""
    return Path(shutil.copytree(staged, tmp_path / "cache"))


def stage_generate(
    monkeypatch: pytest.MonkeyPatch, run: Path, *, finished_with_left: int = STORES_PER_SEGMENT
) -> None:
    """Generate as the follow run into ``run`` sees it: two more sealed stores at each segment's planning,
    finished once ``finished_with_left`` stores are left to plan (by default: those of one segment)."""
    real_new_stores = REAL_NEW_STORES

    def new_stores(cache_dir: Path, state: FollowState) -> tuple[str, ...]:
        return real_new_stores(cache_dir, state)[:STORES_PER_SEGMENT]

    def generate_progress(cache_dir: Path) -> GenerateProgress:
        state = read_follow_state(run) or FollowState(passes=2, segments=())
        finished = len(real_new_stores(cache_dir, state)) <= finished_with_left
        return GenerateProgress(finished=finished, plan_ended=False)  # a generate without a plan's end

    monkeypatch.setattr(follow, "new_stores", new_stores)
    monkeypatch.setattr(follow, "generate_progress", generate_progress)


def config_for(cache: Path, run: Path, **overrides: Any) -> TrainConfig:
    return follow_config(cache, run, warmup_ratio=WARMUP_RATIO, checkpoint_every=3, **overrides)


@dataclass(frozen=True, kw_only=True)
class Uninterrupted:
    """One uninterrupted, staged follow run that the tests below read (each reads, none writes)."""

    cache: Path
    run: Path
    config: TrainConfig
    result: FollowResult
    at_setup: list[dict[str, Any]]
    """The optimizer's state dict at each segment's set-up, in order."""


@pytest.fixture(scope="module")
def uninterrupted(staged_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Uninterrupted:
    """The reference run, trained once for the module: three segments, the optimizer's state recorded at
    each segment's set-up."""
    root = tmp_path_factory.mktemp("uninterrupted")
    cache, run = cache_copy(staged_cache, root), root / "run"
    at_setup: list[dict[str, Any]] = []
    real_setup = trainer.setup_optimization

    def setup(*args: Any, **kwargs: Any) -> Any:
        opt = real_setup(*args, **kwargs)
        at_setup.append(copy.deepcopy(opt.optimizer.state_dict()))
        return opt

    config = config_for(cache, run)
    with pytest.MonkeyPatch.context() as m:
        stage_generate(m, run)
        m.setattr(trainer, "setup_optimization", setup)
        result = run_follow(config)
    return Uninterrupted(cache=cache, run=run, config=config, result=result, at_setup=at_setup)


def hand_lr(config: TrainConfig, state: FollowState, global_step: int) -> float:
    """The schedule computed by hand from the run's record: a linear warm-up over ``--warmup-ratio`` of
    the first segment's steps, then ``--lr``, then a half cosine to 0 over the last segment."""
    first, last = state.segments[0], state.segments[-1]
    warmup = max(1, round(WARMUP_RATIO * first.num_steps))
    end = last.first_step + last.num_steps
    if global_step < warmup:
        return config.optimizer.lr * (global_step + 1) / warmup
    start = max(last.first_step, warmup)
    if global_step < start:
        return config.optimizer.lr
    return (
        config.optimizer.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (global_step - start) / (end - start))))
    )


def logged_lrs(run: Path, state: FollowState) -> Iterator[tuple[int, float]]:
    """(global step, the LR logged with it) of every line of every segment's metrics.jsonl: a line of
    local step s says the LR of the next step, global step first_step + s."""
    for segment in state.segments:
        for record in read_metrics(segment_dir(run, segment.index) / "metrics.jsonl"):
            yield segment.first_step + int(record["step"]), float(record["lr"])  # type: ignore[call-overload, arg-type]


@pytest.mark.timeout(600)
def test_one_lr_schedule_over_the_segments(uninterrupted: Uninterrupted, tmp_path: Path) -> None:
    cache, run, config, result = (
        uninterrupted.cache,
        uninterrupted.run,
        uninterrupted.config,
        uninterrupted.result,
    )
    assert result.segments == 3
    state = read_follow_state(run)
    assert state is not None
    assert [s.last for s in state.segments] == [False, False, True]
    assert [s.first_step for s in state.segments] == [
        0,
        state.segments[0].num_steps,
        state.num_steps - state.segments[2].num_steps,
    ]
    warmup = max(1, round(WARMUP_RATIO * state.segments[0].num_steps))
    assert 1 < warmup < state.segments[0].num_steps  # the warm-up ends inside the first segment

    logged = dict(logged_lrs(run, state))
    assert sorted(logged) == list(range(1, state.num_steps + 1))  # every step logged once
    for step, lr in logged.items():
        assert lr == pytest.approx(hand_lr(config, state, step), rel=1e-12, abs=1e-15), step
    # At each boundary the LR goes on at --lr: no second warm-up, no decay to 0 before the last segment.
    for boundary in (state.segments[1].first_step, state.segments[2].first_step):
        assert logged[boundary] == pytest.approx(config.optimizer.lr, rel=1e-12)
    assert logged[state.num_steps] == 0.0
    check_followed(cache, run, config)
    assert result.last_drafter == segment_dir(run, 2) / "drafter-last"
    assert (result.last_drafter / "model.safetensors").is_file()
    assert not (segment_dir(run, 0) / "drafter-last").exists()  # only the final drafter is exported

    # `dflash export RUN` exports the follow run's newest training state: its last segment's checkpoint.
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from dflash_offline.cli.export import export

    exported = tmp_path / "exported"
    done = CliRunner().invoke(export, [str(run), "--out", str(exported), "--dtype", "float32"])
    assert done.exit_code == 0, done.output
    final = load_latest_checkpoint(segment_dir(run, 2))
    assert final is not None
    assert_export_equals_checkpoint(load_file(str(exported / "model.safetensors")), final.model)


@pytest.mark.timeout(600)
def test_the_optimizer_state_continues_across_a_segment_boundary(uninterrupted: Uninterrupted) -> None:
    """At each segment's set-up its optimizer holds the previous segment's final state (the checkpoint
    of its last step), and AdamW's per-parameter step counts the run's global steps."""
    run, at_setup = uninterrupted.run, uninterrupted.at_setup
    state = read_follow_state(run)
    assert state is not None
    assert len(at_setup) == 3
    for segment in state.segments:
        final = load_latest_checkpoint(segment_dir(run, segment.index))
        assert final is not None
        assert final.global_step == segment.num_steps  # its checkpoints count its own steps
        steps = {float(p["step"]) for p in final.optimizer["state"].values()}
        assert steps == {float(segment.first_step + segment.num_steps)}  # AdamW's: the global step
        if segment.index + 1 < len(state.segments):
            handed = at_setup[segment.index + 1]["state"]
            assert handed.keys() == final.optimizer["state"].keys()
            for key, moments in final.optimizer["state"].items():
                for name in ("step", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(handed[key][name], moments[name]), (segment.index, key, name)


class KilledError(Exception):
    """The fault injected in place of a kill -9: the run stops at once, between two checkpoints."""


def fail_at_step(m: pytest.MonkeyPatch, fault_at: int) -> None:
    """The optimizer step ``fault_at`` (counted from 0 in this process) raises ``KilledError`` instead of
    running."""
    real_call = OptimizerStep.__call__
    steps_run = [0]

    def call(self: OptimizerStep, *args: Any, **kwargs: Any) -> Any:
        if steps_run[0] == fault_at:
            raise KilledError
        steps_run[0] += 1
        return real_call(self, *args, **kwargs)

    m.setattr(OptimizerStep, "__call__", call)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("into_segment", [0, 4], ids=["at-its-first-step", "after-its-first-checkpoint"])
def test_a_follow_run_stopped_inside_a_segment_resumes_bit_exact(
    staged_cache: Path,
    uninterrupted: Uninterrupted,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    into_segment: int,
) -> None:
    """Stopped before step ``into_segment`` of the second segment (before its first checkpoint, the
    resume continues from the first segment's final checkpoint; after it, from its own) and run again
    from a fresh start (nothing alive handed over): the final weights and optimizer state are bit-equal
    to an uninterrupted run's, and the run is one optimization (AdamW's step is the global step)."""
    reference_run = uninterrupted.run
    reference = read_follow_state(reference_run)
    assert reference is not None
    fault_at = reference.segments[1].first_step + into_segment

    cache, run = cache_copy(staged_cache, tmp_path / "stopped"), tmp_path / "stopped" / "run"
    stage_generate(monkeypatch, run)
    config = config_for(cache, run)
    with monkeypatch.context() as m:
        fail_at_step(m, fault_at)
        with pytest.raises(KilledError):
            run_follow(config)
    stopped = read_follow_state(run)
    assert stopped is not None
    assert len(stopped.segments) == 2
    assert not stopped.segments[1].trained
    done = [step for step, _ in list_checkpoints(segment_dir(run, 1))]
    assert done == ([] if into_segment == 0 else [3])

    run_follow(config)
    state = read_follow_state(run)
    assert state == reference
    last = state.segments[-1]
    got = load_latest_checkpoint(segment_dir(run, last.index))
    want = load_latest_checkpoint(segment_dir(reference_run, last.index))
    assert got is not None
    assert want is not None
    assert got.model.keys() == want.model.keys()
    for name, tensor in want.model.items():
        assert torch.equal(got.model[name], tensor), name
    for key, moments in want.optimizer["state"].items():
        assert float(moments["step"]) == state.num_steps
        for name, tensor in moments.items():
            assert torch.equal(got.optimizer["state"][key][name], tensor), (key, name)
    check_followed(cache, run, config)


@pytest.mark.timeout(600)
def test_the_final_drafter_is_exported_when_no_segment_was_planned_as_the_last(
    staged_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generate says it finished only after its last stores were planned, with no plan's end recorded
    before them (a cache made before ``plan_ended_at``, or the cases at the end of docs/follow.md "The
    final segment"): no segment decays, and the drafter of the last one is exported at the run's end
    (from the live drafter; after a restart, from the segment's final checkpoint, its stores being
    retired)."""
    from safetensors.torch import load_file

    cache, run = cache_copy(staged_cache, tmp_path), tmp_path / "run"
    stage_generate(monkeypatch, run, finished_with_left=0)
    config = config_for(cache, run)
    result = run_follow(config)
    state = read_follow_state(run)
    assert state is not None
    assert [s.last for s in state.segments] == [False, False, False]
    last = segment_dir(run, 2)
    assert result.last_drafter == last / "drafter-last"
    final = load_latest_checkpoint(last)
    assert final is not None
    assert_export_equals_checkpoint(load_file(str(result.last_drafter / "model.safetensors")), final.model)
    shutil.rmtree(result.last_drafter)  # as if killed before the export: the rerun writes it
    again = run_follow(config)
    assert again.last_drafter == last / "drafter-last"
    assert_export_equals_checkpoint(load_file(str(again.last_drafter / "model.safetensors")), final.model)


@pytest.mark.parametrize("total", [1, 2, 7, 40, 333])
@pytest.mark.parametrize("ratio", [0.0, 0.04, 0.5])
def test_a_run_of_one_final_segment_gets_an_ordinary_runs_schedule(total: int, ratio: float) -> None:
    """Generate had finished before training began: one segment, final from its first step, whose LR is
    the cosine with warm-up of an ordinary run of its steps (``prepare.cosine_with_warmup``)."""
    from dflash_offline.train.prepare import FollowSchedule, cosine_with_warmup

    warmup = max(1, round(ratio * total))
    schedule = FollowSchedule(warmup_steps=warmup, decay_start=0, end_step=total)
    ordinary = cosine_with_warmup(total, ratio)
    assert [schedule.factor(s) for s in range(total + 1)] == [ordinary(s) for s in range(total + 1)]


def test_a_segments_drafter_counts_every_earlier_segment_as_trained_on(uninterrupted: Uninterrupted) -> None:
    """The final segment's drafter continues the weights the two before it trained: its run split, and so
    eval's held-out set, count their samples as trained on, not as never seen (the segment's own snapshot
    holds only its own stores)."""
    from dflash_offline.eval.prompts import resolve_held_out
    from dflash_offline.run_split import read_run_split

    cache, run, result = uninterrupted.cache, uninterrupted.run, uninterrupted.result
    rows = read_table(cache, "samples", ["sample_id", "shard"]).to_pydict()
    shard_of = dict(zip(rows["sample_id"], rows["shard"], strict=True))
    # Every segment trains all of its stores: the trained samples are those of the training stores.
    trained = {i for i, s in shard_of.items() if not is_validation_store(s)}
    validation = set(shard_of) - trained
    own = read_split_file_only(segment_dir(run, 2))
    assert own < trained  # the reference differs from what the segment's own file says

    split = read_run_split(segment_dir(run, 2))
    assert split is not None
    assert split.train == trained
    assert split.validation == validation
    assert split.left_out == frozenset()
    first = read_run_split(segment_dir(run, 0))  # segment 0's drafter saw segment 0 alone
    assert first is not None
    assert first.train == read_split_file_only(segment_dir(run, 0))

    assert result.last_drafter is not None
    held_out = resolve_held_out(exclude_cache=cache, drafter_dir=result.last_drafter, data=None)
    assert trained <= held_out.excluded_ids
    assert not validation & held_out.excluded_ids  # the run's validation split stays held out


def read_split_file_only(run_dir: Path) -> frozenset[str]:
    """The training samples of ``run_dir``'s own split file, read with pyarrow alone."""
    import pyarrow.parquet as pq

    table = pq.read_table(run_dir / "split.parquet").to_pydict()
    return frozenset(i for i, r in zip(table["sample_id"], table["role"], strict=True) if r == "train")
