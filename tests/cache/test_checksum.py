"""The zero-copy crc32c agrees with google_crc32c on the same bytes."""

from __future__ import annotations

import google_crc32c
import numpy as np

from dflash_offline.cache.checksum import crc32c_extend, sample_checksum


def test_matches_google_crc32c():
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.uint16, np.int32):
        array = rng.integers(0, 100, size=(37, 5)).astype(dtype)
        assert crc32c_extend(0, array) == google_crc32c.value(array.tobytes())
    strided = rng.integers(0, 1 << 16, size=(10, 8), dtype=np.uint16)[:, ::2]
    assert crc32c_extend(0, strided) == google_crc32c.value(np.ascontiguousarray(strided).tobytes())
    assert crc32c_extend(123, np.zeros(0, np.uint8)) == 123


def test_sample_checksum_chains_features_ids_mask():
    features = np.arange(12, dtype=np.uint16).reshape(3, 4)
    ids = np.array([5, 6, 7], dtype=np.int32)
    mask = np.array([0, 1, 1], dtype=np.uint8)
    expected = google_crc32c.value(features.tobytes() + ids.astype("<i4").tobytes() + mask.tobytes())
    assert sample_checksum(features, ids, mask) == expected
    assert sample_checksum(features, ids, mask[::-1].copy()) != expected


def test_writer_commits_each_samples_checksum_of_its_input(tmp_path):
    """Checksums are computed on the writer's pool at write time, from staging buffers that are swapped,
    prefaulted and reused; every committed value must still be the crc32c of the sample as given (the
    reference here: google_crc32c over the input's bytes), for samples straddling shard boundaries,
    samples larger than a shard, flushes mid-block, and pools of 1 and 3 threads."""
    from dflash_offline.cache.layout import CacheLayout
    from dflash_offline.cache.manifest import read_parts
    from dflash_offline.cache.writer import ShardWriter
    from tests.cache._samples import bits, make_fingerprint, make_sample

    fingerprint = make_fingerprint()
    for threads in (1, 3):
        root = tmp_path / f"t{threads}"
        samples = [make_sample(fingerprint, i, seed=threads) for i in range(60)]
        samples.append(make_sample(fingerprint, 60, seed=threads, num_tokens=64))  # > 2 shards of 24 rows
        expected = {
            s.sample_id: google_crc32c.value(
                bits(s.features_TF).tobytes()
                + np.asarray(s.input_ids_T, "<i4").tobytes()
                + np.asarray(s.loss_mask_T, np.uint8).tobytes()
            )
            for s in samples
        }
        with ShardWriter(
            root, fingerprint, worker=0, shard_bytes=24 * 32, chunk_bytes=8 * 32, encode_threads=threads
        ) as writer:
            for i, sample in enumerate(samples):
                writer.add(sample)
                if i % 17 == 16:
                    writer.flush()  # commits mid-block: the next sample starts at a new shard
        table = read_parts("samples", CacheLayout.at(root).parts("samples"))
        got = dict(zip(table["sample_id"].to_pylist(), table["checksum"].to_pylist(), strict=True))
        assert got == expected
