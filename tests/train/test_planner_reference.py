"""The planner and the snapshot against brute-force references: the snapshot's sort and id spelled out
sample by sample, and every plan checked for what the planner guarantees (``plan_helpers.check_epoch``:
each sample once per epoch, the token budget, balanced ranks, bucket shares), for a seed built twice,
resumed after every step, and resumed under another topology."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dflash_offline.train.planner import LengthMixingPlanner
from dflash_offline.train.snapshot import (
    SNAPSHOT_FORMAT_VERSION,
    bind_snapshot,
    compute_snapshot_id,
    snapshot_from_columns,
)
from tests.train.plan_helpers import check_epoch, epoch_plan, real_rows


def old_snapshot_id(ids: tuple[str, ...], tokens: np.ndarray, buckets: np.ndarray) -> str:
    digest = hashlib.sha256()
    digest.update(f"dflash-snapshot-v{SNAPSHOT_FORMAT_VERSION}\n".encode())
    for sid, n, b in zip(ids, tokens.tolist(), buckets.tolist(), strict=True):
        digest.update(f"{sid}\t{n}\t{b}\n".encode())
    return digest.hexdigest()


def random_snapshot(seed: int, n: int):
    rng = np.random.default_rng(seed)
    # Mixed-width ids with non-ASCII characters: the sort must be Python's str order.
    ids = [f"{rng.choice(['src', 'ß', 'a/b', 'Z'])}:{int(v)}" for v in rng.choice(10**7, n, replace=False)]
    tokens = rng.integers(1, 3000, n)
    buckets = np.searchsorted([256, 512, 1024, 2048, 3072], tokens)
    return ids, tokens, buckets, snapshot_from_columns(ids, tokens, buckets, reader_rows=rng.permutation(n))


@pytest.mark.parametrize("seed", [0, 1])
def test_snapshot_sort_and_id_equal_the_python_versions(seed):
    ids, tokens, _buckets, snap = random_snapshot(seed, 3000)
    order = np.argsort(np.asarray(ids, dtype=object), kind="stable")
    assert snap.sample_ids == tuple(np.asarray(ids, dtype=object)[order].tolist())
    np.testing.assert_array_equal(snap.num_tokens_N, tokens[order])
    assert snap.snapshot_id == old_snapshot_id(snap.sample_ids, snap.num_tokens_N, snap.bucket_ids_N)
    assert compute_snapshot_id(snap.sample_ids, snap.num_tokens_N, snap.bucket_ids_N) == snap.snapshot_id


def test_bind_finds_every_row_and_names_the_missing():
    from types import SimpleNamespace

    from dflash_offline.errors import CacheFormatError

    ids, tokens, buckets, snap = random_snapshot(2, 500)
    perm = np.random.default_rng(9).permutation(500)
    table = SimpleNamespace(
        sample_id=np.asarray(ids, dtype=object)[perm], num_tokens=tokens[perm], bucket_id=buckets[perm]
    )
    bound = bind_snapshot(snap, SimpleNamespace(samples=table))
    assert list(table.sample_id[bound.reader_rows_N]) == list(snap.sample_ids)
    short = SimpleNamespace(
        sample_id=table.sample_id[1:], num_tokens=tokens[perm][1:], bucket_id=buckets[perm][1:]
    )
    with pytest.raises(
        CacheFormatError, match=rf"no longer holds 1 of the run's 500 samples \(first: '{table.sample_id[0]}'"
    ):
        bind_snapshot(snap, SimpleNamespace(samples=short))


TOPOLOGIES = [
    dict(tokens_per_microbatch=4096, grad_accum=2, world_size=1),
    dict(tokens_per_microbatch=3000, grad_accum=3, world_size=2),
    dict(tokens_per_microbatch=8192, grad_accum=1, world_size=3),
    dict(tokens_per_microbatch=3000, grad_accum=2, world_size=8),
]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_epoch_keeps_the_planners_guarantees_and_is_a_function_of_the_seed(topology):
    _ids, _tokens, _buckets, snap = random_snapshot(3, 2500)
    planner = LengthMixingPlanner(snap, seed=11, **topology)
    whole = list(planner.iterate(3))
    for epoch in range(3):
        steps = [s for s in whole if s.epoch == epoch]
        check_epoch(snap, steps, epoch=epoch, **topology)
        assert len(steps) == planner.steps_per_epoch(epoch)
    assert [s.global_step for s in whole] == list(range(len(whole)))
    assert planner.total_steps(3) == len(whole)
    again = LengthMixingPlanner(random_snapshot(3, 2500)[3], seed=11, **topology)
    assert list(again.iterate(3)) == whole, "the same seed and samples give the same plan"
    other = LengthMixingPlanner(snap, seed=12, **topology)
    assert epoch_plan(other, 0) != [s for s in whole if s.epoch == 0]


def _run(planner: LengthMixingPlanner, num_steps: int, num_epochs: int) -> list:
    taken = []
    for step, _ in zip(planner.iterate(num_epochs), range(num_steps)):
        taken.append(step)
        planner.step_done(step)
    return taken


def test_a_resume_after_any_step_continues_the_same_plan():
    _ids, _tokens, _buckets, snap = random_snapshot(5, 400)
    topology = dict(tokens_per_microbatch=3000, grad_accum=2, world_size=2)
    reference = list(LengthMixingPlanner(snap, seed=4, **topology).iterate(2))
    for cut in range(len(reference) + 1):
        first = LengthMixingPlanner(snap, seed=4, **topology)
        done = _run(first, cut, 2)
        resumed = LengthMixingPlanner(snap, seed=4, **topology)
        resumed.load_state_dict(first.state_dict())
        assert resumed.position == first.position
        assert done + list(resumed.iterate(2)) == reference, cut


def test_a_resume_under_another_topology_finishes_the_epoch_exactly_once():
    _ids, _tokens, _buckets, snap = random_snapshot(4, 1500)
    first_topology = dict(tokens_per_microbatch=4096, grad_accum=2, world_size=2)
    then = dict(tokens_per_microbatch=4096, grad_accum=1, world_size=3)
    first = LengthMixingPlanner(snap, seed=5, **first_topology)
    done = _run(first, 7, 2)
    resumed = LengthMixingPlanner(snap, seed=5, **then)
    resumed.load_state_dict(
        first.state_dict()
    )  # admitted with --allow-topology-change (test_resume_contract.py)
    assert resumed.steps_per_epoch() == len([s for s in resumed.iterate(1)]) + 7
    rest = list(resumed.iterate(2))
    assert resumed.total_steps(3) == 7 + len(rest) + resumed.steps_per_epoch(2)
    epoch0 = [s for s in done + rest if s.epoch == 0]
    assert sorted(real_rows(epoch0)) == list(range(len(snap))), "each sample once in the changed epoch"
    assert [s.step_in_epoch for s in epoch0] == list(range(len(epoch0)))
    assert [s.global_step for s in done + rest] == list(range(len(done + rest)))
    for step in rest:
        if step.epoch == 0:
            assert {mb.rank for mb in step.microbatches} == {0, 1, 2}
            assert all(mb.num_tokens <= 4096 for mb in step.microbatches)
    epoch1 = [s for s in rest if s.epoch == 1]
    check_epoch(snap, epoch1, epoch=1, **then)
    fresh = epoch_plan(LengthMixingPlanner(snap, seed=5, **then), 1)
    assert [s.microbatches for s in epoch1] == [s.microbatches for s in fresh], "later epochs plan afresh"
