"""Which processes a run left behind, read from /proc: children, descendants, process-group members; and
``reaped``, which leaves none of a test's own subprocesses behind.

Used by the kill and crash tests (a command must take its workers with it), by the tests that start a
server or a lock holder (``reaped``) and by bench/soak.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import AnyStr


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _processes(*, zombies: bool = False) -> dict[int, list[str]]:
    """pid -> stat fields of every process (zombies only when asked for)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None and (zombies or fields[0] != "Z"):
            found[int(entry)] = fields
    return found


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (zombies included: they are reaped, not running)."""
    return [child for child, fields in _processes(zombies=True).items() if int(fields[1]) == pid]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (ppid links, any depth; zombies included, ``alive`` drops them)."""
    kids: dict[int, list[int]] = {}
    for child, fields in _processes(zombies=True).items():
        kids.setdefault(int(fields[1]), []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (a run's coordinator, workers, resource tracker)."""
    return [pid for pid, fields in _processes().items() if int(fields[2]) == pgid]


def workers_of(pid: int) -> list[int]:
    """``pid``'s spawned worker processes (multiprocessing ``spawn_main`` children, not its resource
    tracker)."""
    out = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(child)
    return out


def alive(pids: set[int] | list[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies count as gone)."""
    return {pid for pid in pids if (fields := _stat_fields(pid)) is not None and fields[0] != "Z"}


@contextlib.contextmanager
def reaped(process: subprocess.Popen[AnyStr]) -> Iterator[subprocess.Popen[AnyStr]]:
    """``process`` for a ``with`` block. At its end, however the block ends, a process still running is
    killed with SIGKILL (its whole process group when it leads one: a run started in a new session), then
    it is reaped and its pipes are closed: a failing test leaves no process behind, and a passing one no
    pipe for the garbage collector to find open."""
    with process:  # Popen's own exit: closes the pipes, then waits
        try:
            yield process
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if os.getpgid(process.pid) == process.pid:
                        os.killpg(process.pid, signal.SIGKILL)
                    else:
                        process.kill()
