"""The ranks of a ``torchrun`` as one worker group: every rank runs one worker, rank 0 also coordinates.

torchrun starts the processes (and stops them all when one dies), so nothing here spawns: a worker's
event records travel through the process group's key-value store (``StoreEvents``, read by rank 0's
``RankWorkers``) and the coordinator's stop request is one store key (``StoreStop``). Rank 0's own
worker runs in a thread of the coordinating process.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_offline.errors import WorkerError
from dflash_offline.workers.group import QUIET_SECONDS, GroupPolicy, WorkerRoll
from dflash_offline.workers.records import EventSink, StopFlag, WorkerSpec, failure_reported


class LockedStore:
    """A ``torch.distributed`` store whose calls are serialised: rank 0's planner, worker and
    coordinator threads share one client connection."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes | str) -> None:
        with self._lock:
            self._store.set(key, value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return int(self._store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return bool(self._store.check(keys))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return bool(self._store.delete_key(key))


class StoreEvents:
    """A rank's event queue: records under ``<prefix>/events/<rank>/<n>`` keys of the store, in order."""

    def __init__(self, store: Any, *, prefix: str, rank: int) -> None:
        self._store = store
        self._key = f"{prefix}/events/{rank}"
        self._sent = 0

    def put(self, event: object) -> None:
        self._store.set(f"{self._key}/{self._sent}", pickle.dumps(event))
        self._sent += 1


class StoreStop:
    """The run's stop request as a store key: set by rank 0, polled by every rank between steps."""

    def __init__(self, store: Any, *, prefix: str) -> None:
        self._store = store
        self._key = f"{prefix}/stop"
        self._local = threading.Event()

    def set(self) -> None:
        self._local.set()
        self._store.set(self._key, b"1")

    def is_set(self) -> bool:
        return self._local.is_set() or bool(self._store.check([self._key]))


def run_rank_worker(
    entry: Callable[..., None], spec: WorkerSpec[Any], events: EventSink, stop: StopFlag, *shared: Any
) -> None:
    """A rank's worker in this process: ``entry(spec, events, stop, *shared)``; an exception is put on
    ``events`` as ``WorkerFailed`` (rank 0 stops the run with its traceback), then raised."""
    with failure_reported(spec, events):
        entry(spec, events, stop, *shared)


class RankWorkers:
    """The ``WorkerGroup`` of a torchrun run, seen from rank 0: its own worker runs in a thread, the other
    ranks' events are read from the store (every rank runs ``run_rank_worker`` with the same ``prefix``)."""

    def __init__(
        self,
        entry: Callable[..., None],
        spec: WorkerSpec[Any],
        *,
        store: Any,
        prefix: str,
        policy: GroupPolicy,
        shared: tuple[Any, ...] = (),
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self._entry = entry
        self._spec = spec
        self._store = store
        self._prefix = prefix
        self.num_workers = spec.num_workers
        self.policy = policy
        self._shared = shared
        self._on_stop = on_stop
        self._stop = StoreStop(store, prefix=prefix)
        self._local: queue.Queue[object] = queue.Queue()
        self._received = [0] * self.num_workers
        self._thread: threading.Thread | None = None
        self._roll = WorkerRoll(policy)
        self._dead_since: float | None = None

    def start(self) -> None:
        import torch.distributed as dist

        dist.barrier()  # the other ranks start their workers once the coordinator is ready for them
        self._thread = threading.Thread(
            target=self._own_worker, name=f"{self.policy.process_name}-{self._spec.worker}", daemon=True
        )
        self._thread.start()

    def _own_worker(self) -> None:
        # A failure is reported as WorkerFailed: the coordinator stops the run with its traceback.
        with contextlib.suppress(BaseException):
            run_rank_worker(self._entry, self._spec, self._local, self._stop, *self._shared)

    def get_event(self, timeout: float) -> object | None:
        deadline = time.monotonic() + timeout
        while True:
            event = self._next_event()
            if event is not None:
                self._roll.note(event)
                return event
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _next_event(self) -> object | None:
        """Rank 0's own worker's next event, else the next one of another rank in the store, else None."""
        with contextlib.suppress(queue.Empty):
            return self._local.get_nowait()
        for rank in range(1, self.num_workers):
            key = f"{self._prefix}/events/{rank}/{self._received[rank]}"
            if self._store.check([key]):
                payload = self._store.get(key)
                self._store.delete_key(key)
                self._received[rank] += 1
                event: object = pickle.loads(payload)
                return event
        return None

    @property
    def all_finished(self) -> bool:
        return len(self._roll.finished) >= self.num_workers

    def check_alive(self) -> None:
        """Rank 0's own worker thread; a dead rank elsewhere makes torchrun stop this one."""
        if self._thread is None or self._thread.is_alive() or self._spec.worker in self._roll.finished:
            return
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
        elif now - self._dead_since > QUIET_SECONDS:
            raise WorkerError(
                f"rank 0's {self.policy.label} ended without finishing; {self.policy.resumable} is resumable"
            )

    def stop(self) -> None:
        self._stop.set()
        if self._on_stop is not None:
            self._on_stop()

    def drain_and_join(self, on_event: Callable[[object], None]) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.policy.drain_seconds)
        while (event := self.get_event(0.0)) is not None:
            on_event(event)
