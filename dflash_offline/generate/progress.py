"""The one progress bar of ``dflash generate``: samples, tokens, tok/s, GB written, ETA."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from dflash_offline.generate.events import WorkerStarted

GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgressView:
    """What the coordinator shows of a run so far (one ``GenerateProgress.update``)."""

    samples: int
    """Samples committed by every worker."""
    tokens: int
    """Tokens of those samples."""
    stored_bytes: int
    """Bytes written to the cache's shards."""
    failures: int
    """Samples that failed (workers' and the planner's)."""
    planned: int
    """Samples planned so far."""
    total: int | None
    """Samples the run will commit: known once planning has finished (the bar's ETA), None before."""


class GenerateProgress:
    """A tqdm bar over committed samples; the total is known once planning has finished (ETA then)."""

    def __init__(self, *, enabled: bool, num_workers: int) -> None:
        self._bar: Any = None
        self._start = time.perf_counter()
        self._last_refresh = 0.0
        self._num_workers = num_workers
        self._started = 0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=None,
                unit="sample",
                desc=f"generate (0/{num_workers} workers ready)",
                file=sys.stderr,
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def worker_started(self, event: WorkerStarted) -> None:
        self._started += 1
        if self._bar is not None:
            self._bar.set_description(f"generate ({self._started}/{self._num_workers} workers ready)")

    def update(self, *, tally: ProgressView) -> None:
        if self._bar is None:
            return
        now = time.perf_counter()
        if now - self._last_refresh < 0.25:
            return
        self._last_refresh = now
        if tally.total is not None and self._bar.total != tally.total:
            self._bar.total = tally.total
        self._bar.n = tally.samples
        elapsed = max(now - self._start, 1e-9)
        self._bar.set_postfix(
            tokens=f"{tally.tokens / 1e6:.2f}M",
            tok_s=f"{tally.tokens / elapsed:,.0f}",
            GB=f"{tally.stored_bytes / GB:.2f}",
            failed=tally.failures,
            planned=tally.planned,
            refresh=False,
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
