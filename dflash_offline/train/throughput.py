"""The training throughput ``dflash train`` logs: wall-clock, over the window between two read-backs of
the step results.

On a GPU a step's call returns once the host has queued its work; the device catches up at the next
read-back (a host sync: a log step, a validation, the last step). One step's host time is therefore not
its cost, and a window of steps is measured instead: from the end of the previous read-back (after its
sync; the first window from the first step's start) to the end of this one (after its sync), less the
time the loop spent validating or checkpointing in between (the training's throughput, not the
pipeline's).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowThroughput:
    """The steps of one window, measured at the read-back that closes it."""

    num_steps: int
    """Optimizer steps in the window (≥ 1)."""
    tokens: int
    """Real tokens of those steps, over all ranks (``StepPlan.num_tokens``)."""
    seconds: float
    """Wall seconds of the window, validation and checkpoints excluded."""
    data_wait_s: float
    """Seconds this rank waited for the prefetcher in the window."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_seconds(self) -> float:
        """Mean wall seconds a step."""
        return self.seconds / self.num_steps

    @property
    def data_wait_fraction(self) -> float:
        """Share of the window's wall time spent waiting for the prefetcher."""
        return self.data_wait_s / self.seconds


class ThroughputWindow:
    """Accumulates the steps since the last read-back; ``close`` measures them and opens the next window.

    Reads ``time.perf_counter``. ``device``: the device the steps run on, synchronized before a pause so
    that the steps queued before it count as training time."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._start: float | None = None
        self._paused_s = 0.0
        self._num_steps = 0
        self._tokens = 0
        self._data_wait_s = 0.0

    def start(self) -> None:
        """The first step starts now."""
        self._open(time.perf_counter())

    def add_step(self, *, tokens: int, data_wait_s: float) -> None:
        """A step of ``tokens`` tokens ran; this rank waited ``data_wait_s`` for its microbatches."""
        self._num_steps += 1
        self._tokens += tokens
        self._data_wait_s += data_wait_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is left out of the window (a validation, a checkpoint)."""
        if self._device.type == "cuda":
            # The steps queued so far are training: let the device finish them on the window's clock.
            torch.cuda.synchronize(self._device)
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - began

    def close(self) -> WindowThroughput:
        """Measure the window's steps (call right after the read-back's sync) and open the next window."""
        assert self._start is not None, "close() before start()"
        assert self._num_steps > 0, "close() before a step"
        now = time.perf_counter()
        window = WindowThroughput(
            num_steps=self._num_steps,
            tokens=self._tokens,
            # A coarse clock may not have moved: never divide by zero.
            seconds=max(now - self._start - self._paused_s, 1e-9),
            data_wait_s=self._data_wait_s,
        )
        self._open(now)
        return window

    def _open(self, now: float) -> None:
        self._start = now
        self._paused_s = 0.0
        self._num_steps = 0
        self._tokens = 0
        self._data_wait_s = 0.0
