"""The index snapshot: training on a partial cache, and resuming on the same sample set after generate
has committed more."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.errors import CacheFormatError
from dflash_offline.train.loader import Prefetcher
from dflash_offline.train.planner import LengthMixingPlanner, schedule_for_rank
from dflash_offline.train.snapshot import (
    bind_snapshot,
    load_snapshot,
    read_snapshot,
    save_snapshot,
    snapshot_from_columns,
    take_snapshot,
)
from tests.train.cache_helpers import fingerprint, make_samples, write_cache
from tests.train.plan_helpers import bucket_token_shares, epoch_plan

pytestmark = pytest.mark.timeout(120)


def test_training_reads_a_cache_that_generate_is_still_writing(tmp_path: Path) -> None:
    samples = make_samples(40, seed=2)
    writer = ShardWriter(tmp_path, fingerprint(), worker=0, shard_bytes=2048, chunk_bytes=256)
    try:
        for s in samples[:25]:
            writer.add(s)
        writer.flush()  # 25 committed
        for s in samples[25:]:
            writer.add(s)  # staged, not committed: invisible to training
        with CacheReader.open(tmp_path, num_threads=2) as reader:
            snap = take_snapshot(reader)
            assert set(snap.sample_ids) == {s.sample_id for s in samples[:25]}
            planner = LengthMixingPlanner(snap, seed=0, tokens_per_microbatch=256, grad_accum=1, world_size=1)
            jobs = schedule_for_rank(planner.iterate(1), rank=0, seed=0, reader_rows_N=snap.reader_rows_N)
            with Prefetcher(reader, jobs, device="cpu", num_threads=2) as prefetcher:
                seen = [sid for batch in prefetcher for sid in batch.plan.sample_ids]
        assert sorted(seen) == sorted(snap.sample_ids)
        by_id = {s.sample_id: s for s in samples}
        with CacheReader.open(tmp_path) as reader:
            first = reader.read([seen[0]])[0]
        assert torch.equal(first.features_TF.view(torch.int16), by_id[seen[0]].features_TF.view(torch.int16))
    finally:
        writer.close()


def test_resume_sees_the_saved_sample_set_after_more_commits(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    samples = make_samples(50, seed=3)
    write_cache(cache, samples[:30], worker=0)
    with CacheReader.open(cache) as reader:
        snap = take_snapshot(reader)
    save_snapshot(snap, tmp_path / "snapshot.parquet")
    planner = LengthMixingPlanner(snap, seed=1, tokens_per_microbatch=256, grad_accum=2, world_size=1)
    plan = epoch_plan(planner, 0)

    write_cache(cache, samples[30:], worker=1)  # generate went on; row order in the reader changes
    with CacheReader.open(cache) as reader:
        assert len(take_snapshot(reader)) == 50
        loaded = load_snapshot(tmp_path / "snapshot.parquet", reader)
        assert loaded.snapshot_id == snap.snapshot_id
        assert loaded.sample_ids == snap.sample_ids
        again = LengthMixingPlanner(loaded, seed=1, tokens_per_microbatch=256, grad_accum=2, world_size=1)
        assert epoch_plan(again, 0) == plan
        read = reader.read_rows(loaded.reader_rows_N)
        assert [s.sample_id for s in read] == list(loaded.sample_ids)


def test_snapshot_file_damage_and_version_are_refused(tmp_path: Path) -> None:
    snap = snapshot_from_columns(["b", "a", "c"], [5, 7, 9], [0, 0, 1])
    assert snap.sample_ids == ("a", "b", "c")
    assert snap.num_tokens_N.tolist() == [7, 5, 9]
    path = tmp_path / "snapshot.parquet"
    save_snapshot(snap, path)
    assert read_snapshot(path).snapshot_id == snap.snapshot_id
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    tampered = table.set_column(
        1, "num_tokens", pa.array(table.column("num_tokens").to_numpy() + np.array([0, 1, 0]))
    )
    pq.write_table(tampered.replace_schema_metadata(meta), path)
    with pytest.raises(CacheFormatError, match="damaged"):
        read_snapshot(path)
    pq.write_table(table.replace_schema_metadata({**meta, b"dflash_snapshot_version": b"9"}), path)
    with pytest.raises(CacheFormatError, match="version '9'"):
        read_snapshot(path)
    with pytest.raises(CacheFormatError, match="more than once"):
        snapshot_from_columns(["a", "a"], [1, 2], [0, 0])


def test_binding_refuses_a_cache_that_lost_or_changed_samples(tmp_path: Path) -> None:
    samples = make_samples(10, seed=4)
    write_cache(tmp_path, samples)
    with CacheReader.open(tmp_path) as reader:
        snap = take_snapshot(reader)
        lost = snapshot_from_columns(
            [*snap.sample_ids, "synthetic:gone"], [*snap.num_tokens_N, 3], [*snap.bucket_ids_N, 0]
        )
        with pytest.raises(CacheFormatError, match="synthetic:gone"):
            bind_snapshot(lost, reader)
        changed_tokens = snap.num_tokens_N.copy()
        changed_tokens[4] += 1
        changed = snapshot_from_columns(snap.sample_ids, changed_tokens, snap.bucket_ids_N)
        with pytest.raises(CacheFormatError, match=snap.sample_ids[4]):
            bind_snapshot(changed, reader)


def test_length_mixing_on_a_real_cache_with_four_buckets(tmp_path: Path) -> None:
    """Counts ∝ 1 / mean length, so the four buckets hold similar token mass; 2 ranks × 2 microbatches."""
    rng = np.random.default_rng(5)
    lengths = np.concatenate(
        [
            rng.integers(lo, hi + 1, n)
            for lo, hi, n in ((1, 16, 330), (17, 32, 115), (33, 64, 58), (65, 128, 29))
        ]
    )
    rng.shuffle(lengths)
    write_cache(tmp_path, make_samples(len(lengths), seed=5, lengths=lengths.tolist()))
    with CacheReader.open(tmp_path) as reader:
        snap = take_snapshot(reader)
    shares = bucket_token_shares(snap)
    assert len(shares) == 4
    assert min(shares.values()) > 0.15
    budget = 256
    steps = epoch_plan(
        LengthMixingPlanner(snap, seed=9, tokens_per_microbatch=budget, grad_accum=2, world_size=2), 0
    )
    assert len(steps) >= 8
    rows = [r for s in steps for mb in s.microbatches if not mb.is_padding for r in mb.rows]
    assert sorted(rows) == list(range(len(snap))), "every sample exactly once"
    consumed = dict.fromkeys(shares, 0)
    for step in steps:
        if step.num_microbatches_per_rank == 2:
            assert len({mb.bucket_ids[0] for mb in step.microbatches}) >= 3, "every full step mixes lengths"
        for mb in step.microbatches:
            consumed[mb.bucket_ids[0]] += 0 if mb.is_padding else mb.num_tokens
        total = sum(consumed.values())
        for b, share in shares.items():
            assert abs(consumed[b] - share * total) <= budget * (1 + share * len(shares))


def test_snapshot_sharing_the_callers_str_objects_equals_the_arrow_path() -> None:
    rng = np.random.default_rng(5)
    ids = [f"s{int(i):05d}" for i in rng.permutation(300)] + ["é-1", "z", "Z", "ß"]
    tokens, buckets = rng.integers(1, 500, len(ids)), rng.integers(0, 4, len(ids))
    as_objects = np.array(ids, dtype=object)
    shared = snapshot_from_columns(as_objects, tokens, buckets, np.arange(len(ids)), ids_are_str_objects=True)
    built = snapshot_from_columns(pa.array(ids), tokens, buckets, np.arange(len(ids)))
    assert shared.sample_ids == built.sample_ids == tuple(sorted(ids))  # Python's own str order
    assert shared.snapshot_id == built.snapshot_id
    np.testing.assert_array_equal(shared.reader_rows_N, built.reader_rows_N)
    np.testing.assert_array_equal(shared.num_tokens_N, tokens[np.argsort(as_objects, kind="stable")])
