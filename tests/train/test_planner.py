"""Properties of the length-mixing planner, checked against brute-force recounts of its plans.

Tolerance stated by the planner (module docstring) and tested here: after any number of whole steps,
bucket b's consumed tokens differ from share_b × (all consumed tokens) by at most
tokens_per_microbatch × (1 + share_b × num_buckets). Over a whole epoch the shares are
exact, because every sample is planned exactly once.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from dflash_offline.errors import ConfigError
from dflash_offline.train.planner import (
    LengthMixingPlanner,
    RankSteps,
    StepPlan,
    anchor_seed,
    schedule_for_rank,
)
from dflash_offline.train.snapshot import IndexSnapshot, snapshot_from_columns
from tests.train.plan_helpers import bucket_token_shares, epoch_plan, rank_tokens, real_rows

EDGES = (256, 512, 1024, 2048, 4096)


def make_snapshot(num_samples: int = 600, seed: int = 0) -> IndexSnapshot:
    """Lengths spread over 5 buckets with token shares of very roughly 5/15/25/30/25 %."""
    rng = np.random.default_rng(seed)
    counts = np.array([0.25, 0.25, 0.25, 0.15, 0.10]) * num_samples
    lows, highs = (16, 257, 513, 1025, 2049), EDGES
    tokens = np.concatenate([rng.integers(lo, hi + 1, int(n)) for lo, hi, n in zip(lows, highs, counts)])
    rng.shuffle(tokens)
    buckets = np.searchsorted(np.asarray(EDGES), tokens)  # first edge >= num_tokens
    ids = [f"src:{i:05d}:{rng.integers(1 << 30):08x}" for i in range(len(tokens))]
    return snapshot_from_columns(ids, tokens, buckets)


def planner(snap: IndexSnapshot, **kw: object) -> LengthMixingPlanner:
    args: dict[str, object] = dict(seed=7, tokens_per_microbatch=4096, grad_accum=2, world_size=4)
    args.update(kw)
    return LengthMixingPlanner(snap, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world_size", "grad_accum", "budget"), [(1, 1, 4096), (4, 2, 4096), (3, 5, 8192), (8, 1, 5000)]
)
def test_every_sample_exactly_once_per_epoch(world_size: int, grad_accum: int, budget: int) -> None:
    snap = make_snapshot()
    p = planner(snap, world_size=world_size, grad_accum=grad_accum, tokens_per_microbatch=budget)
    for epoch in range(3):
        steps = epoch_plan(p, epoch)
        assert sorted(real_rows(steps)) == list(range(len(snap)))
        assert len(steps) == p.steps_per_epoch(epoch)
        per_rank = [
            r
            for rank in range(world_size)
            for job in schedule_for_rank(steps, rank=rank, seed=7, reader_rows_N=np.arange(len(snap)))
            if not job.plan.is_padding
            for r in job.reader_rows
        ]
        assert sorted(per_rank) == list(range(len(snap))), "the ranks' shares partition the epoch"
        for step in steps:
            assert step.epoch == epoch
            for mb in step.microbatches:
                assert mb.num_tokens == int(snap.num_tokens_N[list(mb.rows)].sum()) <= budget
                assert len(set(mb.bucket_ids)) == 1, "a microbatch packs one bucket"
                assert mb.sample_ids == tuple(snap.sample_ids[r] for r in mb.rows)
                assert mb.bucket_ids == tuple(int(snap.bucket_ids_N[r]) for r in mb.rows)


def test_steps_mix_buckets_and_token_shares_track_the_cache() -> None:
    snap = make_snapshot()
    budget, p = 4096, planner(snap)
    shares = bucket_token_shares(snap)
    assert len(shares) == 5
    steps = epoch_plan(p, 0)
    assert len(steps) > 10
    consumed: Counter[int] = Counter()
    for step in steps:
        full = step.num_microbatches_per_rank == 2
        buckets_in_step = {mb.bucket_ids[0] for mb in step.microbatches}
        if full:
            assert len(buckets_in_step) >= 3, f"step {step.step_in_epoch} holds buckets {buckets_in_step}"
            for b, share in shares.items():
                if share >= 0.2:
                    assert b in buckets_in_step, f"bucket {b} ({share:.0%}) missing from a step"
        for mb in step.microbatches:
            if not mb.is_padding:
                consumed[mb.bucket_ids[0]] += mb.num_tokens
        total = sum(consumed.values())
        for b, share in shares.items():
            bound = budget * (1 + share * len(shares))
            assert abs(consumed[b] - share * total) <= bound, (step.step_in_epoch, b)
    # Whole epoch: every sample once, so the shares equal the cache's exactly.
    total = sum(consumed.values())
    assert total == snap.total_tokens
    for b, share in shares.items():
        assert consumed[b] / total == pytest.approx(share, abs=1e-12)


def test_first_half_of_epoch_has_the_cache_shares() -> None:
    """A windowed view of the same property, with a tolerance in share points: half an epoch (≈ 150k
    tokens) keeps every bucket within 4 points of its share in the cache."""
    snap = make_snapshot(1200)
    steps = epoch_plan(planner(snap), 0)
    half = steps[: len(steps) // 2]
    tokens: Counter[int] = Counter()
    for step in half:
        for mb in step.microbatches:
            tokens[mb.bucket_ids[0]] += mb.num_tokens
    total = sum(tokens.values())
    for b, share in bucket_token_shares(snap).items():
        assert abs(tokens[b] / total - share) < 0.04


def test_plan_is_a_pure_function_of_seed_epoch_snapshot() -> None:
    snap = make_snapshot()
    a, b = planner(snap), planner(make_snapshot())  # same content, built twice
    assert epoch_plan(a, 1) == epoch_plan(b, 1)
    assert epoch_plan(a, 0) != epoch_plan(a, 1), "epochs are shuffled differently"
    assert epoch_plan(planner(snap, seed=8), 0) != epoch_plan(a, 0)
    # Input order of the columns does not matter: the snapshot sorts by sample id.
    order = np.random.default_rng(3).permutation(len(snap))
    shuffled = snapshot_from_columns(
        [snap.sample_ids[i] for i in order], snap.num_tokens_N[order], snap.bucket_ids_N[order]
    )
    assert shuffled.snapshot_id == snap.snapshot_id
    assert epoch_plan(planner(shuffled), 0) == epoch_plan(a, 0)


def test_ranks_get_equal_counts_and_balanced_tokens() -> None:
    snap = make_snapshot()
    p = planner(snap, world_size=4, grad_accum=3)
    spread_balanced, spread_naive = 0, 0
    for step in epoch_plan(p, 0):
        k = step.num_microbatches_per_rank
        assert [len(step.for_rank(r)) for r in range(4)] == [k] * 4
        assert [mb.index_in_step for mb in step.microbatches] == list(range(4 * k))
        loads = [rank_tokens(step, r) for r in range(4)]
        biggest = max(mb.num_tokens for mb in step.microbatches)
        assert max(loads) - min(loads) <= biggest
        spread_balanced += max(loads) - min(loads)
        # The same microbatches dealt round-robin, for contrast.
        naive = [sum(mb.num_tokens for mb in step.microbatches[r::4]) for r in range(4)]
        spread_naive += max(naive) - min(naive)
    assert spread_balanced < spread_naive / 2


def test_last_step_is_kept_with_equal_counts_and_padding_only_if_needed() -> None:
    # 8 ranks, long samples: the leftover microbatches are single samples, so padding is needed.
    snap = snapshot_from_columns([f"s{i}" for i in range(21)], [3000] * 21, [3] * 21)
    p = LengthMixingPlanner(snap, seed=0, tokens_per_microbatch=4096, grad_accum=2, world_size=8)
    steps = epoch_plan(p, 0)
    assert [s.num_microbatches_per_rank for s in steps] == [2, 1]
    last = steps[-1]
    assert len(last.microbatches) == 8
    padding = [mb for mb in last.microbatches if mb.is_padding]
    assert len(padding) == 3  # 21 samples = 16 + 5 real, 3 fillers
    assert sorted(real_rows(steps)) == list(range(21))
    # Multi-sample leftovers are split before any padding is added.
    snap = snapshot_from_columns([f"s{i}" for i in range(40)], [100] * 40, [0] * 40)
    p = LengthMixingPlanner(snap, seed=0, tokens_per_microbatch=1000, grad_accum=2, world_size=3)
    steps = epoch_plan(p, 0)  # 4 microbatches of 10 samples: one step of 6 is not full
    assert not any(mb.is_padding for s in steps for mb in s.microbatches)
    assert sorted(real_rows(steps)) == list(range(40))
    assert all(len(s.microbatches) % 3 == 0 for s in steps)


def test_configuration_errors_name_the_value_and_the_fix() -> None:
    snap = snapshot_from_columns(["a", "b", "c"], [100, 5000, 20], [0, 4, 0])
    with pytest.raises(
        ConfigError, match=r"sample 'b' has 5000 tokens.*`DataConfig\.tokens_per_microbatch` 4096"
    ):
        LengthMixingPlanner(snap, seed=0, tokens_per_microbatch=4096, grad_accum=1, world_size=1)
    with pytest.raises(ConfigError, match="no committed samples"):
        LengthMixingPlanner(
            snapshot_from_columns([], [], []), seed=0, tokens_per_microbatch=64, grad_accum=1, world_size=1
        )
    with pytest.raises(ConfigError, match="grad_accum"):
        LengthMixingPlanner(snap, seed=0, tokens_per_microbatch=8192, grad_accum=0, world_size=1)


def run_steps(p: LengthMixingPlanner, n: int, num_epochs: int) -> list[StepPlan]:
    """Train n steps: take them from iterate() and report each done, as the loop does."""
    taken: list[StepPlan] = []
    for step in p.iterate(num_epochs):
        if len(taken) == n:
            break
        taken.append(step)
        p.step_done(step)
    return taken


def test_state_dict_round_trip_resumes_the_same_steps() -> None:
    snap = make_snapshot()
    reference = list(planner(snap).iterate(3))
    per_epoch = planner(snap).steps_per_epoch(0)
    for cut in (0, 5, per_epoch - 1, per_epoch, per_epoch + 3):
        first = planner(snap)
        done = run_steps(first, cut, 3)
        state = first.state_dict()
        second = planner(snap)
        second.load_state_dict(state)
        rest = list(second.iterate(3))
        assert done + rest == reference
        assert [s.global_step for s in done + rest] == list(range(len(reference)))
    assert planner(snap).total_steps(3) == len(reference)


def test_topology_change_mid_epoch_finishes_the_epoch_exactly_once() -> None:
    snap = make_snapshot()
    first = planner(snap, world_size=4, grad_accum=2)
    done = run_steps(first, 6, 3)
    second = planner(snap, world_size=3, grad_accum=1)
    second.load_state_dict(first.state_dict())  # the change the contract admits with --allow-topology-change
    done2 = run_steps(second, 4, 3)
    # A second change inside the same epoch: the segments chain.
    third = planner(snap, world_size=2, grad_accum=3)
    third.load_state_dict(second.state_dict())
    rest = []
    for step in third.iterate(2):
        rest.append(step)
        third.step_done(step)
    epoch0 = [s for s in done + done2 + rest if s.epoch == 0]
    assert sorted(real_rows(epoch0)) == list(range(len(snap)))
    steps_in_epoch = [s.step_in_epoch for s in epoch0]
    assert steps_in_epoch == list(range(len(epoch0)))
    assert {s.num_steps_in_epoch for s in rest if s.epoch == 0} == {len(epoch0)}
    all_steps = done + done2 + rest
    assert [s.global_step for s in all_steps] == list(range(len(all_steps)))
    epoch1 = [s for s in rest if s.epoch == 1]
    assert sorted(real_rows(epoch1)) == list(range(len(snap)))
    fresh = epoch_plan(planner(snap, world_size=2, grad_accum=3), 1)
    assert [s.microbatches for s in epoch1] == [s.microbatches for s in fresh], "later epochs plan afresh"
    assert third.position.epoch == 2


def test_schedule_for_rank_maps_rows_and_derives_anchor_seeds() -> None:
    snap = make_snapshot()
    bound = snapshot_from_columns(
        snap.sample_ids, snap.num_tokens_N, snap.bucket_ids_N, np.arange(len(snap)) * 10
    )
    steps = epoch_plan(planner(bound), 0)[:3]
    jobs = [
        list(schedule_for_rank(steps, rank=r, seed=7, reader_rows_N=bound.reader_rows_N)) for r in range(4)
    ]
    seeds = [j.anchor_seed for rank_jobs in jobs for j in rank_jobs]
    assert len(set(seeds)) == len(seeds) == 3 * 8
    # The seed follows the microbatch's content, not its rank or position (topology-independent).
    for rank_jobs in jobs:
        for job in rank_jobs:
            assert job.anchor_seed == anchor_seed(7, 0, job.plan.sample_ids)
    again = list(schedule_for_rank(steps, rank=1, seed=7, reader_rows_N=bound.reader_rows_N))
    assert again == jobs[1]
    for job in jobs[2]:
        assert job.plan.rank == 2
        assert job.reader_rows == tuple(10 * r for r in job.plan.rows)
    assert [j.plan for j in jobs[2]] == [mb for step in steps for mb in step.for_rank(2)]


def test_rank_steps_regroups_what_comes_back_into_the_steps() -> None:
    """The loop's grouping: the jobs are drawn ahead of the consumer (as the prefetcher's threads draw
    them), and what comes back, in job order, is cut into the steps they came from."""
    snap = make_snapshot()
    steps = epoch_plan(planner(snap, grad_accum=3), 0)
    assert [s.num_microbatches_per_rank for s in steps[-2:]] == [3, 1], "the last step is shorter"
    rank_steps = RankSteps(iter(steps), rank=2, seed=7, reader_rows_N=np.arange(len(snap)))
    jobs = rank_steps.jobs()
    ahead = [next(jobs) for _ in range(4)]  # into the second step before the consumer takes any
    regrouped = list(rank_steps.regroup(itertools.chain(ahead, jobs)))
    assert [step for step, _ in regrouped] == steps
    for step, group in regrouped:
        assert [job.plan for job in group] == list(step.for_rank(2))
