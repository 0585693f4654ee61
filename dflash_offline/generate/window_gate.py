"""The planner's gate of the disk window (``--window-limit``, docs/follow.md).

A job is handed out only while the window (committed samples of training stores not retired; the
validation stores, never retired, are apart: ``window.window_usage``) plus the samples
already handed out and not yet seen committed, plus the job itself, fit the limit, all counted in the
codec's stored bytes a token. So the committed window never exceeds the limit, whatever the number of
workers or the size of their stores. While a job does not fit, the planner waits for training to
retire stores, polling the manifest, and records each span waited (a ``waits`` manifest row). One
exception keeps a run from waiting forever on a job larger than the whole limit: it goes once nothing
else is in the window.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.layout import read_fingerprint
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.rows import utc_now
from dflash_offline.cache.window import (
    is_validation_store,
    record_wait,
    retired_shards,
    routes_to_validation,
)
from dflash_offline.cache.window_records import WindowWait

POLL_SECONDS = 0.5
"""How often a waiting planner re-reads the manifest (a retirement frees the window at once)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSample:
    """A sample of a job the planner is about to hand out, as the window counts it (a sample the cache
    already holds is not one: it is not written again)."""

    sample_id: str
    conversation_root: str | None
    """Its conversation (``TokenizedSample.conversation_root``): whether it is routed to a validation
    store, which the window does not count (``window.routes_to_validation``)."""
    num_tokens: int
    """Its tokens (the window counts the codec's stored bytes of each)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowReading:
    """One measurement of the window, in stored bytes."""

    committed_bytes: int
    """Committed samples of stores not retired."""
    in_flight_bytes: int
    """Samples handed out and not yet committed (or failed)."""

    @property
    def total(self) -> int:
        return self.committed_bytes + self.in_flight_bytes


class WindowGate:
    """Admits jobs under the window's limit; used by the planner thread only."""

    def __init__(self, cache_dir: Path, limit: int, *, run_id: str, val_fraction: float) -> None:
        self._cache_dir = cache_dir
        self._run_id = run_id
        self._val_fraction = val_fraction
        self._limit = limit
        self._token_bytes = read_fingerprint(cache_dir).storage.token_bytes
        self._in_flight: dict[str, int] = {}  # sample_id -> bytes, handed out and not seen committed
        self._estimate = 0  # an upper bound of the window since the last reading
        self.waited_seconds = 0.0
        self.waits = 0

    def admit(self, samples: Sequence[JobSample], stop: threading.Event) -> bool:
        """Wait until the job's new samples fit; False when ``stop`` was set meanwhile. Validation
        samples (routed to stores never retired) are not counted: see ``window_usage``."""
        training = [
            s
            for s in samples
            if not routes_to_validation(
                sample_id=s.sample_id, conversation_root=s.conversation_root, val_fraction=self._val_fraction
            )
        ]
        job_bytes = sum(s.num_tokens for s in training) * self._token_bytes
        # A job that adds nothing to the window never waits (after the plan's end, only such jobs come).
        if job_bytes > 0 and self._estimate + job_bytes > self._limit:
            reading = self.read()
            started, started_at = time.perf_counter(), utc_now()
            waited = False
            while reading.total + job_bytes > self._limit and reading.total > 0:
                waited = True
                if stop.wait(POLL_SECONDS):
                    break
                reading = self.read()
            if waited:
                self._record(started_at, time.perf_counter() - started)
            if stop.is_set():
                return False
        for sample in training:
            self._in_flight[sample.sample_id] = sample.num_tokens * self._token_bytes
        self._estimate += job_bytes
        return True

    def _record(self, started_at: dt.datetime, seconds: float) -> None:
        self.waits += 1
        self.waited_seconds += seconds
        wait = WindowWait(run_id=self._run_id, side="generate", started_at=started_at, seconds=seconds)
        record_wait(self._cache_dir, wait, number=self.waits)

    def read(self) -> WindowReading:
        """Measure the window from the manifest and forget in-flight samples now committed or failed."""
        samples = read_table(self._cache_dir, "samples", ["sample_id", "shard", "num_tokens"]).to_pydict()
        failed = read_table(self._cache_dir, "failures", ["sample_id"]).column("sample_id").to_pylist()
        retired = retired_shards(self._cache_dir)
        committed_tokens = sum(
            n
            for shard, n in zip(samples["shard"], samples["num_tokens"], strict=True)
            if shard not in retired and not is_validation_store(shard)
        )
        for sample_id in (*samples["sample_id"], *failed):
            self._in_flight.pop(sample_id, None)
        reading = WindowReading(
            committed_bytes=committed_tokens * self._token_bytes,
            in_flight_bytes=sum(self._in_flight.values()),
        )
        self._estimate = reading.total
        return reading
