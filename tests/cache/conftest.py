"""Fixtures for the cache tests: a tiny fingerprint."""

from __future__ import annotations

import pytest

from dflash_offline.cache.fingerprint import CacheFingerprint
from tests.cache._samples import make_fingerprint


@pytest.fixture
def fingerprint() -> CacheFingerprint:
    return make_fingerprint()
