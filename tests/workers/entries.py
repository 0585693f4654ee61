"""Test-only entry points of spawned workers (a spawned process imports its entry by name, so they live in
a module): each does one thing a real worker may do, with no target and no torch."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from dflash_offline.workers.records import WorkerSpec

FAULT_TEXT = "injected fault in a test worker"


@dataclass(frozen=True, kw_only=True, slots=True)
class Said:
    """An event of these workers: ``worker`` said ``n``."""

    worker: int
    n: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Done:
    worker: int


def raise_error(spec: WorkerSpec[str], events: Any, stop: Any) -> None:
    """Worker 0 raises; the others wait for the stop request."""
    if spec.worker == 0:
        raise RuntimeError(f"{FAULT_TEXT} ({spec.task})")
    while not stop.is_set():
        time.sleep(0.05)


def die_silently(spec: WorkerSpec[str], events: Any, stop: Any) -> None:
    """Worker 1 is killed (as by the OOM killer: no event, no traceback); the others finish."""
    if spec.worker == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    events.put(Done(worker=spec.worker))


def say_and_leave(spec: WorkerSpec[str], events: Any, stop: Any) -> None:
    """Many events put just before the process ends."""
    for n in range(100):
        events.put(Said(worker=spec.worker, n=n))
    events.put(Done(worker=spec.worker))


def exit_or_wait(spec: WorkerSpec[str], events: Any, stop: Any) -> None:
    """Worker 1 exits with status 3 once the others run; the others wait (a collective would never end)."""
    if spec.worker == 1:
        time.sleep(0.5)
        os._exit(3)
    time.sleep(600)
