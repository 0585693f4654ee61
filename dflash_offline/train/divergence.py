"""A diverged run stops: the first step whose loss or gradient norm is not finite (NaN or Inf) ends training
with a ``DivergedError`` naming it, and no checkpoint or export is ever written from non-finite weights.

The step stays sync-free (train/step.py): its results are checked where the loop reads them back anyway
(each metrics line, a validation, a checkpoint; train/reporting.py keeps the steps run since the last
read-back and reads them in one copy), so a run stops at most ``--log-every`` steps after it diverged,
and at the step itself with the default of 1. A NaN gradient norm makes the clipped update NaN, so every
weight after that step is NaN too: there is nothing to continue from but the newest checkpoint, which was
written from finite weights (``check_weights_finite`` before every checkpoint, whatever the losses said).
Every rank reads the same all-reduced values at the same steps, so under DDP they all stop together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_offline.config_fields import flag
from dflash_offline.errors import DivergedError
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class NonFiniteStep:
    """The first step read back whose loss or gradient norm is NaN or Inf."""

    step: int
    """Optimizer steps completed, that one included (1-based, as in metrics.jsonl)."""
    loss: float
    grad_norm: float
    """The total gradient norm before clipping."""

    def describe(self) -> str:
        return f"loss {self.loss} and gradient norm {self.grad_norm}"


def first_nonfinite(steps: Sequence[tuple[int, float, float]]) -> NonFiniteStep | None:
    """The first of ``(step, loss, grad_norm)`` with a non-finite loss or gradient norm; None when all are
    finite."""
    for step, loss, grad_norm in steps:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return NonFiniteStep(step=step, loss=loss, grad_norm=grad_norm)
    return None


def diverged_error(out_dir: Path, what: str, *, step: int, stopped_after: int) -> DivergedError:
    """What the user reads: ``what`` went non-finite at ``step``, the checkpoint a resume continues from,
    what to change."""
    where = f"at step {step}"
    if stopped_after != step:
        where += f" (read back after step {stopped_after})"
    found = list_checkpoints(out_dir)
    if found:
        saved_step, path = found[-1]
        keep = (
            f"the newest checkpoint, {path.name} (step {saved_step}), holds finite weights: rerun with a "
            f"lower {flag(TrainConfig, 'lr')} to resume from it"
        )
    else:
        keep = f"the run has no checkpoint: train again with a lower {flag(TrainConfig, 'lr')}"
    return DivergedError(
        f"training diverged: {what} {where}; stopped without "
        f"a checkpoint or export of the non-finite weights; {keep} (a larger "
        f"{flag(TrainConfig, 'warmup_ratio')} or a smaller {flag(TrainConfig, 'grad_clip')} may help too)"
    )


def check_weights_finite(out_dir: Path, params: Sequence[torch.Tensor], *, step: int) -> None:
    """Raise ``DivergedError`` before a checkpoint of step ``step`` when a weight is NaN or Inf (an update
    that overflowed although its gradient was finite). One reduction and one host sync: a checkpoint
    copies every weight to the host anyway."""
    finite = torch.stack([torch.isfinite(p.detach()).all() for p in params]).all()
    if not bool(finite):
        raise diverged_error(out_dir, "non-finite weights", step=step, stopped_after=step)
