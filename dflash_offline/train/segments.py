"""What one segment of a follow run (``TrainConfig.follow``) continues from (docs/follow.md): the run's
one learning rate schedule, the segment's place in the run's global steps, and the drafter and
optimizer kept alive in the process from one segment to the next.

A follow run trains its segments as one optimization: segment k starts from segment k-1's last training
state (weights, optimizer state, global step), not from an exported drafter. In one process the live
objects are handed over (``LiveTraining``), so the drafter is built, and compiled, once; a restarted
process loads the previous segment's final checkpoint instead."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_offline.train.step import DrafterSetup

# ─── The schedule ───────────────────────────────────────────────────────────────────────────────────────────


def wsd_lr_factor(global_step: int, *, warmup_steps: int, decay_start: int | None, end_step: int) -> float:
    """LR multiplier of a follow run's ``global_step``: warm-up, stable, decay (WSD).

    - warm-up: ``(step + 1) / warmup_steps`` over the run's first ``warmup_steps`` steps, once;
    - stable: 1 from there on: a segment's end is no end of the schedule, since more data is coming;
    - decay: from ``D = max(decay_start, warmup_steps)`` to ``end_step``, a half cosine from 1 to 0,
      ``0.5 · (1 + cos(π · (step − D) / (end_step − D)))``. ``decay_start`` is the first step of the
      final segment (the one planned after generate finished; None while no segment is final) and
      ``end_step`` the step after its last.

    A run whose one segment is final (generate had finished before it started) gets exactly
    ``trainer.cosine_with_warmup``'s schedule. WSD suits a stream: the total number of steps is not known
    until generate finishes, and a constant LR neither wastes the data that comes later on a small LR
    nor spends a decay on every segment (where each restart costs loss); the decay over the final
    segment gives the end of the run the low-LR anneal a cosine run gets."""
    if global_step < warmup_steps:
        return (global_step + 1) / warmup_steps
    if decay_start is None:
        return 1.0
    start = max(decay_start, warmup_steps)
    if global_step < start:
        return 1.0
    progress = min(1.0, (global_step - start) / max(1, end_step - start))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True, slots=True)
class FollowSchedule:
    """The arguments of ``wsd_lr_factor`` for a follow run, read from its ``RUN/follow.json``."""

    warmup_steps: int
    """Steps of the linear warm-up at the start of the run (``warmup_ratio`` of the first segment's)."""
    decay_start: int | None
    """The global step where the final segment starts; None while no segment is final."""
    end_step: int
    """The global step after the last planned step."""

    def factor(self, global_step: int) -> float:
        return wsd_lr_factor(
            global_step, warmup_steps=self.warmup_steps, decay_start=self.decay_start, end_step=self.end_step
        )


# ─── Handing a segment over ─────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveDrafter:
    """A drafter and its optimizer, alive after a segment ended (its final checkpoint holds the same)."""

    setup: DrafterSetup
    optimizer: torch.optim.Optimizer
    compiled: bool
    """Its training forward runs compiled layer steps (``DFlashDrafter.compile_training`` was called)."""


class LiveTraining:
    """Hands the live drafter and optimizer of one segment to the next in the same process."""

    def __init__(self) -> None:
        self._kept: LiveDrafter | None = None

    def keep(self, live: LiveDrafter) -> None:
        """What the segment that just ended leaves to the next."""
        self._kept = live

    def take(self) -> LiveDrafter | None:
        """What the previous segment left (None at the start of a process); the holder is then empty,
        so a segment that fails leaves nothing for a later one to take by mistake."""
        live, self._kept = self._kept, None
        return live


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentStart:
    """How the ordinary run of one follow segment starts and where its steps sit in the follow run."""

    first_step: int
    """The follow run's global step of the segment's first step: its local step s is global step
    ``first_step + s`` (its checkpoints and ``metrics.jsonl`` count local steps)."""
    num_steps: int
    """Steps the segment plans (its ``passes`` epochs over its training samples)."""
    schedule: FollowSchedule
    previous_run: Path | None
    """The folder of the previous segment that trained samples, whose final checkpoint this segment
    continues from where no live drafter is handed over (None: the first such segment)."""
    live: LiveTraining | None
    """The in-process handover (None where the segment's ranks run in processes of their own)."""

    def lr_factor(self, local_step: int) -> float:
        return self.schedule.factor(self.first_step + local_step)
