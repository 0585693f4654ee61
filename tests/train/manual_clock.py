"""A training run on a manual clock that only the test moves: each optimizer step costs host seconds that
differ per step, each read-back of the step results a device sync, each checkpoint a fixed time; a test adds
its own costs (validation, set-up, exports) the same way and checks the run's timings against a hand count."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_offline.placement import DistInfo
from dflash_offline.train import trainer
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.step import OptimizerStep, StepOutcome
from tests.tiny_caches import TinyCaches
from tests.train.helpers import train_config

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")

SYNC_S = 2.0
"""What a read-back of the step results waits for the device (the queued steps' compute)."""
CHECKPOINT_S = 1000.0


def host_seconds(step: int) -> float:
    """Host seconds of step ``step`` (1-based): distinct per step, so that no other rule matches."""
    return 0.25 * step


@dataclass(kw_only=True)
class ManualClock:
    """``time.perf_counter`` and ``time.time`` while installed: they move only when the test says."""

    now: float = 1_000.0
    step_tokens: list[int] = field(default_factory=list)
    """The tokens of each optimizer step run so far (its length: the steps run)."""

    def __call__(self) -> float:
        return self.now


def clocked_run(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """Install the clock, and the costs of steps, read-backs and checkpoints (module docstring).

    Patched on the time module, not in one module of the package: the test holds whichever module reads
    the clock. Nothing on the training path waits for either clock to pass a deadline (those use
    time.monotonic), and the prefetcher's data wait reads 0 (the clock stands still while it waits)."""
    clock = ManualClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(time, "time", clock)
    real_step, real_read, real_checkpoint = (
        OptimizerStep.__call__,
        StepOutcome.read_all,
        trainer.save_checkpoint,
    )

    def step(self: OptimizerStep, inputs: Sequence[Any], padding: Sequence[bool]) -> StepOutcome:
        outcome = real_step(self, inputs, padding)
        clock.step_tokens.append(sum(i.num_tokens for i, pad in zip(inputs, padding, strict=True) if not pad))
        clock.now += host_seconds(len(clock.step_tokens))
        return outcome

    def read(outcomes: Sequence[StepOutcome]) -> Any:  # one copy of every step since the last read-back
        clock.now += SYNC_S
        return real_read(outcomes)

    def checkpoint(*args: Any, **kwargs: Any) -> Any:
        clock.now += CHECKPOINT_S
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "__call__", step)
    monkeypatch.setattr(StepOutcome, "read_all", staticmethod(read))
    monkeypatch.setattr(trainer, "save_checkpoint", checkpoint)
    return clock


def clocked_config(tiny_caches: TinyCaches, out: Path) -> TrainConfig:
    """Seven steps: read-backs at the log steps 3 and 6, validations at step 5 and the last step, 7;
    checkpoints after steps 4 and 7."""
    return train_config(
        tiny_caches.get(records=60, seed=11).root, out, max_steps=7, log_every=3, val_every=5,
        checkpoint_every=4, tensorboard=False, val_fraction=0.15,
    )  # fmt: skip
