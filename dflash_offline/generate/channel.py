"""How capture jobs reach workers: dynamically, so that a slow worker never stalls the others.

Two transports behind one interface:
- ``QueueJobChannel``: a bounded multiprocessing queue, for worker processes spawned by one
  coordinator (``--gpus`` / ``--workers``).
- ``StoreJobChannel``: a ``torch.distributed`` key-value store, for ``torchrun`` where every rank is
  a worker and rank 0 also plans; workers claim job slots with an atomic counter.
Both carry ``CaptureJob`` records (pickled dataclasses, never tuples); ``None`` means "no more jobs".
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from typing import Any, Protocol

from dflash_offline.generate.plan import CaptureJob


class JobChannel(Protocol):
    def try_put(self, job: CaptureJob, timeout: float) -> bool:
        """Publish ``job``; False when the consumers are still too far behind after ``timeout``."""
        ...

    def finish(self, num_consumers: int) -> None: ...
    def get(self, timeout: float) -> CaptureJob | bool | None:
        """A job; None when the producer has finished; False on timeout (poll again)."""
        ...

    def cancel_join(self) -> None:
        """Let the producing process exit even if jobs were never taken (after a stop)."""
        ...


class QueueJobChannel:
    """A bounded multiprocessing queue: ``put`` blocks when workers are ``depth`` jobs behind."""

    def __init__(self, mp_context: Any, depth: int) -> None:
        self._queue = mp_context.Queue(maxsize=depth)

    def try_put(self, job: CaptureJob, timeout: float) -> bool:
        try:
            self._queue.put(job, timeout=timeout)
        except queue.Full:
            return False
        return True

    def finish(self, num_consumers: int) -> None:
        for _ in range(num_consumers):
            self._queue.put(None)

    def get(self, timeout: float) -> CaptureJob | bool | None:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return False
        assert item is None or isinstance(item, CaptureJob)
        return item

    def cancel_join(self) -> None:
        """Let the coordinator exit even if jobs are still queued (after a stop)."""
        self._queue.cancel_join_thread()


class StoreJobChannel:
    """Jobs published under ``job/<slot>`` keys of a distributed store, claimed with ``store.add``.

    The producer publishes at most ``lookahead`` slots beyond the claims, so the store (held in
    rank 0's memory) stays bounded. ``finish`` publishes one end marker per consumer; the coordinator
    also calls it from its own thread to release the ranks on a stop, hence the lock."""

    _END = b"end"

    def __init__(self, store: Any, *, prefix: str, lookahead: int) -> None:
        self._store = store
        self._prefix = prefix
        self._lookahead = lookahead
        self._published = 0
        self._claimed: int | None = None
        self._lock = threading.Lock()

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def try_put(self, job: CaptureJob, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        payload = pickle.dumps(job)
        while self._published - int(self._store.add(self._key("claimed"), 0)) >= self._lookahead:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        self._publish(payload)
        return True

    def finish(self, num_consumers: int) -> None:
        for _ in range(num_consumers):
            self._publish(self._END)

    def _publish(self, payload: bytes) -> None:
        with self._lock:
            self._store.set(self._key(f"job/{self._published}"), payload)
            self._published += 1

    def get(self, timeout: float) -> CaptureJob | bool | None:
        # A claimed slot is kept across calls: polling (not ``store.wait``) lets the worker check for
        # a stop request between polls, and keeps a store client that other threads share unblocked.
        if self._claimed is None:
            self._claimed = int(self._store.add(self._key("claimed"), 1)) - 1
        key = self._key(f"job/{self._claimed}")
        deadline = time.monotonic() + timeout
        while not self._store.check([key]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        payload = self._store.get(key)
        self._store.delete_key(key)
        self._claimed = None
        if payload == self._END:
            return None
        job = pickle.loads(payload)
        assert isinstance(job, CaptureJob)
        return job

    def cancel_join(self) -> None:
        """Nothing to wait for: published jobs live in the store."""
