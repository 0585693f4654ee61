"""Fixtures for the cache tests: a tiny fingerprint and writer settings that force many boundaries."""

from __future__ import annotations

import pytest

from dflash_offline.cache.fingerprint import CacheFingerprint
from tests.cache._samples import make_fingerprint

# Tiny geometry: F = 16 features (32 B a row), 8-row inner chunks, 64-row shards, so a few dozen
# samples cross many chunk and shard boundaries.
TINY = dict(chunk_bytes=256, shard_bytes=2048)


@pytest.fixture
def fingerprint() -> CacheFingerprint:
    return make_fingerprint()
