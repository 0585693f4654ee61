"""The logged training throughput (``tokens_per_s``) is wall-clock: the tokens of the steps since the
previous metrics read-back over the wall seconds up to the end of this read-back's sync, validation and
checkpoints excluded. A manual clock that only the test moves stands in for the device's time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dflash_offline.train import trainer
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.validation import ValidationSchedule
from tests.tiny_caches import TinyCaches
from tests.train.manual_clock import CPU, SYNC_S, clocked_config, clocked_run, host_seconds

VALIDATION_S = 100.0


def test_logged_tokens_per_s_is_the_wall_throughput_of_the_window(
    tiny_caches: TinyCaches, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = clocked_run(monkeypatch)
    real_validation = ValidationSchedule.evaluate

    def validate(self: ValidationSchedule, *args: Any, **kwargs: Any) -> Any:
        clock.now += VALIDATION_S
        return real_validation(self, *args, **kwargs)

    monkeypatch.setattr(ValidationSchedule, "evaluate", validate)
    config = clocked_config(tiny_caches, tmp_path / "run")
    trainer.train_rank(config, CPU)

    lines = read_metrics(config.out_dir / "metrics.jsonl")
    step_tokens = clock.step_tokens
    assert [line["step"] for line in lines] == [3, 5, 6, 7]
    assert [("val_loss" in line) for line in lines] == [False, True, False, True]
    assert len(step_tokens) == 7
    assert all(t > 0 for t in step_tokens)
    # Each window: the steps since the previous read-back (the first from the first step's start), their
    # host seconds and the read-back's sync; the checkpoint after step 4 and the validations excluded.
    windows = {3: [1, 2, 3], 5: [4, 5], 6: [6], 7: [7]}
    for line in lines:
        steps = windows[int(line["step"])]  # type: ignore[call-overload]
        seconds = sum(host_seconds(s) for s in steps) + SYNC_S
        tokens = sum(step_tokens[s - 1] for s in steps)
        assert line["tokens"] == step_tokens[steps[-1] - 1]  # the step's own, as before
        assert line["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12)
        assert line["step_seconds"] == pytest.approx(seconds / len(steps), rel=1e-12)
        assert line["data_wait_fraction"] == 0.0
