"""Worker processes spawned by one coordinator (one per GPU or CPU worker, train's DDP ranks), both halves.

- ``SpawnedWorkers`` (the coordinator): one process per ``WorkerSpec``; their event records come back
  over one queue, a stop request goes out as one event; it finds a worker that died without a word,
  drains and joins them at the end, and ends the ones that do not.
- ``spawned_main`` (the child): its lifeline (it dies with its coordinator), its Ctrl-C policy, the
  coordinator's stderr wrapper, the command's entry point, and any exception carried to the coordinator
  as ``WorkerFailed`` (exit 1).

An entry point is a module-level function ``entry(spec, events, stop, *shared)`` (pickled by name):
``events`` takes its event records, ``stop.is_set()`` is the coordinator's stop request, ``shared`` the
objects every worker of the group gets (generate's job queue).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from dflash_offline.interrupt import skip_exit_collection
from dflash_offline.workers.group import POLL_SECONDS, QUIET_SECONDS, GroupPolicy, WorkerRoll
from dflash_offline.workers.lifeline import die_with_parent, quiet_resource_tracker
from dflash_offline.workers.records import EventSink, StopFlag, WorkerSpec, failure_reported

JOIN_SECONDS = 5.0
"""How long the coordinator waits for a worker to end before it signals it (SIGTERM, then SIGKILL)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildPolicy:
    """How a spawned worker treats its coordinator's death and Ctrl-C."""

    parent_death_signal: int | None = signal.SIGKILL
    """Sent to the worker by the kernel when its coordinator dies (``lifeline.die_with_parent``)."""
    orphan_grace_seconds: float = 0.0
    """An orphaned worker still alive this long after it found itself orphaned exits (time for a
    checkpoint first)."""
    ignore_sigint: bool = True
    """A terminal's Ctrl-C reaches the whole process group and the coordinator decides. False: the entry
    handles SIGINT itself (train's ranks stop at their step boundary)."""
    stderr_wrapper: Callable[[Any], Any] | None = None
    """Wrapped around the worker's ``sys.stderr`` before its entry runs: the coordinator's own stderr
    wrapper (``inherited_stderr_wrapper``, set by ``SpawnedWorkers.start``): the command line's
    ``cli.flags.FlagsOnStream``, so that a worker's notes name options by their flags, as its
    coordinator's do."""


def inherited_stderr_wrapper() -> Callable[[Any], Any] | None:
    """The type of this process's ``sys.stderr`` when that type asks, by a true class attribute
    ``wraps_spawned_workers``, to wrap the stderr of the workers spawned while it is in place (a class,
    pickled by name to the worker); None otherwise."""
    wrapper = type(sys.stderr)
    return wrapper if getattr(wrapper, "wraps_spawned_workers", False) else None


def spawn_context() -> Any:
    """The multiprocessing context of worker processes and of the queues they share."""
    quiet_resource_tracker()  # before the first queue: a killed run's semaphores are cleaned up quietly
    return mp.get_context("spawn")  # CUDA cannot be forked; spawn is the same everywhere


def spawned_main(
    entry: Callable[..., None],
    spec: WorkerSpec[Any],
    events: EventSink,
    stop: StopFlag,
    policy: ChildPolicy,
    shared: tuple[Any, ...],
) -> None:
    """The process entry of every spawned worker: ``entry(spec, events, stop, *shared)`` under ``policy``."""
    # First: a killed coordinator must not leave workers polling for jobs forever, holding their GPU.
    die_with_parent(kill_signal=policy.parent_death_signal, grace_seconds=policy.orphan_grace_seconds)
    if policy.ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if policy.stderr_wrapper is not None:
        sys.stderr = policy.stderr_wrapper(sys.stderr)
    try:
        with failure_reported(spec, events):
            entry(spec, events, stop, *shared)
    except BaseException:
        raise SystemExit(1) from None  # reported: the coordinator stops the run with the traceback
    skip_exit_collection()  # the coordinator waits for this exit (seconds of garbage collection else)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerExit:
    """A worker process that ended with a non-zero status."""

    worker: int
    pid: int
    exit_code: int
    """The process's exit status; ``-N`` when signal ``N`` ended it."""


