"""The vectorised planner and snapshot give exactly the plans, step counts and snapshot ids of
the per-sample Python versions they replaced (``_planner_v1.py`` is a frozen copy of the old planner;
the old snapshot id and sort are re-implemented below), so a run's loss curve does not change."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dflash_offline.train import planner as new_planner
from dflash_offline.train.snapshot import (
    SNAPSHOT_FORMAT_VERSION,
    bind_snapshot,
    compute_snapshot_id,
    snapshot_from_columns,
)
from tests.train import _planner_v1 as old_planner


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
    dict(tokens_per_microbatch=3000, grad_accum=3, world_size=2, drop_last=True),
    dict(tokens_per_microbatch=8192, grad_accum=1, world_size=3),
]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_plans_equal_the_old_planner(topology):
    _ids, _tokens, _buckets, snap = random_snapshot(3, 2500)
    old = old_planner.LengthMixingPlanner(snap, seed=11, **topology)
    new = new_planner.LengthMixingPlanner(snap, seed=11, **topology)
    for epoch in range(3):
        assert new.epoch_plan(epoch) == old.epoch_plan(epoch)
        assert new.steps_per_epoch(epoch) == old.steps_per_epoch(epoch)
    assert new.total_steps(4) == old.total_steps(4)
    assert list(new.iterate(2)) == list(old.iterate(2))


def test_resumed_and_topology_changed_plans_equal_the_old_planner():
    _ids, _tokens, _buckets, snap = random_snapshot(4, 1500)
    first = dict(tokens_per_microbatch=4096, grad_accum=2, world_size=2)
    then = dict(tokens_per_microbatch=4096, grad_accum=1, world_size=3)
    plans = {}
    for name, module in (("old", old_planner), ("new", new_planner)):
        planner = module.LengthMixingPlanner(snap, seed=5, **first)
        for step, _ in zip(planner.iterate(), range(7)):
            planner.step_done(step)
        resumed = module.LengthMixingPlanner(snap, seed=5, **then)
        resumed.load_state_dict(planner.state_dict(), allow_topology_change=True)
        plans[name] = (list(resumed.iterate(2)), resumed.total_steps(3), resumed.steps_per_epoch())
    assert plans["new"] == plans["old"]
