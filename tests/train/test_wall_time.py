"""Where ``dflash train``'s wall time goes: each validation line's ``val_seconds``, the first line's
``startup_seconds`` and the run's ``WallSplit`` (start-up, steps, validation, checkpoints and exports),
against a hand count over a manual clock that only the test moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_offline.drafter import export
from dflash_offline.train import trainer
from dflash_offline.train.metrics import WallClock, WallSplit, read_metrics
from dflash_offline.train.validation import Validator
from tests.tiny_caches import TinyCaches
from tests.train.manual_clock import (
    CHECKPOINT_S,
    CPU,
    SYNC_S,
    ManualClock,
    clocked_config,
    clocked_run,
    host_seconds,
)

COMMAND_START = 500.0
"""``started_at``: the command's start, before ``train_rank`` (the clock reads 1,000 when it is called)."""
SETUP_S = 7.0
"""The model's build inside ``train_rank``."""
VALIDATION_S = 100.0
EXPORT_S = 10_000.0


def test_wall_time_is_split_by_what_it_was_spent_on(
    tiny_caches: TinyCaches, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = clocked_run(monkeypatch)
    real_evaluate = Validator.evaluate
    real_setup, real_export = trainer.build_drafter_setup, export.export_drafter
    exports: list[str] = []

    def setup(*args: Any, **kwargs: Any) -> Any:
        clock.now += SETUP_S
        return real_setup(*args, **kwargs)

    def evaluate(self: Validator, *args: Any, **kwargs: Any) -> Any:
        clock.now += VALIDATION_S
        return real_evaluate(self, *args, **kwargs)

    def export_drafter(model: Any, out: Path, *args: Any, **kwargs: Any) -> Any:
        clock.now += EXPORT_S
        exports.append(out.name)
        return real_export(model, out, *args, **kwargs)

    monkeypatch.setattr(trainer, "build_drafter_setup", setup)
    monkeypatch.setattr(Validator, "evaluate", evaluate)
    monkeypatch.setattr(export, "export_drafter", export_drafter)

    # Read-backs at the log steps 3 and 6, the validations of steps 5 and 7 (the last); checkpoints after
    # steps 4 and 7; the best drafter's export after each better validation, drafter-last at the end.
    config = clocked_config(tiny_caches, tmp_path / "run")
    result = trainer.train_rank(config, CPU, started_at=COMMAND_START)
    end = clock.now

    lines = read_metrics(config.out_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [3, 5, 6, 7]
    assert len(clock.step_tokens) == 7
    # The start-up, on the first line only: the time before train_rank, the set-up, the first step.
    startup = 1_000.0 - COMMAND_START + SETUP_S + host_seconds(1)
    assert [line.get("startup_seconds") for line in lines] == [startup, None, None, None]
    # val_seconds on the validation lines only: the pass itself, not the best drafter's export after it.
    assert [line.get("val_seconds") for line in lines] == [None, VALIDATION_S, None, VALIDATION_S]
    assert [("val_loss" in line) for line in lines] == [False, True, False, True]

    assert exports[-1] == "drafter-last"
    assert set(exports[:-1]) == {"drafter"}
    steps = sum(host_seconds(s) for s in range(2, 8)) + 4 * SYNC_S  # after the first; 4 read-backs
    assert result.wall == WallSplit(
        total_seconds=end - COMMAND_START,
        startup_seconds=startup,
        step_seconds=pytest.approx(steps, rel=1e-12),  # type: ignore[arg-type]
        num_steps=7,
        validation_seconds=2 * VALIDATION_S,
        num_validations=2,
        # The checkpoint after step 4 (no line there) reads that step back first: no checkpoint of
        # non-finite weights (train/checkpoint.py).
        checkpoint_seconds=2 * CHECKPOINT_S + SYNC_S + len(exports) * EXPORT_S,
    )
    assert result.wall.other_seconds == pytest.approx(0.0, abs=1e-9)
    line = result.wall.describe()
    assert f"{startup:.1f} s start-up" in line
    assert "200.0 s in 2 validations" in line
    assert f"{steps:.1f} s in 6 more steps" in line


def test_a_run_without_steps_has_no_start_up() -> None:
    clock = ManualClock()
    wall = WallClock(started_at=990.0, device=torch.device("cpu"), clock=clock)
    clock.now += 3.0
    with wall.timed("checkpoint") as lap:
        clock.now += 4.0
    wall.steps_ended()
    clock.now += 1.0
    split = wall.split()
    assert lap.seconds == 4.0
    assert split == WallSplit(
        total_seconds=18.0,
        startup_seconds=None,
        step_seconds=0.0,
        num_steps=0,
        validation_seconds=0.0,
        num_validations=0,
        checkpoint_seconds=4.0,
    )
    assert split.other_seconds == 14.0
    assert "no step ran" in split.describe()
