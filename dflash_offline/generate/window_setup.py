"""What generate's disk-window options mean for its workers and its start (docs/follow.md)."""

from __future__ import annotations

from dflash_offline.cache.window import read_seals, seal_orphans
from dflash_offline.generate.config import GenerateConfig


def window_on(config: GenerateConfig) -> bool:
    """Workers write bounded, sealed stores (``cache/rolling.py``)."""
    return config.window_limit is not None or config.store_size is not None


def store_bytes(config: GenerateConfig, num_workers: int) -> int | None:
    """Bytes a store holds before it is sealed. Default under a window: the limit / (2 × workers), so
    that the open stores hold at most half the window: while it is full, at least half of it is in
    sealed stores that training can retire, and neither side waits for the other forever."""
    if config.store_size is not None:
        return config.store_size
    if config.window_limit is None:
        return None
    return max(1, config.window_limit // (2 * max(1, num_workers)))


def seal_abandoned_stores(config: GenerateConfig) -> int:
    """Seal the stores of killed writers (``recovered``), so that training can retire them. Only under
    the cache's lock: no writer of an earlier session is alive, and stores never reopen. A cache that
    never had a window (no seals, no window options) is left as it was."""
    if not window_on(config) and not read_seals(config.cache_dir):
        return 0
    return len(seal_orphans(config.cache_dir))
