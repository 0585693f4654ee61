"""A coordinator killed with SIGKILL leaves its multiprocessing semaphores to the resource tracker, which
unlinks them: with ``quiet_resource_tracker`` it does so without its "leaked semaphore" warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import multiprocessing as mp, os, signal, sys
from dflash_offline.workers.lifeline import quiet_resource_tracker
if sys.argv[1] == "quiet":
    quiet_resource_tracker()
ctx = mp.get_context("spawn")
queue, event = ctx.Queue(), ctx.Event()
print(queue._rlock._semlock.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as a run killed mid-way: nothing of it unlinks anything
"""


@pytest.mark.parametrize("mode", ["quiet", "default"])
def test_a_killed_coordinators_semaphores_are_cleaned_up_without_a_warning(mode: str) -> None:
    # communicate() returns once the resource tracker, which shares the stderr pipe, has exited.
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    name = done.stdout.strip()
    assert name
    assert not Path("/dev/shm/sem." + name.lstrip("/")).exists()  # unlinked by the tracker
    warned = "leaked semaphore objects" in done.stderr
    assert warned == (mode == "default"), done.stderr  # the warning is ours to silence, and only that