class SpawnedWorkers:
    """One spawned process per spec; events back over one queue, a stop request out (a ``WorkerGroup``)."""

    def __init__(
        self,
        entry: Callable[..., None],
        specs: Sequence[WorkerSpec[Any]],
        *,
        policy: GroupPolicy,
        child: ChildPolicy | None = None,
        shared: tuple[Any, ...] = (),
    ) -> None:
        self._entry = entry
        self._specs = list(specs)
        self.num_workers = len(self._specs)
        self.policy = policy
        self._child = child or ChildPolicy()
        self._shared = shared
        self._mp = spawn_context()
        self._events: Any = self._mp.Queue()
        self._stop = self._mp.Event()
        self._processes: list[Any] = []
        self._roll = WorkerRoll(policy)
        self._dead_since: dict[int, float] = {}

    def start(self) -> None:
        child = replace(self._child, stderr_wrapper=inherited_stderr_wrapper())
        for spec in self._specs:
            process = self._mp.Process(
                target=spawned_main,
                args=(self._entry, spec, self._events, self._stop, child, self._shared),
                name=f"{self.policy.process_name}-{spec.worker}",
            )
            process.start()
            self._processes.append(process)

    def get_event(self, timeout: float) -> object | None:
        try:
            event: object = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        self._roll.note(event)
        return event

    @property
    def all_finished(self) -> bool:
        return len(self._roll.finished) >= self.num_workers

    def check_alive(self) -> None:
        """Called when the event queue has been quiet: a worker that ended without finishing, and stayed
        silent for ``QUIET_SECONDS`` more, died."""
        now = time.monotonic()
        for spec, process in zip(self._specs, self._processes, strict=False):
            if process.exitcode is None or spec.worker in self._roll.finished:
                continue
            if now - self._dead_since.setdefault(spec.worker, now) > QUIET_SECONDS:
                raise self.policy.died_error(spec.worker, process.exitcode)

    def stop(self) -> None:
        self._stop.set()
        if self.policy.ready is None:
            return
        # A worker still loading its target has opened nothing: end it now rather than after its load.
        for spec, process in zip(self._specs, self._processes, strict=False):
            if spec.worker not in self._roll.ready and process.is_alive():
                process.terminate()

    def drain_and_join(self, on_event: Callable[[object], None]) -> None:
        """Pass on the workers' events while they finish (up to ``policy.drain_seconds``), join them, end
        the ones still alive (SIGTERM, then SIGKILL), and pass on the events they sent last."""
        deadline = time.monotonic() + self.policy.drain_seconds
        while any(p.is_alive() for p in self._processes) and time.monotonic() < deadline:
            event = self.get_event(POLL_SECONDS)
            if event is not None:
                on_event(event)
        for process in self._processes:
            process.join(timeout=JOIN_SECONDS)
            for end in (process.terminate, process.kill):
                if process.is_alive():
                    end()
                    process.join(timeout=JOIN_SECONDS)
        while (event := self.get_event(0.0)) is not None:  # put just before its process ended
            on_event(event)

    def wait_for_exit(self, on_event: Callable[[object], None]) -> WorkerExit | None:
        """Pass on events until every worker has ended; the first that ends with a non-zero status is
        returned as soon as it has (None: all of them exited with 0). Exits are seen as they happen (the
        process sentinels, as torch's spawn watched them), so the worker returned is the first to end:
        usually the cause, rather than a peer that failed because of it in a broken collective."""
        running = {p.sentinel: (spec, p) for spec, p in zip(self._specs, self._processes, strict=False)}
        while running:
            for sentinel in mp_connection.wait(list(running), timeout=POLL_SECONDS):
                spec, process = running.pop(sentinel)
                process.join()
                if process.exitcode != 0:
                    return WorkerExit(worker=spec.worker, pid=process.pid, exit_code=process.exitcode)
            while (event := self.get_event(0.0)) is not None:
                on_event(event)
        return None

    def terminate(self) -> None:
        """SIGTERM to every worker still alive (``drain_and_join`` then waits for them)."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()

    def send_signal(self, signum: int) -> None:
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)


@contextlib.contextmanager
def forwarding_sigint(group: SpawnedWorkers) -> Iterator[None]:
    """While the coordinator only waits for its workers, pass SIGINT on to them: a ``kill -INT`` of the
    coordinator alone must reach them too (main thread only; elsewhere nothing is forwarded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        group.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
