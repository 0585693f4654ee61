"""Round trip: samples written through several writer sessions read back bit-exactly by id."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from dflash_offline.cache.codecs import CODECS
from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.manifest import committed_sample_ids
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cache.zarr_format import ARRAYS
from dflash_offline.errors import SampleError
from tests.cache._samples import TINY, assert_same, bits, make_fingerprint, make_sample, make_samples

LOSSLESS = sorted(name for name, spec in CODECS.items() if spec.fp8 is None and spec.nf4 is None)
"""Bit-exact codecs (the lossy fp8 codecs have their own tests: test_fp8.py)."""


def write_sessions(root, fingerprint, sessions: list[list[SampleToWrite]], **kwargs) -> list[ShardWriter]:
    writers = []
    for number, samples in enumerate(sessions):
        with ShardWriter(root, fingerprint, worker=number % 2, flush_seconds=1e9, **TINY, **kwargs) as writer:
            for i, sample in enumerate(samples):
                writer.add(sample)
                if i == len(samples) // 2:
                    writer.flush()  # an explicit flush mid-session leaves a gap up to the next shard
        writers.append(writer)
    return writers


@pytest.mark.parametrize("codec", LOSSLESS)
def test_round_trip_several_sessions_any_order(tmp_path, codec):
    fingerprint = make_fingerprint(codec=codec)
    samples = make_samples(fingerprint, range(60))
    # One sample longer than several shards (64 rows each) and one of a single token.
    samples.append(make_sample(fingerprint, 60, num_tokens=200))
    samples.append(make_sample(fingerprint, 61, num_tokens=1))
    random.Random(0).shuffle(samples)
    sessions = [samples[:25], samples[25:40], samples[40:]]
    writers = write_sessions(tmp_path, fingerprint, sessions)
    assert sum(w.stats.samples for w in writers) == len(samples)
    assert len({w.shard for w in writers}) == 3

    want = {s.sample_id: s for s in samples}
    with CacheReader.open(tmp_path, num_threads=3, check_checksums=True) as reader:
        assert len(reader.samples) == len(samples)
        # The table is ordered by source index, whatever session wrote a sample.
        assert reader.samples.source_index.tolist() == sorted(s.source_index for s in samples)
        ids = list(want)
        random.Random(1).shuffle(ids)
        ids += ids[:3]  # repeats are allowed
        for start in range(0, len(ids), 17):
            batch = ids[start : start + 17]
            for got, sample_id in zip(reader.read(batch), batch, strict=True):
                assert_same(got, want[sample_id])
        rows = np.arange(len(reader.samples))[::-1]
        for got, row in zip(reader.read_rows(rows), rows, strict=True):
            assert_same(got, want[str(reader.samples.sample_id[row])])


def test_every_bf16_bit_pattern_round_trips(tmp_path, fingerprint):
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, fingerprint.feature_width)
    base = make_sample(fingerprint, 0, num_tokens=patterns.shape[0])
    sample = SampleToWrite(
        sample_id="all-patterns",
        source_index=0,
        input_ids_T=base.input_ids_T,
        loss_mask_T=base.loss_mask_T,
        features_TF=torch.from_numpy(patterns.view(np.int16)).view(torch.bfloat16),
        bucket_id=base.bucket_id,
    )
    with ShardWriter(tmp_path, fingerprint, worker=0) as writer:
        writer.add(sample)
    with CacheReader.open(tmp_path) as reader:
        (got,) = reader.read(["all-patterns"])
    np.testing.assert_array_equal(bits(got.features_TF), patterns)


@pytest.mark.parametrize("codec", LOSSLESS)
def test_independent_readers_see_the_same_bytes(tmp_path, codec):
    """zarr-python and tensorstore decode the shard files we write to the rows the manifest names."""
    import tensorstore as ts
    import zarr

    fingerprint = make_fingerprint(codec=codec)
    samples = make_samples(fingerprint, range(30))
    write_sessions(tmp_path, fingerprint, [samples])  # flushes mid-way: a partial, padded last shard

    def ts_open(path):
        return ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, read=True
        ).result()

    with CacheReader.open(tmp_path) as reader:
        table = reader.samples
        want = {s.sample_id: s for s in samples}
        group = CacheLayout.at(tmp_path).shard_group(str(table.shard[0]))
        arrays = {name: (zarr.open_array(group / name, mode="r"), ts_open(group / name)) for name in ARRAYS}
        assert arrays["features"][0].attrs["dtype"] == "bfloat16"
        for row in range(len(table)):
            a, b = int(table.row_start[row]), int(table.row_start[row] + table.num_tokens[row])
            expected = want[str(table.sample_id[row])]
            wanted = {
                "features": bits(expected.features_TF),
                "input_ids": expected.input_ids_T,
                "loss_mask": expected.loss_mask_T,
            }
            for name, (z, t) in arrays.items():
                np.testing.assert_array_equal(z[a:b], wanted[name])
                np.testing.assert_array_equal(t[a:b].read().result(), wanted[name])


def test_general_uncompressed_path_matches_the_fast_path(tmp_path):
    """Shards are read with one preadv per piece when their chunks lie in order; the chunk-by-chunk
    path (used otherwise) must return the same rows."""
    from dflash_offline.cache.shard_file import Piece, ShardFile
    from dflash_offline.cache.zarr_format import parse_array_format

    fingerprint = make_fingerprint(codec="none")
    write_sessions(tmp_path, fingerprint, [make_samples(fingerprint, range(20))])
    group = next((tmp_path / "shards").glob("*.zarr"))
    fmt = parse_array_format(group / "features", "features")
    fast, slow = ShardFile(fmt, 0), ShardFile(fmt, 0)
    slow.linear_rows = 0
    assert fast.linear_rows == fmt.shard_rows
    spans = [(0, 5), (5, 13), (20, 21), (21, 64), (30, 40)]
    got = {}
    for name, shard_file in (("fast", fast), ("slow", slow)):
        pieces = [Piece(row0=a, row1=b, out=np.empty((b - a, fmt.width), np.uint16)) for a, b in spans]
        shard_file.read_pieces(sorted(pieces, key=lambda p: p.row0), None)
        got[name] = [p.out for p in pieces]
    for x, y in zip(got["fast"], got["slow"], strict=True):
        np.testing.assert_array_equal(x, y)


def test_partial_cache_is_readable_and_refresh_sees_new_commits(tmp_path, fingerprint):
    samples = make_samples(fingerprint, range(12))
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for s in samples[:5]:
            writer.add(s)
        writer.flush()
        for s in samples[5:]:
            writer.add(s)  # staged (and maybe whole shards written), not committed
        reader = CacheReader.open(tmp_path)
        assert set(reader.samples.sample_id.tolist()) == {s.sample_id for s in samples[:5]}
        for got, s in zip(reader.read([s.sample_id for s in samples[:5]]), samples[:5], strict=True):
            assert_same(got, s)
        with pytest.raises(SampleError, match="not committed"):
            reader.read([samples[7].sample_id])
        writer.flush()
        reader.refresh()
        assert len(reader.samples) == 12
        for got, s in zip(reader.read([s.sample_id for s in samples]), samples, strict=True):
            assert_same(got, s)
        reader.close()


def test_whole_shards_are_written_before_commit_and_each_shard_file_once(tmp_path, fingerprint):
    layout = CacheLayout.at(tmp_path)
    seen: dict[str, tuple[int, int]] = {}  # shard file -> (inode, mtime) when first seen
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        assert (writer.chunk_rows, writer.shard_rows) == (8, 64)
        rows = []
        for i, sample in enumerate(make_samples(fingerprint, range(40))):
            writer.add(sample)
            if i % 9 == 8:
                rows += writer.flush()
            for path in (layout.shard_group(writer.shard) / "features" / "c").rglob("*"):
                if path.is_file():
                    stat = path.stat()
                    assert seen.setdefault(str(path), (stat.st_ino, stat.st_mtime_ns)) == (
                        stat.st_ino,
                        stat.st_mtime_ns,
                    )
        # Some whole shards were written by add() alone, before the rows in them were committed.
        assert len(seen) > 0
        assert len(committed_sample_ids(tmp_path)) == len(rows) < 40
        rows += writer.flush()
    rows.sort(key=lambda r: r.row_start)
    for previous, row in itertools.pairwise(rows):
        assert row.row_start >= previous.row_start + previous.num_tokens  # never overlapping
    # Every explicit flush moved the next sample to a shard boundary (a gap, never a rewrite).
    flushed_starts = {r.row_start for r in rows} & {k * writer.shard_rows for k in range(100)}
    assert len(flushed_starts) >= 4


def test_flush_seconds_commits_by_itself(tmp_path, fingerprint):
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=0.0, **TINY) as writer:
        for i, sample in enumerate(make_samples(fingerprint, range(5))):
            writer.add(sample)
            assert len(committed_sample_ids(tmp_path)) == i + 1
        assert writer.stats.flushes == 5
    assert writer.close().samples == 5  # idempotent


def test_read_rows_into_a_packed_buffer_and_from_threads(tmp_path, fingerprint):
    from concurrent.futures import ThreadPoolExecutor

    samples = make_samples(fingerprint, range(25))
    write_sessions(tmp_path, fingerprint, [samples[:10], samples[10:]])
    want = {s.sample_id: s for s in samples}
    with CacheReader.open(tmp_path, num_threads=2) as reader:
        rows = [7, 3, 3, 24, 0]
        total = int(reader.samples.num_tokens[rows].sum())
        packed = np.full((total + 5, fingerprint.feature_width), 0xABCD, dtype=np.uint16)
        got = reader.read_rows(rows, features_out=packed)
        offset = 0
        for sample in got:
            expected = want[sample.sample_id]
            assert_same(sample, expected)
            np.testing.assert_array_equal(
                packed[offset : offset + sample.num_tokens], bits(expected.features_TF)
            )
            assert sample.features_TF.data_ptr() == packed[offset:].ctypes.data  # a view, not a copy
            offset += sample.num_tokens
        assert (packed[total:] == 0xABCD).all()
        with pytest.raises(SampleError, match="features_out must be"):
            reader.read_rows(rows, features_out=packed[: total - 1])

        def read_all(seed: int) -> None:
            order = np.random.default_rng(seed).permutation(len(reader.samples))
            for row, sample in zip(order, reader.read_rows(order), strict=True):
                assert_same(sample, want[str(reader.samples.sample_id[row])])

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(read_all, range(8)))


def test_fsync_writer_round_trips_and_leaves_no_temp_files(tmp_path, fingerprint):
    from dflash_offline.cache.layout import partial_files

    samples = make_samples(fingerprint, range(15))
    with ShardWriter(tmp_path, fingerprint, worker=0, fsync=True, flush_seconds=1e9, **TINY) as writer:
        for i, sample in enumerate(samples):
            writer.add(sample)
            if i == 7:
                writer.flush()
    assert partial_files(tmp_path) == []
    with CacheReader.open(tmp_path) as reader:
        for got, want in zip(reader.read([s.sample_id for s in samples]), samples, strict=True):
            assert_same(got, want)
