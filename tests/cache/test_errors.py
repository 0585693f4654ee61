"""Bad input: a clear error naming the problem, and the cache left exactly as it was."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from dflash_offline.cache.layout import create_or_open_cache, read_fingerprint, sweep_partial_files
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.errors import CacheFormatError, FingerprintMismatchError, SampleError
from tests.cache._samples import TINY, make_fingerprint, make_sample, make_samples


def snapshot(root) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and modification time."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            stat = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.fixture
def cache_with_one_commit(tmp_path, fingerprint):
    with ShardWriter(tmp_path, fingerprint, worker=0, **TINY) as writer:
        writer.add(make_sample(fingerprint, 0))
    return tmp_path


def test_wrong_width_is_refused_and_nothing_is_written(cache_with_one_commit, fingerprint):
    root = cache_with_one_commit
    writer = ShardWriter(root, fingerprint, worker=1, flush_seconds=0.0, **TINY)
    before = snapshot(root)
    good = make_sample(fingerprint, 1)
    wide = dataclasses.replace(
        good, features_TF=torch.zeros(good.num_tokens, fingerprint.feature_width + 2, dtype=torch.bfloat16)
    )
    with pytest.raises(SampleError, match=r"18 wide, the cache stores 16 \(2 layers × hidden 8\)"):
        writer.add(wide)
    assert snapshot(root) == before
    writer.add(good)  # the writer is still usable and the rejected sample left no trace
    writer.close()
    with CacheReader.open(root) as reader:
        assert sorted(reader.samples.sample_id.tolist()) == [
            make_sample(fingerprint, 0).sample_id,
            good.sample_id,
        ]


def test_duplicate_sample_id_is_refused(cache_with_one_commit, fingerprint):
    root = cache_with_one_commit
    writer = ShardWriter(root, fingerprint, worker=1, flush_seconds=0.0, **TINY)
    before = snapshot(root)
    with pytest.raises(SampleError, match="already in the cache"):
        writer.add(make_sample(fingerprint, 0))  # committed by an earlier session (read from the manifest)
    assert snapshot(root) == before
    writer.add(make_sample(fingerprint, 1))
    with pytest.raises(SampleError, match="already in the cache"):
        writer.add(make_sample(fingerprint, 1))  # added earlier in this session
    writer.close()
    with CacheReader.open(root) as reader:
        assert len(reader.samples) == 2


def test_known_sample_ids_replace_the_manifest_lookup(cache_with_one_commit, fingerprint):
    with ShardWriter(
        cache_with_one_commit, fingerprint, worker=1, known_sample_ids={"s0-00007"}, **TINY
    ) as writer:
        writer.add(make_sample(fingerprint, 0))  # not in the given set, so accepted
        with pytest.raises(SampleError, match="already in the cache"):
            writer.add(make_sample(fingerprint, 7))


def test_wrong_bucket_and_bad_mask_are_refused(tmp_path, fingerprint):
    with ShardWriter(tmp_path, fingerprint, worker=0, **TINY) as writer:
        sample = make_sample(fingerprint, 0, num_tokens=10)
        with pytest.raises(SampleError, match="bucket_id 0 but 10 tokens fall in bucket 2"):
            writer.add(dataclasses.replace(sample, bucket_id=0))
        with pytest.raises(SampleError, match="loss_mask must hold 0/1"):
            writer.add(dataclasses.replace(sample, loss_mask_T=np.full(10, 2, np.uint8)))
        with pytest.raises(SampleError, match="input_ids must be non-negative"):
            writer.add(dataclasses.replace(sample, input_ids_T=np.full(10, -1, np.int64)))
    assert writer.stats.samples == 0


def test_cache_path_that_is_a_file(tmp_path, fingerprint):
    path = tmp_path / "not-a-dir"
    path.write_bytes(b"precious")
    with pytest.raises(CacheFormatError, match="is a file, not a directory"):
        ShardWriter(path, fingerprint, worker=0)
    with pytest.raises(CacheFormatError, match="is a file"):
        CacheReader.open(path)
    assert path.read_bytes() == b"precious"


def test_non_empty_directory_without_cache_json(tmp_path, fingerprint):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CacheFormatError, match=r"not empty and has no cache\.json"):
        create_or_open_cache(tmp_path, fingerprint)
    assert snapshot(tmp_path).keys() == {"notes.txt"}


def test_fingerprint_mismatch_names_the_field(cache_with_one_commit, fingerprint):
    root = cache_with_one_commit
    before = snapshot(root)
    other = dataclasses.replace(fingerprint, layer_ids=(1, 3))
    with pytest.raises(
        FingerprintMismatchError, match=r"layer_ids=\(1, 2\), this run has layer_ids=\(1, 3\)"
    ) as info:
        ShardWriter(root, other, worker=0)
    assert info.value.field == "layer_ids"
    with pytest.raises(FingerprintMismatchError, match="codec"):
        create_or_open_cache(root, dataclasses.replace(fingerprint, codec="zstd-1"))
    assert snapshot(root) == before


def test_unknown_format_version_is_refused(cache_with_one_commit, fingerprint):
    root = cache_with_one_commit
    doc = json.loads((root / "cache.json").read_text())
    doc["format_version"] = 99
    (root / "cache.json").write_text(json.dumps(doc))
    for open_it in (read_fingerprint, CacheReader.open, lambda r: create_or_open_cache(r, fingerprint)):
        with pytest.raises(
            CacheFormatError, match="format_version 99; this dflash-offline reads formats 1, 2 and 3"
        ):
            open_it(root)


def test_unknown_codec_is_refused_before_anything_is_created(tmp_path):
    with pytest.raises(CacheFormatError, match="unknown feature codec 'lz77'"):
        create_or_open_cache(tmp_path / "c", make_fingerprint(codec="lz77"))
    assert not (tmp_path / "c").exists()


def test_the_fingerprint_carries_its_codec_resolved(cache_with_one_commit):
    """The codec is resolved once, when a fingerprint is built (read from cache.json or made by generate):
    its stored row format, worked out by hand here, travels with it; cache.json still names the codec
    alone, and a cache.json naming an unknown codec is refused when it is read, in one line."""
    plain = make_fingerprint(codec="none", hidden_size=8)  # 2 layers × hidden 8, bf16 bits
    assert (plain.storage.codec, plain.storage.width, plain.storage.dtype) == ("none", 16, np.dtype("<u2"))
    assert plain.storage.lossy is None
    assert plain.storage.storage_dtype == "bfloat16"
    fp8 = make_fingerprint(codec="fp8", hidden_size=64, storage_dtype="float8_e4m3fn")
    assert fp8.storage.lossy is not None
    assert fp8.storage.dtype == np.dtype("u1")
    assert fp8.storage.storage_dtype == "float8_e4m3fn"
    # fp8 (cache/codecs.py: one scale a layer, 2 outliers): per layer 64 fp8 bytes, 1 exponent byte, and
    # 2 outliers of a uint16 index and a bf16 value each.
    assert fp8.storage.width == 2 * (64 + 1 + 2 * 2 + 2 * 2)
    assert "storage" not in plain.to_dict()
    assert dataclasses.replace(plain, codec="fp8", storage_dtype="float8_e4m3fn").storage.lossy is not None
    root = cache_with_one_commit
    assert read_fingerprint(root).storage == CacheReader.open(root).storage
    doc = json.loads((root / "cache.json").read_text())
    doc["fingerprint"]["codec"] = "lz77"
    (root / "cache.json").write_text(json.dumps(doc))
    with pytest.raises(CacheFormatError, match="unknown feature codec 'lz77'") as e:
        read_fingerprint(root)
    assert "\n" not in str(e.value)


def test_sweep_partial_files(cache_with_one_commit):
    root = cache_with_one_commit
    stale = [
        root / "shards" / "x.zarr" / "features" / "c" / "0" / "0.1234.partial",
        root / "manifest" / "samples" / "w000-s-000001.parquet.tmp-1-1",
        root / "cache.json.tmp-5-1",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    assert sweep_partial_files(root) == 3
    assert not any(p.exists() for p in stale)
    with CacheReader.open(root) as reader:
        assert len(reader.samples) == 1


def test_writer_session_names_are_unique_and_checked(tmp_path, fingerprint):
    ShardWriter(tmp_path, fingerprint, worker=3, session="a").close()
    with pytest.raises(CacheFormatError, match="already exists"):
        ShardWriter(tmp_path, fingerprint, worker=3, session="a")
    with pytest.raises(SampleError, match="names files"):
        ShardWriter(tmp_path, fingerprint, worker=3, session="../up")
    closed = ShardWriter(tmp_path, fingerprint, worker=4)
    closed.close()
    with pytest.raises(SampleError, match="is closed"):
        closed.add(make_samples(fingerprint, [1])[0])
