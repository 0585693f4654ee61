"""A coordinator's view of its workers, whatever started them (``spawned.SpawnedWorkers``,
``ranks.RankWorkers``), and the one loop that watches them (``watch``).

Each command says once, in a ``GroupPolicy``, which of its events mean "loaded" and "finished", how long
a stopped run waits for its workers, and how their failures read; the groups and ``watch`` do the rest:
a worker's exception stops the run (a ``DflashError`` with its one line, any other with its traceback), a
worker that died without a word (killed, out of memory) stops it too, and the first Ctrl-C stops it
between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dflash_offline.errors import DflashError, NoSpaceError, WorkerError
from dflash_offline.interrupt import StopRequested, stop_requested
from dflash_offline.workers.records import WorkerFailed, user_error

POLL_SECONDS = 0.2
"""How long the coordinator waits for an event before it looks at its workers and redraws."""
QUIET_SECONDS = 1.0
"""A worker's last events reach the coordinator before its process ends, so a worker found ended
without finishing after this much more quiet time died (it is not a late ``finished`` event)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPolicy:
    """How one command's workers report, stop and read when they fail."""

    label: str
    """How messages name one worker: ``worker`` ("worker 1 (cpu) failed"), ``regenerate worker``."""
    resumable: str
    """What the rerun of the same command resumes: ``the cache``, ``the output``."""
    process_name: str
    """Name prefix of spawned worker processes (``dflash-worker`` -> ``dflash-worker-0``)."""
    drain_seconds: float
    """How long a stopped run waits for its workers to finish their current step and close their files."""
    ready: type | None = None
    """The event a worker sends once loaded; a stop lets a worker that sent it finish its step, and ends
    one still loading at once (it has opened nothing). None: every worker is let finish."""
    finished: type | None = None
    """The event a worker sends last when it ended well. None: only exit statuses tell."""
    no_space_at: str = ""
    """Where a worker's full disk is reported (a one-line ``NoSpaceError``, the directory the user can
    free space for); empty: reported as any failure."""

    def failed_error(self, failed: WorkerFailed) -> DflashError:
        """The error that stops the run when a worker sent ``failed``."""
        if failed.no_space and self.no_space_at:
            return NoSpaceError(self.no_space_at)
        # The user's to fix (a server that stopped answering, a bad file): one line, as from one worker;
        # a traceback is for the bugs.
        user = user_error(failed)
        if user is not None:
            return user
        return WorkerError(
            f"{self.label} {failed.worker} ({failed.device}) failed; {self.resumable} is resumable. "
            f"Its traceback:\n{failed.traceback}"
        )

    def died_error(self, worker: int, exit_code: int | None) -> WorkerError:
        """The error that stops the run when a worker ended without finishing or a word."""
        return WorkerError(
            f"{self.label} {worker} exited with code {exit_code} without finishing "
            f"(killed, or out of memory?); {self.resumable} is resumable: rerun the same command"
        )


class WorkerRoll:
    """Which workers said they are ready, and which finished, from the events the coordinator reads."""

    def __init__(self, policy: GroupPolicy) -> None:
        self._policy = policy
        self.ready: set[int] = set()
        self.finished: set[int] = set()

    def note(self, event: object) -> None:
        worker = getattr(event, "worker", None)
        if self._policy.ready is not None and isinstance(event, self._policy.ready):
            assert isinstance(worker, int)
            self.ready.add(worker)
        if self._policy.finished is not None and isinstance(event, self._policy.finished):
            assert isinstance(worker, int)
            self.finished.add(worker)


class WorkerGroup(Protocol):
    num_workers: int
    policy: GroupPolicy

    def start(self) -> None:
        """Start the workers."""
        ...

    def get_event(self, timeout: float) -> object | None:
        """The next worker event record, or None after ``timeout``."""
        ...

    @property
    def all_finished(self) -> bool:
        """Every worker sent its ``policy.finished`` event."""
        ...

    def check_alive(self) -> None:
        """Raise ``WorkerError`` for a worker that ended without finishing (killed, out of memory)."""
        ...

    def stop(self) -> None:
        """Ask every worker to stop after its current step (on failure or interrupt)."""
        ...

    def drain_and_join(self, on_event: Callable[[object], None]) -> None:
        """Pass on the workers' last events while they finish, then wait for them to end."""
        ...


def watch(
    group: WorkerGroup,
    on_event: Callable[[object], None],
    *,
    each_turn: Callable[[], None] | None = None,
    on_quiet: Callable[[], None] | None = None,
) -> None:
    """Pass the group's events to ``on_event`` until every worker has finished.

    Raises ``StopRequested`` at a stop request (the first Ctrl-C, ``interrupt.stop_on_sigint``), the
    ``policy.failed_error`` of a worker's ``WorkerFailed`` (after ``on_event`` saw it), and
    ``WorkerError`` for a worker that ended without a word. ``each_turn`` runs before each read (it may
    raise: generate's planner error); ``on_quiet`` when no event came for ``POLL_SECONDS``."""
    while not group.all_finished:
        if each_turn is not None:
            each_turn()
        if stop_requested():
            raise StopRequested
        event = group.get_event(POLL_SECONDS)
        if event is None:
            group.check_alive()
            if on_quiet is not None:
                on_quiet()
            continue
        on_event(event)
        if isinstance(event, WorkerFailed):
            raise group.policy.failed_error(event)
