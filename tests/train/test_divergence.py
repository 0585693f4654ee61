"""A diverged run stops: a real tiny run at an absurd learning rate goes NaN at its second step (the first
update at ``--lr 1e12`` blows the weights up). It must fail with ``DivergedError`` naming that step, record
the step in metrics.jsonl, keep only checkpoints of finite weights (the one resume uses), export nothing, and
``dflash export`` must refuse a checkpoint that holds NaN (as one written before this check would)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dflash_offline.errors import DivergedError
from dflash_offline.train.checkpoint import export_run, list_checkpoints, load_latest_checkpoint
from dflash_offline.train.launch import run_training
from tests.train.helpers import train_config


def _diverging(cache: Path, out: Path, **overrides: object) -> DivergedError:
    config = train_config(cache, out, lr=1e12, block_size=4, max_steps=15, val_fraction=0.0, **overrides)
    with pytest.raises(DivergedError) as raised:
        run_training(config)
    return raised.value


def _lines(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _finite(value: object) -> bool:
    """A metrics value is finite (NaN and Inf are written as null by a strict encoder, or as NaN/Infinity)."""
    return isinstance(value, int | float) and math.isfinite(value)


def test_a_nan_step_stops_the_run_at_that_step_and_keeps_the_last_finite_checkpoint(
    tiny_cache: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    error = _diverging(tiny_cache, run, checkpoint_every=1)
    assert "training diverged" in str(error)
    assert "at step 2;" in str(error)  # the first non-finite step, found at its own read-back
    assert "step-00000001 (step 1)" in str(error)
    lines = _lines(run)
    assert [line["step"] for line in lines] == [1, 2]  # nothing ran past the non-finite step
    assert _finite(lines[0]["loss"])
    assert _finite(lines[0]["grad_norm"])
    assert not _finite(lines[1]["loss"])  # where a plot sees the loss stop being finite
    assert [step for step, _path in list_checkpoints(run)] == [1]
    state = load_latest_checkpoint(run)
    assert state is not None
    assert state.global_step == 1
    assert all(bool(torch.isfinite(t).all()) for t in state.model.values() if t.is_floating_point())
    assert not (run / "drafter").exists()


def test_between_read_backs_the_checkpoint_checks_the_steps_it_did_not_read(
    tiny_cache: Path, tmp_path: Path
) -> None:
    """Lines every 5 steps, a checkpoint due at step 3: the checkpoint reads steps 1-3 first, finds step 2,
    writes its line, and saves nothing."""
    run = tmp_path / "run"
    error = _diverging(tiny_cache, run, checkpoint_every=3, log_every=5)
    assert "at step 2 (read back after step 3)" in str(error)
    assert "the run has no checkpoint" in str(error)
    lines = _lines(run)
    assert [line["step"] for line in lines] == [2]
    assert not _finite(lines[0]["loss"])
    assert list_checkpoints(run) == []


def test_export_refuses_a_checkpoint_of_nan_weights(tiny_cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_training(train_config(tiny_cache, run, max_steps=2, checkpoint_every=1, keep_checkpoints=5))
    path = list_checkpoints(run)[-1][1] / "state.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["norm.weight"][0] = float("nan")
    torch.save(state, path)
    with pytest.raises(DivergedError, match=r"norm\.weight") as refused:
        export_run(run, tmp_path / "export")
    assert str(path) in str(refused.value)
    assert "--step" in str(refused.value)
    assert not (tmp_path / "export").exists()
    export_run(run, tmp_path / "export", step=1)  # the earlier, finite checkpoint exports


def test_resume_passes_over_a_checkpoint_of_nan_weights(
    tiny_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose newest checkpoint holds NaN (as a diverged run wrote before the check) resumes from the
    previous, finite one."""
    run = tmp_path / "run"
    run_training(train_config(tiny_cache, run, max_steps=2, checkpoint_every=1, keep_checkpoints=5))
    path = list_checkpoints(run)[-1][1] / "state.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["fc.weight"][0, 0] = float("inf")
    torch.save(state, path)
    run_training(train_config(tiny_cache, run, max_steps=3, checkpoint_every=1, keep_checkpoints=5))
    err = capsys.readouterr().err
    assert "non-finite weights (NaN or Inf) in fc.weight" in err
    assert "resumed from the checkpoint of step 1 of 3" in err
    assert (run / "checkpoints" / "step-00000002.unreadable").is_dir()
    assert [step for step, _path in list_checkpoints(run)] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_ddp_ranks_stop_at_the_same_step(tiny_cache: Path, tmp_path: Path) -> None:
    """Two spawned ranks read the same all-reduced loss and gradient norm: both stop at step 2 (neither
    waits for the other in a collective), and the caller gets the rank's one-line error."""
    run = tmp_path / "run"
    error = _diverging(tiny_cache, run, checkpoint_every=1, num_cpu_workers=2)
    assert "at step 2;" in str(error)
    assert [step for step, _path in list_checkpoints(run)] == [1]
    assert [line["step"] for line in _lines(run)] == [1, 2]
