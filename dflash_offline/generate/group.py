"""The workers of one generate run as its coordinator (``run.py``) sees them, whatever started them.

``SpawnedWorkers`` is one process per GPU or ``--workers N`` CPU processes, spawned here;
``launch.py``'s ``RankWorkers`` is the ranks of a ``torchrun``. Both hand the coordinator the same
worker event records and take jobs through a ``JobChannel``, so that the run row, status, resume
counts and summary are written by one piece of code for every launch path.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Container
from typing import Any, Protocol

from dflash_offline.errors import WorkerError
from dflash_offline.generate.channel import JobChannel, QueueJobChannel
from dflash_offline.generate.events import WorkerStarted
from dflash_offline.generate.worker import WorkerSpec, run_worker
from dflash_offline.workers.lifeline import quiet_resource_tracker

DRAIN_SECONDS = 600.0
"""How long a stopped run waits for its workers to finish their current job and commit."""


class WorkerGroup(Protocol):
    num_workers: int
    channel: JobChannel

    def start(self) -> None:
        """Start the workers (the coordinator has swept the cache and written the ``running`` row)."""
        ...

    def get_event(self, timeout: float) -> object | None:
        """The next worker event record, or None after ``timeout``."""
        ...

    def check_alive(self, finished: Container[int]) -> None:
        """Raise ``WorkerError`` for a worker that ended without reporting (killed, out of memory)."""
        ...

    def stop(self) -> None:
        """Ask every worker to stop after its current job (on failure or interrupt)."""
        ...

    def drain_and_join(self, on_event: Callable[[object], None]) -> None:
        """Pass on the workers' final events while they finish, then wait for them to end."""
        ...


class SpawnedWorkers:
    """One spawned process per worker of ``placement``; jobs and events over multiprocessing queues."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self._specs = specs
        self.num_workers = len(specs)
        quiet_resource_tracker()  # before the first queue: a killed run's semaphores are cleaned up quietly
        self._mp = mp.get_context("spawn")  # CUDA cannot be forked; spawn is the same everywhere
        self._queue_channel = QueueJobChannel(self._mp, depth=2 * self.num_workers + 2)
        self.channel: JobChannel = self._queue_channel
        self._events: Any = self._mp.Queue()
        self._stop = self._mp.Event()
        self._processes: list[Any] = []
        self._dead_since: dict[int, float] = {}
        self._started: set[int] = set()
        """Workers that reported ``WorkerStarted`` (their target is loaded, their writer may be open)."""

    def start(self) -> None:
        for spec in self._specs:
            process = self._mp.Process(
                target=run_worker,
                args=(spec, self.channel, self._events, self._stop),
                name=f"dflash-worker-{spec.worker}",
            )
            process.start()
            self._processes.append(process)

    def get_event(self, timeout: float) -> object | None:
        try:
            event: object = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, WorkerStarted):
            self._started.add(event.worker)
        return event

    def check_alive(self, finished: Container[int]) -> None:
        """Called when the event queue has been quiet; a worker's last events are flushed into the
        queue before its process ends, so one more quiet second after its exit means it died."""
        now = time.monotonic()
        for worker, process in enumerate(self._processes):
            if process.exitcode is None or worker in finished:
                continue
            first_seen = self._dead_since.setdefault(worker, now)
            if now - first_seen > 1.0:
                raise WorkerError(
                    f"worker {worker} exited with code {process.exitcode} without finishing "
                    f"(killed, or out of memory?); the cache is resumable: rerun the same command"
                )

    def stop(self) -> None:
        self._stop.set()
        # A worker still loading its target has opened no shard: end it now rather than after its load.
        for spec, process in zip(self._specs, self._processes, strict=False):
            if spec.worker not in self._started and process.is_alive():
                process.terminate()

    def drain_and_join(self, on_event: Callable[[object], None]) -> None:
        deadline = time.monotonic() + DRAIN_SECONDS
        while any(p.is_alive() for p in self._processes) and time.monotonic() < deadline:
            event = self.get_event(0.2)
            if event is not None:
                on_event(event)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        self._queue_channel.cancel_join()
