"""The disk window's records on disk: seal a store, retire a store, and measure what the window holds
(docs/follow.md).

A store is one shard group (``shards/<shard>.zarr``), written by one writer only. Its seal says it will
never get another row; its retirement says its files are intentionally gone. The retirement record is
durable before the first file is deleted, so a kill between the two leaves a retired store on disk,
which every reader already skips and ``finish_retirements`` deletes.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from dflash_offline.cache.layout import CacheLayout, read_fingerprint
from dflash_offline.cache.manifest import (
    read_parts,
    read_table,
    records_to_table,
    table_to_records,
    write_part,
)
from dflash_offline.cache.rows import utc_now
from dflash_offline.cache.window_records import StoreRetirement, StoreSeal, WindowWait
from dflash_offline.split_key import split_group, validation_key

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
VALIDATION_MARK = "-val-r"
"""In a store's name (``w<worker>-<session>-val-r<n>``): it holds validation samples, never retired."""


def routing_key(*, sample_id: str, conversation_root: str | None) -> float:
    """The sample's place in [0, 1) under the validation split's hash, taken over its conversation
    (split_key.py: ``validation_key`` of ``split_group``, the key of ``dflash train --val-group root-id``),
    so that every sample of one conversation lands on the same side: ShareGPT's records ``X_0``, ``X_11``,
    … of one long conversation, and other answers to the same prompts under the same record id."""
    return validation_key(split_group(sample_id=sample_id, conversation_root=conversation_root))


def routes_to_validation(*, sample_id: str, conversation_root: str | None, val_fraction: float) -> bool:
    """Under a disk window, the sample goes to a validation store (never retired): its ``routing_key``
    is below ``val_fraction`` (``--val-fraction``; 0 routes none)."""
    return (
        val_fraction > 0
        and routing_key(sample_id=sample_id, conversation_root=conversation_root) < val_fraction
    )


def is_validation_store(shard: str) -> bool:
    return VALIDATION_MARK in shard


def record_wait(root: str | Path, wait: WindowWait, *, number: int) -> None:
    """Commit one wait span (``waits/<run_id>-<number>.<sha256>.parquet``, the run id made a file name)."""
    folder = CacheLayout.at(root).table_dir("waits")
    folder.mkdir(parents=True, exist_ok=True)
    stem = _UNSAFE.sub("_", wait.run_id)
    write_part(folder / f"{stem}-{number:06d}.parquet", records_to_table("waits", [wait]))


def seal_store(root: str | Path, seal: StoreSeal, *, fsync: bool = True) -> None:
    """Commit ``seal`` (one part, ``seals/<shard>.<sha256>.parquet``); call after the store's last commit."""
    folder = CacheLayout.at(root).table_dir("seals")
    folder.mkdir(parents=True, exist_ok=True)
    write_part(folder / f"{seal.shard}.parquet", records_to_table("seals", [seal]), fsync=fsync)


def read_seals(root: str | Path) -> dict[str, StoreSeal]:
    """shard -> its seal (the first, should a store have been sealed twice)."""
    seals: dict[str, StoreSeal] = {}
    for seal in table_to_records("seals", read_table(root, "seals")):
        seals.setdefault(seal.shard, seal)
    return seals


def read_retirements(root: str | Path) -> dict[str, StoreRetirement]:
    """shard -> its retirement record."""
    retired: dict[str, StoreRetirement] = {}
    for record in table_to_records("retirements", read_table(root, "retirements")):
        retired.setdefault(record.shard, record)
    return retired


def retired_shards(root: str | Path) -> frozenset[str]:
    """Stores whose samples are intentionally gone: readers never read them, verify never reports them."""
    table = read_table(root, "retirements", ["shard"])
    return frozenset(table.column("shard").to_pylist())


