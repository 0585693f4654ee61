"""The manifest records of the disk window (docs/follow.md): a store is sealed by its writer, then
retired by the training run that consumed it; each side records the spans it waited for the other.
All are immutable Parquet parts like every other manifest part (``manifest.write_part``: temp name,
rename, sha256 in the name)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from dflash_offline.cache.rows import record_fields, record_to_dict

SEAL_REASONS = ("size", "close", "recovered")
"""Why a store was sealed: it reached ``--store-size``; its writer closed; or the next generate on the
cache found it unsealed (its writer was killed) and sealed it while holding the cache lock."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreSeal:
    """A store (one shard group) that will never get another row (one row of the ``seals`` table)."""

    shard: str
    """Shard group name (``shards/<shard>.zarr``)."""
    validation: bool
    """True for a store of validation samples: never retired."""
    num_samples: int
    """Committed samples in the store when it was sealed (its final count)."""
    num_tokens: int
    reason: str
    """One of ``SEAL_REASONS``."""
    sealed_at: dt.datetime

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreSeal:
        return cls(**record_fields(cls, d))


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreRetirement:
    """A store whose samples had their planned passes and whose files are (being) deleted (one row of
    the ``retirements`` table, written before any of its files goes). Its sample rows stay in the
    manifest; every reader treats its samples as intentionally gone."""

    shard: str
    run_id: str
    """The training run that retired it."""
    num_samples: int
    num_tokens: int
    retired_at: dt.datetime

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreRetirement:
        return cls(**record_fields(cls, d))


WAIT_SIDES = ("generate", "train")


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowWait:
    """One span a side of the window waited for the other (one row of the ``waits`` table): generate
    while the window was full, train while it had no sample left to train on."""

    run_id: str
    side: str
    """One of ``WAIT_SIDES``."""
    started_at: dt.datetime
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WindowWait:
        return cls(**record_fields(cls, d))
