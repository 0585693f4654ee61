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
