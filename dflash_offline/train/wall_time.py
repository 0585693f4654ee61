"""Where a training run's wall time goes: start-up, steps, validation, checkpoints and exports.

The throughput window (train/throughput.py) measures the steps alone; a run also spends time before its
first step (cache and snapshot, model build, the resumed checkpoint, ``--compile``'s warm-up inside the
first step), in validations and in checkpoints and exports. ``WallClock`` times those parts on rank 0's
host, synchronizing the device at each boundary so that the work queued before it counts where it was
queued, and ``WallSplit`` is what the run reports once at its end (``dflash train``'s summary line).

The clock is the wall clock (``time.time``), not ``perf_counter``: a spawned rank's start-up counts from
its launcher's start (``RankTask.started_at``), and only the wall clock is shared between processes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

Part = Literal["validation", "checkpoint"]
"""A pause of the steps: a validation pass, or a checkpoint or export (the best drafter's included)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WallSplit:
    """The wall seconds of one ``dflash train`` invocation, by what they were spent on (rank 0's host).

    ``startup + steps + validation + checkpoint + other == total``."""

    total_seconds: float
    """From the command's start (``started_at``) to the end of the run, the final export included."""
    startup_seconds: float | None
    """From the command's start to the end of this invocation's first optimizer step (device synchronized):
    cache, snapshot, model, the resumed checkpoint, and the first step with its ``--compile`` warm-up.
    None when no step ran (a finished or early-stopped run resumed)."""
    step_seconds: float
    """The other steps: from the end of the first to the end of the last, validations and checkpoints
    between them left out (data waits included: they are the steps' cost)."""
    num_steps: int
    """Optimizer steps this invocation ran (the first included)."""
    validation_seconds: float
    """Validation passes (``val_seconds`` summed)."""
    num_validations: int
    checkpoint_seconds: float
    """Checkpoints, the best-drafter exports after validations, and the export at the end."""

    @property
    def other_seconds(self) -> float:
        """What no part claims: the set-up of a run that ran no step, the prefetcher's shutdown, …"""
        parts = (self.startup_seconds or 0.0) + self.step_seconds + self.validation_seconds
        return self.total_seconds - parts - self.checkpoint_seconds

    def describe(self) -> str:
        """One line for the end-of-run summary."""
        mean = f"{self.step_seconds / (self.num_steps - 1):.3f} s a step, " if self.num_steps > 1 else ""
        startup = "no step ran" if self.startup_seconds is None else f"{self.startup_seconds:.1f} s start-up"
        return (
            f"wall time {self.total_seconds:.1f} s: {startup} (to the end of the first step), "
            f"{self.step_seconds:.1f} s in {max(self.num_steps - 1, 0)} more steps ({mean}validation "
            f"and checkpoints excluded), {self.validation_seconds:.1f} s in {self.num_validations} "
            f"validations, {self.checkpoint_seconds:.1f} s in checkpoints and exports, "
            f"{self.other_seconds:.1f} s other"
        )


@dataclass(kw_only=True, slots=True)
class Lap:
    """The seconds of one timed part (set when its ``with`` block ends)."""

    seconds: float = 0.0


class WallClock:
    """Times a run's parts (module docstring). ``clock``: seconds since the epoch (a test's fake clock);
    ``device``: synchronized before each reading, so that queued device work counts where it was queued."""

    def __init__(
        self, *, started_at: float, device: torch.device, clock: Callable[[], float] | None = None
    ) -> None:
        self._started_at = started_at
        self._device = device
        # time.time looked up at each reading (not bound here): a test's patch of the module holds.
        self._clock = clock if clock is not None else lambda: time.time()
        self._first_step_end: float | None = None
        self._steps_end: float | None = None
        self._num_steps = 0
        self._seconds: dict[Part, float] = {"validation": 0.0, "checkpoint": 0.0}
        self._in_steps: dict[Part, float] = {"validation": 0.0, "checkpoint": 0.0}
        """The part of ``_seconds`` spent between the first step's end and the last step's."""
        self._num_validations = 0

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return self._clock()

    def step_done(self) -> None:
        """An optimizer step was queued; the first one's end (one device sync) ends the start-up."""
        self._num_steps += 1
        if self._first_step_end is None:
            self._first_step_end = self._now()

    @property
    def startup_seconds(self) -> float | None:
        """The start-up (``WallSplit.startup_seconds``) once the first step ended, else None."""
        return None if self._first_step_end is None else self._first_step_end - self._started_at

    def steps_ended(self) -> None:
        """The last step of this invocation ran (or none will)."""
        if self._steps_end is None:
            self._steps_end = self._now() if self._first_step_end is not None else self._clock()

    @contextlib.contextmanager
    def timed(self, part: Part) -> Iterator[Lap]:
        """Time a validation pass or a checkpoint/export; the yielded ``Lap`` holds its seconds after."""
        lap = Lap()
        began = self._now()
        try:
            yield lap
        finally:
            lap.seconds = self._now() - began
            self._seconds[part] += lap.seconds
            if self._first_step_end is not None and self._steps_end is None:
                self._in_steps[part] += lap.seconds
            if part == "validation":
                self._num_validations += 1

    def split(self) -> WallSplit:
        """The run's split, now that it ends (after its final export)."""
        end = self._clock()
        steps = 0.0
        if self._first_step_end is not None:
            steps_end = self._steps_end if self._steps_end is not None else end
            steps = steps_end - self._first_step_end - sum(self._in_steps.values())
        return WallSplit(
            total_seconds=end - self._started_at,
            startup_seconds=self.startup_seconds,
            step_seconds=steps,
            num_steps=self._num_steps,
            validation_seconds=self._seconds["validation"],
            num_validations=self._num_validations,
            checkpoint_seconds=self._seconds["checkpoint"],
        )
