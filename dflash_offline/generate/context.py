"""What the coordinator of ``dflash generate`` derives before any worker starts (``run.prepare_run``):
read by the planner thread (``feed.py``), the workers' specs and the coordinator itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.locking import DirLock


@dataclass(frozen=True, kw_only=True, slots=True)
class RunContext:
    """What the coordinator derives before any worker starts."""

    config: GenerateConfig
    fingerprint: CacheFingerprint
    tokenizer: Any
    pad_id: int
    done_ids: frozenset[str]
    """Committed or failed sample ids already in the cache (resume)."""
    run_id: str
    session: str
    lock: DirLock | None = None
    """The cache's writer lock, held by the coordinator for the whole run (None on other ranks)."""
