"""verify: damage is found and attributed to the samples it hurts; crash leftovers are accounted for."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.shard_file import ShardFile
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cache.zarr_format import parse_array_format
from dflash_offline.errors import CacheDamageError
from tests.cache._samples import TINY, copy_part, make_fingerprint, make_samples


def write_cache(root, codec: str, n: int = 40):
    fingerprint = make_fingerprint(codec=codec)
    with ShardWriter(root, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for sample in make_samples(fingerprint, range(n)):
            writer.add(sample)
    return writer.shard


def samples_overlapping(root, shard: str, lo: int, hi: int) -> set[str]:
    with CacheReader.open(root) as reader:
        t = reader.samples
        hit = (t.shard == shard) & (t.row_start < hi) & (t.row_start + t.num_tokens > lo)
        return set(t.sample_id[hit].tolist())


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_clean_cache(tmp_path):
    write_cache(tmp_path, "blosc-zstd-1-shuffle")
    report = verify_cache(tmp_path, progress=False)
    assert report.ok, report.render()
    assert report.samples_checked == 40
    assert report.unreferenced == ()
    assert "OK" in report.render()


def test_flipped_byte_uncompressed_names_exactly_the_hurt_sample(tmp_path):
    shard = write_cache(tmp_path, "none")
    group = CacheLayout.at(tmp_path).shard_group(shard)
    fmt = parse_array_format(group / "features", "features")
    shard_file = ShardFile(fmt, 1)
    row = 64 + 21  # a row of shard file 1, inner chunk 2
    chunk = (row - 64) // fmt.chunk_rows
    offset = int(shard_file.offsets[chunk]) + ((row - 64) % fmt.chunk_rows) * fmt.row_bytes + 5
    flip(shard_file.path, offset)
    hurt = samples_overlapping(tmp_path, shard, row, row + 1)
    assert len(hurt) == 1

    report = verify_cache(tmp_path, progress=False)
    assert not report.ok
    assert report.damaged_by_shard() == {shard: sorted(hurt)}
    assert "checksum mismatch" in report.damaged[0].problem
    assert sorted(hurt)[0] in report.render()
    with (
        CacheReader.open(tmp_path, check_checksums=True) as reader,
        pytest.raises(CacheDamageError, match="checksum"),
    ):
        reader.read(sorted(hurt))


def test_flipped_byte_compressed_is_confined_to_its_chunk(tmp_path):
    shard = write_cache(tmp_path, "blosc-zstd-1-shuffle")
    group = CacheLayout.at(tmp_path).shard_group(shard)
    fmt = parse_array_format(group / "features", "features")
    shard_file = ShardFile(fmt, 2)
    chunk = 3
    offset = int(shard_file.offsets[chunk] + shard_file.nbytes[chunk] // 2)
    flip(shard_file.path, offset)
    lo = 2 * fmt.shard_rows + chunk * fmt.chunk_rows
    in_chunk = samples_overlapping(tmp_path, shard, lo, lo + fmt.chunk_rows)

    report = verify_cache(tmp_path, progress=False)
    damaged = {d.sample_id for d in report.damaged}
    assert damaged, in_chunk
    assert damaged <= in_chunk, (damaged, in_chunk)


def test_damaged_shard_index_hurts_every_sample_in_that_file(tmp_path):
    shard = write_cache(tmp_path, "zstd-1")
    group = CacheLayout.at(tmp_path).shard_group(shard)
    path = group / "features" / "c" / "1" / "0"
    flip(path, path.stat().st_size - 10)  # inside the chunk index
    in_file = samples_overlapping(tmp_path, shard, 64, 128)
    report = verify_cache(tmp_path, progress=False)
    assert {d.sample_id for d in report.damaged} == in_file
    assert all("crc32c" in d.problem for d in report.damaged)


def test_missing_shard_file_is_damage(tmp_path):
    shard = write_cache(tmp_path, "none")
    group = CacheLayout.at(tmp_path).shard_group(shard)
    (group / "input_ids" / "c" / "0").unlink()
    report = verify_cache(tmp_path, progress=False)
    assert {d.sample_id for d in report.damaged} == samples_overlapping(tmp_path, shard, 0, 64)
    assert "missing" in report.damaged[0].problem


def test_crash_leftovers_are_unreferenced_not_damage(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(30))
    with ShardWriter(tmp_path, fingerprint, worker=0, **TINY) as writer:
        for sample in samples[:10]:
            writer.add(sample)
    # A session that wrote whole shards but was "killed" before its first commit ...
    orphan = ShardWriter(tmp_path, fingerprint, worker=1, flush_seconds=1e9, **TINY)
    for sample in samples[10:20]:
        orphan.add(sample)
    # ... and one that committed some samples, then wrote more shards and was "killed".
    partly = ShardWriter(tmp_path, fingerprint, worker=2, flush_seconds=1e9, **TINY)
    for sample in samples[20:22]:
        partly.add(sample)
    partly.flush()
    for sample in samples[22:]:
        partly.add(sample)
    stale = CacheLayout.at(tmp_path).shard_group(orphan.shard) / "features" / "c" / "9" / "0.abc.partial"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\0" * 100)

    report = verify_cache(tmp_path, progress=False)
    assert report.ok, report.render()
    assert report.samples_checked == 12
    reasons = {(u.path.split("/")[1].split(".zarr")[0], u.reason.split(" (")[0]) for u in report.unreferenced}
    assert (orphan.shard, "no committed sample") in reasons
    assert (partly.shard, "shard file holds no committed sample") in reasons
    assert any(u.reason == "stale temp file" and u.num_bytes == 100 for u in report.unreferenced)
    assert report.unreferenced_bytes > 100


def test_duplicated_commit_is_reported(tmp_path):
    write_cache(tmp_path, "none", n=8)
    part = CacheLayout.at(tmp_path).parts("samples")[0]
    copy_part(part, "w000-copy-000000")
    report = verify_cache(tmp_path, progress=False)
    assert not report.ok
    assert len(report.duplicates) == 8
    with CacheReader.open(tmp_path) as reader:
        assert len(reader.samples) == 8
        assert reader.samples.num_duplicates == 8
        np.testing.assert_array_equal(np.sort(reader.samples.source_index), np.arange(8))
