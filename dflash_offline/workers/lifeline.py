"""Child processes die with their coordinator: call ``die_with_parent()`` first thing in a spawned
worker (generate's target workers, train's DDP ranks).

Without it a SIGKILLed coordinator leaves its workers reparented to PID 1, polling for jobs forever
and holding host (and GPU) memory. Two mechanisms, because neither covers every case alone:
  - Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills us the moment the parent exits. It
    fires when the parent *thread* that spawned us ends, so workers must be spawned from the
    coordinator's main thread (they are). Not available on macOS.
  - a daemon thread that polls ``os.getppid()`` and exits the process when it changes (reparented):
    portable, and it also catches a parent that died before ``prctl`` was called.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 1.0
"""How often the watchdog looks at the parent pid (cheap: one syscall)."""
ORPHAN_EXIT_CODE = 75
"""Exit status of a worker that stopped because its coordinator is gone."""

_started = False


def _set_pdeathsig(kill_signal: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(kill_signal), 0, 0, 0)) == 0
    return False


def _watch(parent: int, grace_seconds: float) -> None:
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if os.getppid() != parent:
            stop.wait(grace_seconds)  # time for a graceful stop (e.g. a checkpoint) first
            os._exit(ORPHAN_EXIT_CODE)  # no cleanup: the coordinator that would receive it is gone


def die_with_parent(*, kill_signal: int | None = signal.SIGKILL, grace_seconds: float = 0.0) -> None:
    """Make this process exit when its parent dies (idempotent).

    ``kill_signal``: the parent-death signal to set (None keeps one set before, e.g. torch's spawn
    sets SIGINT, which train handles as a stop request); the watchdog ends the process
    ``grace_seconds`` after it finds itself orphaned, whatever the signal did."""
    global _started
    if _started:
        return
    _started = True
    parent = os.getppid()
    if kill_signal is not None:
        _set_pdeathsig(kill_signal)
    # Already orphaned: the coordinator died while we started (before, or while, prctl took effect).
    if parent == 1 or os.getppid() != parent:
        os._exit(ORPHAN_EXIT_CODE)
    threading.Thread(target=_watch, args=(parent, grace_seconds), name="dflash-lifeline", daemon=True).start()


TRACKER_WARNINGS_OFF = "ignore:resource_tracker:UserWarning"
"""The ``-W`` filter that silences multiprocessing's resource tracker (see ``quiet_resource_tracker``)."""


def quiet_resource_tracker() -> None:
    """Silence the resource tracker's "leaked semaphore objects to clean up at shutdown" warnings.

    A coordinator's multiprocessing queues and events are named POSIX semaphores; when the coordinator
    is killed (SIGKILL, the OOM killer) it cannot unlink them, and the resource tracker process, which
    outlives it, unlinks them itself, warning about each kind first. They are cleaned up: the warning
    only alarms. The tracker takes its warning filters from this process's ``-W`` options when it
    starts (with the first semaphore), so call this before creating any queue or event."""
    if TRACKER_WARNINGS_OFF not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_WARNINGS_OFF)
