"""Drive `dflash train` as a real subprocess, kill it at chosen steps, rerun the same command.

Used by tests/train/test_train_kill.py (a few kill points), test_train_faults.py, test_train_torchrun.py and
bench/soak_train.py (many).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.metrics import read_metrics
from tests.process_helpers import alive, descendants

KILL_RUN_STEPS = 15
"""Steps of the runs the kill and torchrun tests interrupt (and of the uninterrupted ones they equal)."""

FAMILY_SCAN_SECONDS = 0.25
"""How often ``run_and_kill`` reads the run's processes while it waits for the step to kill at."""


def train_cmd(
    cache: Path, run: Path, *, steps: int, workers: int = 1, checkpoint_every: int = 3
) -> list[str]:
    return [
        sys.executable, "-m", "dflash_offline", "train",
        "--cache", str(cache), "--out", str(run),
        "--num-layers", "1", "--block-size", "8", "--num-anchors", "32",
        "--tokens-per-microbatch", "600", "--lr", "3e-3", "--epochs", "100",
        "--max-steps", str(steps), "--grad-accum", "1", "--checkpoint-every", str(checkpoint_every),
        "--loader-threads", "2", "--prefetch", "2", "--deterministic", "--threads", "1", "--no-progress",
        "--workers", str(workers),
    ]  # fmt: skip


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    metrics = read_metrics(path)
    return int(metrics[-1]["step"]) if metrics else 0  # type: ignore[call-overload]


@dataclass(frozen=True, kw_only=True, slots=True)
class KillRecord:
    """One kill of a training run."""

    at_step: int
    """Last step in metrics.jsonl when the signal was sent."""
    checkpoint: int
    """Newest checkpoint step on disk after the kill (0: none)."""
    survivors: int
    """Processes of the run still alive a few seconds after the kill."""
    family: int
    """Processes of the run seen before the kill (the launched one included)."""
    returncode: int | None
    stderr: str


def run_and_kill(
    cmd: list[str],
    run: Path,
    *,
    kill_after_step: int,
    sig: int = signal.SIGKILL,
    whole_group: bool = True,
    timeout: float = 300.0,
    grace: float = 10.0,
    extra_delay: float = 0.0,
) -> KillRecord:
    """Start ``cmd``, send ``sig`` once metrics.jsonl passes ``kill_after_step``, wait for the end."""
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finally)
    process = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + timeout
    family: set[int] = set()
    next_scan = 0.0
    try:
        while time.monotonic() < deadline and process.poll() is None:
            # The process table is read a few times a second (each read costs a millisecond or two of CPU
            # per hundred processes), the step every 20 ms; the family is read again just before the kill.
            if time.monotonic() >= next_scan:
                family |= descendants(process.pid)
                next_scan = time.monotonic() + FAMILY_SCAN_SECONDS
            if last_step(run) >= kill_after_step:
                break
            time.sleep(0.02)
        if extra_delay and process.poll() is None:
            time.sleep(extra_delay)  # somewhere inside the next step (data wait, forward, checkpoint)
            family |= descendants(process.pid)
        at = last_step(run)
        if process.poll() is not None:
            stderr.seek(0)
            raise AssertionError(
                f"training ended (rc {process.returncode}) before step {kill_after_step}: "
                + stderr.read().decode(errors="replace")[-2000:]
            )
        family |= descendants(process.pid)
        if whole_group:
            os.killpg(process.pid, sig)
        else:
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        end = time.monotonic() + grace
        while alive(family) and time.monotonic() < end:
            time.sleep(0.1)
        survivors = alive(family)
        stderr.seek(0)
        return KillRecord(
            at_step=at,
            checkpoint=max((s for s, _ in list_checkpoints(run)), default=0),
            survivors=len(survivors),
            family=len(family | {process.pid}),
            returncode=process.returncode,
            stderr=stderr.read().decode(errors="replace"),
        )
    finally:
        for pid in alive(family | {process.pid}):  # never leave a process behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stderr.close()


def run_to_end(cmd: list[str], *, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def losses(run: Path) -> list[float]:
    return [float(m["loss"]) for m in read_metrics(run / "metrics.jsonl")]  # type: ignore[arg-type]


def final_state(run: Path) -> dict[str, torch.Tensor]:
    _step, path = list_checkpoints(run)[-1]
    return torch.load(path / "state.pt", map_location="cpu", weights_only=False)["model"]


def assert_same_run(run: Path, reference: Path, *, steps: int) -> None:
    """``run`` logged steps 1..``steps`` with the reference's losses and ended with its weights, bit for
    bit."""
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(1, steps + 1))
    assert losses(run) == losses(reference)
    a, b = final_state(reference), final_state(run)
    for name in a:
        assert torch.equal(a[name], b[name]), name