def retired_in_parts(parts: Sequence[Path], *, legacy_names: bool = True) -> frozenset[str]:
    """``retired_shards`` from the given parts (verify and repair pass the intact ones)."""
    table = read_parts("retirements", parts, ["shard"], legacy_names=legacy_names)
    return frozenset(table.column("shard").to_pylist())


def retire_store(root: str | Path, retirement: StoreRetirement) -> None:
    """Record the retirement (durable), then delete the store's files."""
    if is_validation_store(retirement.shard):
        raise AssertionError(f"validation store {retirement.shard} must never be retired")
    folder = CacheLayout.at(root).table_dir("retirements")
    folder.mkdir(parents=True, exist_ok=True)
    write_part(
        folder / f"{retirement.shard}.parquet", records_to_table("retirements", [retirement]), fsync=True
    )
    _delete_store(root, retirement.shard)


def finish_retirements(root: str | Path) -> int:
    """Delete the files of retired stores a killed run left on disk; returns how many it removed."""
    layout = CacheLayout.at(root)
    removed = 0
    for shard in retired_shards(root):
        if layout.shard_group(shard).exists():
            _delete_store(root, shard)
            removed += 1
    return removed


def _delete_store(root: str | Path, shard: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(CacheLayout.at(root).shard_group(shard))


def seal_orphans(root: str | Path, *, keep_open: frozenset[str] = frozenset()) -> list[StoreSeal]:
    """Seal every store that has none (``recovered``), but those in ``keep_open``. Only for a caller
    holding the cache lock: no writer of an unsealed store can then be alive (stores never reopen)."""
    seals = read_seals(root)
    retired = retired_shards(root)
    shards = read_table(root, "shards", ["shard"]).column("shard").to_pylist()
    samples = read_table(root, "samples", ["shard", "num_tokens"])
    written: list[StoreSeal] = []
    for shard in sorted(set(shards) - set(seals) - retired - keep_open):
        mine = samples.filter(pc.equal(samples["shard"], shard))
        seal = StoreSeal(
            shard=shard,
            validation=is_validation_store(shard),
            num_samples=mine.num_rows,
            num_tokens=int(pc.sum(mine["num_tokens"]).as_py() or 0),
            reason="recovered",
            sealed_at=utc_now(),
        )
        seal_store(root, seal)
        written.append(seal)
    return written


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowUsage:
    """What the window holds now: committed samples of training stores not retired. The validation
    stores are apart: never retired, they hold ``--val-fraction`` of every sample generated, on top of
    the window (counting them in would let them fill any window in a long enough run)."""

    samples: int
    tokens: int
    stored_bytes: int
    """``tokens`` × the codec's stored bytes a token (exact for fp8 and raw, an upper bound for the
    lossless codecs): the measure ``--window-limit`` bounds."""
    validation_samples: int
    validation_bytes: int
    """Stored bytes of the validation stores, by the same measure."""
    retired_stores: int
    retired_samples: int


def window_usage(root: str | Path) -> WindowUsage:
    """Measure the window from the manifest (works while writers and training are active)."""
    token_bytes = read_fingerprint(root).storage.token_bytes
    retired = retired_shards(root)
    samples = read_table(root, "samples", ["sample_id", "shard", "num_tokens"])
    shard_N = np.asarray(samples.column("shard").to_pylist(), dtype=object)
    gone_N = np.fromiter((s in retired for s in shard_N), dtype=bool, count=len(shard_N))
    val_N = np.fromiter((is_validation_store(s) for s in shard_N), dtype=bool, count=len(shard_N))
    tokens_N = samples.column("num_tokens").to_numpy()
    window_N = ~gone_N & ~val_N
    tokens = int(tokens_N[window_N].sum())
    return WindowUsage(
        samples=int(window_N.sum()),
        tokens=tokens,
        stored_bytes=tokens * token_bytes,
        validation_samples=int(val_N.sum()),
        validation_bytes=int(tokens_N[val_N].sum()) * token_bytes,
        retired_stores=len(retired),
        retired_samples=int(gone_N.sum()),
    )
