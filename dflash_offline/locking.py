"""One writer at a time: an exclusive lock on ``DIR/lock`` for a cache (``dflash generate``,
``dflash verify --repair``) or a training run directory (``dflash train --out``), and on
``FILE.lock`` beside an output file (``dflash regenerate --out FILE``).

The lock is ``fcntl.flock`` on ``DIR/lock``; the file also holds a JSON line naming the holder (pid,
host, start time, command). The kernel drops a flock when its process dies, however it dies, so a
killed holder never blocks the next run; its JSON is still in the file, which is how the next run
knows it takes over a *stale* lock and says so (never silently). A second live run is refused at once
with a one-line ``LockedError`` naming the holder. Released locks unlink the file; an acquirer checks
after ``flock`` that the path still names the file it locked (else it retries), so unlinking is safe.

flock works across processes of one host and, on Linux, over NFS (emulated with POSIX locks); a
holder on another host of a shared file system is still detected through its JSON when it died.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from dflash_offline.errors import DflashError

LOCK_NAME = "lock"
"""The lock file's name inside the locked directory (cache or training run)."""


class LockedError(DflashError):
    """Another live process holds the directory's lock."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LockHolder:
    """Who holds (or held) a lock: written as JSON into the lock file."""

    pid: int
    host: str
    started_at: str
    """ISO 8601 UTC time the lock was taken."""
    command: str
    """The command line of the holder, e.g. ``dflash generate --cache /data/c``."""

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.started_at}: {self.command}"

    @classmethod
    def from_json(cls, text: str) -> LockHolder | None:
        """The holder recorded in a lock file, or None when it is empty or unreadable (torn write)."""
        try:
            d: Any = json.loads(text)
            return cls(
                pid=int(d["pid"]),
                host=str(d["host"]),
                started_at=str(d["started_at"]),
                command=str(d["command"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def current_command() -> str:
    """This process's command line, shortened for a one-line message."""
    argv = [Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]
    if argv[0] in ("__main__.py", "-m"):
        argv[0] = "dflash"
    text = " ".join(argv)
    return text if len(text) <= 200 else text[:197] + "..."


class DirLock:
    """A held lock; ``release()`` (or leaving the ``with`` block) gives it back. Idempotent."""

    def __init__(self, path: Path, fd: int, holder: LockHolder, took_over: LockHolder | None) -> None:
        self.path = path
        self.holder = holder
        self.took_over = took_over
        """The dead holder whose stale lock this one replaced, if any."""
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlink while still holding the lock: a waiter that opened the old file notices (inode check).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def acquire_lock(
    directory: str | Path, *, what: str, command: str | None = None, announce: bool = True
) -> DirLock:
    """Take ``directory``'s lock (creating the directory) or raise ``LockedError`` naming the holder.

    ``what`` names the directory in messages ("cache", "training run"). A stale lock (its holder died)
    is taken over, and ``announce`` prints one line about it to stderr."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return _acquire(
        directory / LOCK_NAME,
        subject=f"{what} {directory}",
        why="two writers would commit the same samples twice",
        command=command,
        announce=announce,
    )


def lock_path_beside(output: str | Path) -> Path:
    """``FILE.lock``: the lock file of an output file ``FILE``."""
    output = Path(output)
    return output.with_name(output.name + ".lock")


def acquire_lock_beside(
    output: str | Path, *, what: str, why: str, command: str | None = None, announce: bool = True
) -> DirLock:
    """Take the lock of the output file ``output`` (``FILE.lock`` beside it, its folder created) or raise
    ``LockedError`` naming the holder; ``why`` says what two writers would do to the file."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    return _acquire(
        lock_path_beside(output), subject=f"{what} {output}", why=why, command=command, announce=announce
    )


def _acquire(path: Path, *, subject: str, why: str, command: str | None, announce: bool) -> DirLock:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = LockHolder.from_json(_read_fd(fd))
            os.close(fd)
            who = holder.describe() if holder else "another process (it has not written its name yet)"
            raise LockedError(
                f"{subject} is in use by {who}; wait for it to finish or stop it ({why})"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder released (and unlinked) it between our open and flock: try again
            os.close(fd)
            continue
        break
    stale = LockHolder.from_json(_read_fd(fd))
    holder = LockHolder(
        pid=os.getpid(),
        host=socket.gethostname(),
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        command=command or current_command(),
    )
    data = (json.dumps(asdict(holder)) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    if stale is not None and announce:
        print(
            f"note: took over the stale lock of {subject} from {stale.describe()} (that process is gone)",
            file=sys.stderr,
        )
    return DirLock(path, fd, holder, stale)


@contextlib.contextmanager
def hold_lock(directory: str | Path, *, what: str, command: str | None = None) -> Iterator[DirLock]:
    """``acquire_lock`` as a context manager."""
    lock = acquire_lock(directory, what=what, command=command)
    try:
        yield lock
    finally:
        lock.release()


def _read_fd(fd: int) -> str:
    chunks = []
    offset = 0
    while True:
        chunk = os.pread(fd, 65536, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks).decode(errors="replace")
