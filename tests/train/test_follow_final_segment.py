"""The final segment of ``dflash train --follow`` when training outpaces generate (docs/follow.md, "The
final segment"): training, waiting for stores, reads the seals of generate's last stores while generate's
run row still says ``running``. Those stores hold the samples of the plan's last jobs, so generate has
recorded its plan's end (``RunRow.plan_ended_at``) before them: training holds them back until the run
has finished, then trains them as the final segment, and the LR decays to 0 over it. A run stopped while
holding them, or inside the final segment, and run again ends bit for bit where the uninterrupted run
ends.

Staged on a real window cache by rewriting its generate run's row as generate would at each moment: two
more sealed stores at each planning, the plan's end recorded as its last two stores are sealed, and the
run finished while training waits (the follow run's poll)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_offline.cache.manifest import read_runs, read_table, record_run
from dflash_offline.cache.rows import RunRow, utc_now
from dflash_offline.cache.window import is_validation_store, read_seals
from dflash_offline.train import follow
from dflash_offline.train.checkpoint import list_checkpoints, load_latest_checkpoint
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.follow import FollowState, read_follow_state, run_follow, segment_dir
from tests.train.test_follow import check_followed
from tests.train.test_follow_segments import (
    REAL_NEW_STORES,
    STORES_PER_SEGMENT,
    KilledError,
    cache_copy,
    config_for,
    fail_at_step,
    hand_lr,
    logged_lrs,
)


def generate_row(cache: Path) -> RunRow:
    runs = [r for r in read_runs(cache) if r.command == "generate"]
    assert len(runs) == 1
    return runs[0]


def test_generate_records_its_plans_end_before_its_last_training_samples(staged_cache: Path) -> None:
    """What the follow rule rests on, from a real generate run: its row records the plan's end, and a
    training sample was committed after it, into a store sealed after it (the final segment's)."""
    run = generate_row(staged_cache)
    assert run.status == "finished"
    assert run.plan_ended_at is not None
    assert run.finished_at is not None
    assert run.started_at <= run.plan_ended_at <= run.finished_at
    samples = read_table(staged_cache, "samples", ["shard", "created_at"]).to_pylist()
    seals = read_seals(staged_cache)
    training = [s for s in samples if not is_validation_store(s["shard"])]
    later = [s for s in training if s["created_at"] >= run.plan_ended_at]
    assert later
    assert all(seals[s["shard"]].sealed_at >= run.plan_ended_at for s in later)


class FollowClock:
    """``time`` as the follow module sees it: a poll of a waiting follow run is where generate finishes
    (or, with ``kill_at_poll``, where the run is killed)."""

    def __init__(self, on_poll: Callable[[], None]) -> None:
        self.on_poll = on_poll
        self.polls = 0

    def perf_counter(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        self.polls += 1
        self.on_poll()


def stage_outpaced(
    monkeypatch: pytest.MonkeyPatch, cache: Path, *, kill_at_poll: bool = False
) -> FollowClock:
    """Generate as a follow run that outpaces it sees it: running (plan not ended) while it seals two
    stores at a time; its plan's end recorded as its last two stores are sealed (before training reads
    them); finished while training waits."""
    written = generate_row(cache)
    running = dataclasses.replace(written, status="running", finished_at=None, plan_ended_at=None)
    record_run(cache, running)

    def newest() -> RunRow:
        return generate_row(cache)

    def new_stores(cache_dir: Path, state: FollowState) -> tuple[str, ...]:
        stores = REAL_NEW_STORES(cache_dir, state)
        if stores and len(stores) <= STORES_PER_SEGMENT and newest().plan_ended_at is None:
            record_run(cache, dataclasses.replace(running, plan_ended_at=utc_now()))
        return stores[:STORES_PER_SEGMENT]

    def finish() -> None:
        if kill_at_poll:
            raise KilledError
        row = newest()
        if row.status != "finished":
            record_run(cache, dataclasses.replace(row, status="finished", finished_at=utc_now()))

    clock = FollowClock(finish)
    monkeypatch.setattr(follow, "new_stores", new_stores)
    monkeypatch.setattr(follow, "time", clock)
    return clock


@dataclass(frozen=True, kw_only=True)
class Outpaced:
    """One uninterrupted follow run of the staged case, read by the tests below (none writes)."""

    cache: Path
    run: Path
    config: TrainConfig
    polls: int


@pytest.fixture(scope="module")
def outpaced(staged_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Outpaced:
    root = tmp_path_factory.mktemp("outpaced")
    cache, run = cache_copy(staged_cache, root), root / "run"
    config = config_for(cache, run)
    with pytest.MonkeyPatch.context() as m:
        clock = stage_outpaced(m, cache)
        run_follow(config)
    return Outpaced(cache=cache, run=run, config=config, polls=clock.polls)


@pytest.mark.timeout(600)
def test_the_stores_sealed_after_the_plans_end_form_the_final_segment(outpaced: Outpaced) -> None:
    cache, run, config = outpaced.cache, outpaced.run, outpaced.config
    state = read_follow_state(run)
    assert state is not None
    assert outpaced.polls == 1  # it waited once: from the plan's end until generate finished
    training = sorted(s for s in read_seals(cache) if not is_validation_store(s))
    assert [s.stores for s in state.segments] == [tuple(training[i : i + 2]) for i in (0, 2, 4)]
    assert [s.last for s in state.segments] == [False, False, True]
    warmup = max(1, round(0.5 * state.segments[0].num_steps))
    assert 1 < warmup < state.segments[0].num_steps

    logged = dict(logged_lrs(run, state))
    assert sorted(logged) == list(range(1, state.num_steps + 1))  # every step logged once
    for step, lr in logged.items():
        assert lr == pytest.approx(hand_lr(config, state, step), rel=1e-12, abs=1e-15), step
    final = state.segments[-1]
    assert logged[final.first_step] == pytest.approx(config.optimizer.lr, rel=1e-12)  # stable up to it
    assert logged[final.first_step + 1] < config.optimizer.lr  # then the decay
    assert logged[state.num_steps] == 0.0
    check_followed(cache, run, config)
    assert (segment_dir(run, final.index) / "drafter-last" / "model.safetensors").is_file()


def assert_same_end(run: Path, reference: Path) -> None:
    """The same record, the same LR at every logged step, bit-equal final weights and optimizer state."""
    state, want_state = read_follow_state(run), read_follow_state(reference)
    assert state is not None
    assert state == want_state
    assert dict(logged_lrs(run, state)) == dict(logged_lrs(reference, state))
    last = state.segments[-1].index
    got = load_latest_checkpoint(segment_dir(run, last))
    want = load_latest_checkpoint(segment_dir(reference, last))
    assert got is not None
    assert want is not None
    assert got.model.keys() == want.model.keys()
    for name, tensor in want.model.items():
        assert torch.equal(got.model[name], tensor), name
    for key, moments in want.optimizer["state"].items():
        assert float(moments["step"]) == state.num_steps
        for name, tensor in moments.items():
            assert torch.equal(got.optimizer["state"][key][name], tensor), (key, name)


@pytest.mark.timeout(900)
def test_killed_while_holding_the_last_stores_it_resumes_bit_exact(
    staged_cache: Path, outpaced: Outpaced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped while it waits for generate to finish (the last stores sealed, none planned), then run
    again from a fresh start: it holds them again, and the final segment decays as in the reference."""
    cache, run = cache_copy(staged_cache, tmp_path), tmp_path / "run"
    config = config_for(cache, run)
    with monkeypatch.context() as m:
        stage_outpaced(m, cache, kill_at_poll=True)
        with pytest.raises(KilledError):
            run_follow(config)
    stopped = read_follow_state(run)
    assert stopped is not None
    assert [(s.trained, s.last) for s in stopped.segments] == [(True, False), (True, False)]
    assert generate_row(cache).plan_ended_at is not None
    assert generate_row(cache).status == "running"
    with monkeypatch.context() as m:
        clock = stage_outpaced_again(m, cache)
        run_follow(config)
    assert clock.polls == 1
    assert_same_end(run, outpaced.run)
    check_followed(cache, run, config)


def stage_outpaced_again(monkeypatch: pytest.MonkeyPatch, cache: Path) -> FollowClock:
    """The rerun after a kill while holding: generate's row as the kill left it (plan ended, running);
    it finishes at the rerun's first poll."""

    def finish() -> None:
        row = generate_row(cache)
        if row.status != "finished":
            record_run(cache, dataclasses.replace(row, status="finished", finished_at=utc_now()))

    clock = FollowClock(finish)
    monkeypatch.setattr(follow, "time", clock)
    return clock


@pytest.mark.timeout(900)
def test_killed_inside_the_final_segment_it_resumes_bit_exact(
    staged_cache: Path, outpaced: Outpaced, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after the final segment's first checkpoint, in its decay, then run again from a fresh
    start (nothing alive handed over): the LR and the final state equal the uninterrupted run's."""
    reference = read_follow_state(outpaced.run)
    assert reference is not None
    final = reference.segments[-1]
    fault_at = final.first_step + 4
    assert fault_at < reference.num_steps
    cache, run = cache_copy(staged_cache, tmp_path), tmp_path / "run"
    config = config_for(cache, run)
    with monkeypatch.context() as m:
        stage_outpaced(m, cache)
        fail_at_step(m, fault_at)
        with pytest.raises(KilledError):
            run_follow(config)
    stopped = read_follow_state(run)
    assert stopped is not None
    assert [(s.trained, s.last) for s in stopped.segments] == [(True, False), (True, False), (False, True)]
    assert [step for step, _ in list_checkpoints(segment_dir(run, final.index))] == [3]
    run_follow(config)  # generate has finished: nothing staged any more
    assert_same_end(run, outpaced.run)
    check_followed(cache, run, config)
