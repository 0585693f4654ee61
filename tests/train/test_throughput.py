"""The logged training throughput (``tokens_per_s``) is wall-clock: the tokens of the steps since the
previous metrics read-back over the wall seconds up to the end of this read-back's sync, validation and
checkpoints excluded. A manual clock that only the test moves stands in for the device's time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_offline.placement import DistInfo
from dflash_offline.train import loop
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.step import OptimizerStep, StepOutcome
from dflash_offline.train.validation import ValidationSchedule
from tests.tiny_caches import TinyCaches
from tests.train.helpers import train_config

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")

SYNC_S = 2.0
"""What a read-back of the step results waits for the device (the queued steps' compute)."""
VALIDATION_S = 100.0
CHECKPOINT_S = 1000.0


def _host_seconds(step: int) -> float:
    """Host seconds of step ``step`` (1-based): distinct per step, so that no other rule matches."""
    return 0.25 * step


class ManualClock:
    """``time.perf_counter`` that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_logged_tokens_per_s_is_the_wall_throughput_of_the_window(
    tiny_caches: TinyCaches, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    # Patched on the time module, not in one module of the package: the test holds whichever module
    # reads the clock. Nothing on this path waits for perf_counter to pass a deadline (those use
    # time.monotonic), and the prefetcher's data wait reads 0 (the clock stands still while it waits).
    monkeypatch.setattr(time, "perf_counter", clock)
    step_tokens: list[int] = []
    real_step, real_read = OptimizerStep.__call__, StepOutcome.read
    real_validation, real_checkpoint = ValidationSchedule.evaluate, loop.save_checkpoint

    def step(self: OptimizerStep, inputs: Sequence[Any], padding: Sequence[bool]) -> StepOutcome:
        outcome = real_step(self, inputs, padding)
        step_tokens.append(sum(i.num_tokens for i, pad in zip(inputs, padding, strict=True) if not pad))
        clock.now += _host_seconds(len(step_tokens))
        return outcome

    def read(self: StepOutcome) -> Any:
        clock.now += SYNC_S
        return real_read(self)

    def validate(self: ValidationSchedule, *args: Any, **kwargs: Any) -> Any:
        clock.now += VALIDATION_S
        return real_validation(self, *args, **kwargs)

    def checkpoint(*args: Any, **kwargs: Any) -> Any:
        clock.now += CHECKPOINT_S
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "__call__", step)
    monkeypatch.setattr(StepOutcome, "read", read)
    monkeypatch.setattr(ValidationSchedule, "evaluate", validate)
    monkeypatch.setattr(loop, "save_checkpoint", checkpoint)

    # Read-backs at the log steps 3 and 6, the validation of step 5 and the last step, 7 (validated
    # too); checkpoints after steps 4 and 7.
    config = train_config(
        tiny_caches.get(records=60, seed=11).root, tmp_path / "run", max_steps=7, log_every=3, val_every=5,
        checkpoint_every=4, tensorboard=False, val_fraction=0.15,
    )  # fmt: skip
    loop.train_rank(config, CPU)

    lines = read_metrics(config.out_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [3, 5, 6, 7]
    assert [("val_loss" in line) for line in lines] == [False, True, False, True]
    assert len(step_tokens) == 7
    assert all(t > 0 for t in step_tokens)
    # Each window: the steps since the previous read-back (the first from the first step's start), their
    # host seconds and the read-back's sync; the checkpoint after step 4 and the validations excluded.
    windows = {3: [1, 2, 3], 5: [4, 5], 6: [6], 7: [7]}
    for line in lines:
        steps = windows[int(line["step"])]  # type: ignore[call-overload]
        seconds = sum(_host_seconds(s) for s in steps) + SYNC_S
        tokens = sum(step_tokens[s - 1] for s in steps)
        assert line["tokens"] == step_tokens[steps[-1] - 1]  # the step's own, as before
        assert line["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12)
        assert line["step_seconds"] == pytest.approx(seconds / len(steps), rel=1e-12)
        assert line["data_wait_fraction"] == 0.0
