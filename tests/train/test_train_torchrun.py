"""``dflash train`` under ``torchrun`` with two CPU ranks (gloo): the same loss curve and weights as two
spawned workers (``--workers 2``) under ``--deterministic``; the same command again resumes from the
final checkpoint and trains nothing twice; a SIGKILL of one rank, then a rerun that continues from
the last checkpoint and ends as the uninterrupted run did."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_offline.train.checkpoint import list_checkpoints
from tests.torchrun_helpers import rank_pid, torchrun_cmd, torchrun_env
from tests.train.kill_helpers import KILL_RUN_STEPS, assert_same_run, last_step, train_cmd

STEPS = KILL_RUN_STEPS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # each torchrun start costs seconds


@pytest.fixture(scope="module")
def cache(uncompressed_cache: Path) -> Path:
    return uncompressed_cache


@pytest.fixture(scope="module")
def reference(uninterrupted: Callable[[int], Path]) -> Path:
    """Two spawned CPU workers, uninterrupted."""
    return uninterrupted(2)


def _torchrun_train(cache: Path, run: Path, *, steps: int) -> list[str]:
    # --workers 1: under torchrun the ranks are the workers (the world size comes from torchrun).
    return torchrun_cmd(*train_cmd(cache, run, steps=steps, workers=1, checkpoint_every=4)[3:])


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=torchrun_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_torchrun_ranks_train_as_two_workers_and_resume(cache: Path, reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = _torchrun_train(cache, run, steps=STEPS)
    _run(cmd)
    assert_same_run(run, reference, steps=STEPS)  # losses and final weights of two spawned workers
    checkpoints = list_checkpoints(run)
    assert max(step for step, _ in checkpoints) == STEPS  # the end of a run is checkpointed
    # The same command again resumes from that checkpoint: no step is trained or logged twice.
    _run(cmd)
    assert list_checkpoints(run) == checkpoints
    assert_same_run(run, reference, steps=STEPS)


def test_sigkill_of_one_rank_then_rerun_ends_as_uninterrupted(
    cache: Path, reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cmd = _torchrun_train(cache, run, steps=STEPS)
    process = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=torchrun_env()
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None and last_step(run) < 5:
            time.sleep(0.02)
        victim = rank_pid(process.pid, 1)
        assert victim is not None, "no rank 1 found before the run ended"
        os.kill(victim, signal.SIGKILL)
        _, stderr = process.communicate(timeout=200)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0, stderr.decode(errors="replace")[-3000:]
    assert last_step(run) < STEPS
    _run(cmd)
    assert_same_run(run, reference, steps=STEPS)
