"""What generate's disk-window options mean for its workers and its start (docs/follow.md)."""

from __future__ import annotations

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.window import read_seals, seal_orphans
from dflash_offline.config_fields import field_ref
from dflash_offline.errors import ConfigError
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


def check_window(config: GenerateConfig, fingerprint: CacheFingerprint, num_workers: int) -> None:
    """Refuse a window that could fill with open stores alone. The planner waits while the window plus a
    job would pass the limit; training frees it only by retiring sealed stores. Each worker's open store
    holds less than ``store_bytes`` plus one sample, so the window always holds a sealed store to retire
    while it is full when ``workers × (store + longest sample) + one job`` stays below the limit."""
    limit = config.window_limit
    store = store_bytes(config, num_workers)
    if limit is None or store is None:
        return
    token_bytes = fingerprint.storage.token_bytes
    open_stores = num_workers * (store + config.max_length * token_bytes)
    job = config.tokens_per_batch * token_bytes
    if open_stores + job < limit:
        return
    needed = (
        open_stores + job + 1
        if config.store_size is not None
        else 2 * (num_workers * config.max_length * token_bytes + job) + 1
    )
    raise ConfigError(
        f"{field_ref(GenerateConfig, 'window_limit')} {limit}B is too small for {num_workers} workers: "
        f"their open stores ({field_ref(GenerateConfig, 'store_size')} {store}B plus a sample of up to "
        f"{field_ref(GenerateConfig, 'max_length')} {config.max_length} tokens each) and one job could "
        f"fill it, and training can retire only sealed stores; give at least {needed}B"
        + ("" if config.store_size is None else f" or a smaller {field_ref(GenerateConfig, 'store_size')}")
    )
