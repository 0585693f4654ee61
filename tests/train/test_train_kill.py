"""Training under kills: SIGKILL at random steps (one process, and two spawned CPU DDP workers), Ctrl-C,
then the same command: each rerun resumes from the last checkpoint, the loss sequence and the final
weights equal an uninterrupted run's, and no process of the run survives. `bench/soak_train.py` is the long
version."""

from __future__ import annotations

import random
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_offline.cli import main
from tests.generate.helpers import run_in_process
from tests.train.kill_helpers import (
    KILL_RUN_STEPS,
    assert_same_run,
    losses,
    run_and_kill,
    train_cmd,
)

STEPS = KILL_RUN_STEPS


@pytest.fixture(scope="module")
def cache(uncompressed_cache: Path) -> Path:
    return uncompressed_cache


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("workers", [2, 1])  # the longer first (tests/conftest.py: LONGEST_FIRST)
def test_sigkill_at_random_steps_and_ctrl_c_then_resume_is_exact(
    cache: Path,
    uninterrupted: Callable[[int], Path],
    tmp_path: Path,
    workers: int,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """One run killed at random steps (SIGKILL of the whole group), then Ctrl-C'd once, each time
    rerun with the same command: each rerun says which checkpoint it resumed from, and the run ends as
    the uninterrupted run did; the finished run rerun has nothing left to train."""
    rng = random.Random(1400 + workers)
    kill_points = sorted(rng.sample(range(1, STEPS - 4), 2 if workers == 1 else 1))
    run = tmp_path / "run"
    cmd = train_cmd(cache, run, steps=STEPS, workers=workers, checkpoint_every=4)
    resumed_from = 0  # the checkpoint the next run resumes from (none yet)
    for point in kill_points:
        record = run_and_kill(cmd, run, kill_after_step=point)
        assert record.returncode == -signal.SIGKILL
        assert record.survivors == 0, f"{record.survivors} processes survived a SIGKILL of the group"
        assert record.checkpoint <= record.at_step + 1  # SIGKILL writes nothing more
        if resumed_from:
            assert f"resumed from the checkpoint of step {resumed_from} of {STEPS} (" in record.stderr
        resumed_from = record.checkpoint
    assert 0 < resumed_from < STEPS  # the last SIGKILL came after a checkpoint, before the end
    ctrl_c_at = kill_points[-1] + 2
    record = run_and_kill(cmd, run, kill_after_step=ctrl_c_at, sig=signal.SIGINT)
    assert f"resumed from the checkpoint of step {resumed_from} of {STEPS} (" in record.stderr
    assert record.returncode == 130, record.stderr[-3000:]
    match = re.search(r"interrupted after step (\d+): checkpoint written", record.stderr)
    assert match, record.stderr[-3000:]
    step = int(match.group(1))
    assert ctrl_c_at <= step < STEPS
    assert record.checkpoint == step  # written because of the Ctrl-C, whatever --checkpoint-every says
    assert "Traceback" not in record.stderr
    assert "Aborted" not in record.stderr
    assert record.survivors == 0
    capfd.readouterr()
    done = run_in_process(cmd) + capfd.readouterr().err  # spawned ranks write to the process's stderr
    assert f"resumed from the checkpoint of step {step} of {STEPS} ({STEPS - step} steps to go)" in done
    assert_same_run(run, uninterrupted(workers), steps=STEPS)
    if workers == 1:
        # The finished run rerun (in this process, one rank: no start-up to pay): nothing to train, and it
        # reports the loss the run ended with.
        rerun = CliRunner().invoke(main, cmd[3:])
        assert rerun.exit_code == 0, rerun.output
        assert (
            f"resumed from the checkpoint of step {STEPS} of {STEPS} (nothing left to train)" in rerun.output
        )
        assert f"trained {STEPS} steps; final loss {losses(uninterrupted(1))[-1]:.4f}" in rerun.output
        assert_same_run(run, uninterrupted(workers), steps=STEPS)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_the_coordinator_alone_leaves_no_orphan(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # A long run: its workers must not get away with simply finishing within the grace period.
    cmd = train_cmd(cache, run, steps=100_000, workers=2)
    record = run_and_kill(cmd, run, kill_after_step=3, whole_group=False, grace=15.0)
    assert record.family >= 3  # the launcher and its two spawned ranks were seen
    assert record.survivors == 0, f"{record.survivors} DDP workers outlived their killed parent"
