"""Entry point of ``dflash generate``: spawned workers (``--gpus`` / ``--workers``) or ``torchrun`` ranks.

Under ``torchrun`` every rank is one worker (its GPU is ``LOCAL_RANK``); rank 0 also runs the one
coordinator of ``run.py`` (plan, run row, status, summary, index merge) over ``RankWorkers``: jobs go
out and worker events come back through the process group's key-value store. Multi-node runs need
only a shared file system for the cache directory. A rank that dies makes torchrun stop the others;
rank 0 then records the run as ``failed`` and the rerun of the same command resumes.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Container
from dataclasses import replace
from types import FrameType
from typing import Any

from dflash_offline.errors import WorkerError
from dflash_offline.generate.channel import JobChannel, LockedStore, StoreJobChannel
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.context import RunContext
from dflash_offline.generate.run import (
    GenerateSummary,
    coordinate,
    prepare_run,
    run_generate,
    worker_spec,
)
from dflash_offline.generate.worker import WorkerSpec, failure_event, run_worker_in_process
from dflash_offline.placement import torchrun_device, under_torchrun

PREFIX = "dflash-generate"
"""Key prefix of this run's entries in the torchrun store."""


class RankTerminatedError(WorkerError):
    """torchrun stopped rank 0 (SIGTERM): another rank failed or was killed."""


def generate_from_config(config: GenerateConfig) -> GenerateSummary | None:
    """Run generate where the environment says; returns the summary on the coordinator (None on
    the other torchrun ranks). The caller prints it (``format_summary``)."""
    if under_torchrun():
        return run_generate_distributed(config)
    return run_generate(config)


def format_summary(summary: GenerateSummary, *, cache_dir: str) -> str:
    lines = [
        f"run {summary.run_id}: {summary.status} in {summary.seconds:.1f} s",
        f"  committed {summary.samples_committed} samples, {summary.tokens_committed} tokens "
        f"({summary.tokens_per_second:,.0f} tok/s), {summary.stored_bytes / 1e9:.3f} GB stored, "
        f"{summary.failures} failures, {summary.skipped_already_done} already in the cache",
    ]
    for w in summary.workers:
        t = w.timings
        lines.append(
            f"  worker {w.stats.shard} on {w.device}: {w.jobs} jobs, {w.stats.samples} samples, "
            f"{w.stats.tokens} tokens; forward {t.forward_seconds:.1f} s, "
            f"waited for jobs {t.job_wait_seconds:.1f} s, for the writer {t.writer_wait_seconds:.1f} s; "
            f"writer busy {t.write_seconds:.1f} s"
        )
    lines.append(f"inspect: dflash status {cache_dir}   |   dflash sql {cache_dir} --query buckets")
    return "\n".join(lines)


class _StoreEvents:
    """A rank's ``events`` queue: records under ``events/<rank>/<n>`` keys of the store, in order."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank
        self._sent = 0

    def put(self, event: object) -> None:
        self._store.set(f"{PREFIX}/events/{self._rank}/{self._sent}", pickle.dumps(event))
        self._sent += 1


class _StoreStop:
    """The run's stop request as a store key: set by rank 0, polled by every rank between jobs."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._key = f"{PREFIX}/stop"
        self._local = threading.Event()

    def set(self) -> None:
        self._local.set()
        self._store.set(self._key, b"1")

    def is_set(self) -> bool:
        return self._local.is_set() or bool(self._store.check([self._key]))


def _work_reporting(spec: WorkerSpec, channel: JobChannel, events: Any, stop: Any) -> None:
    """The worker loop of a rank; a failure is reported as a ``WorkerFailed`` record, then raised."""
    try:
        run_worker_in_process(spec, channel, events, stop)
    except BaseException as e:
        events.put(failure_event(spec, e))
        raise


class RankWorkers:
    """The ``WorkerGroup`` of a torchrun run, seen from rank 0: its own worker runs in a thread,
    the other ranks' events are read from the store."""

    def __init__(self, ctx: RunContext, store: Any, world: int) -> None:
        self._ctx = ctx
        self._store = store
        self.num_workers = world
        self._store_channel = StoreJobChannel(store, prefix=f"{PREFIX}/jobs", lookahead=2 * world + 2)
        self.channel: JobChannel = self._store_channel
        self._stop = _StoreStop(store)
        self._local: queue.Queue[object] = queue.Queue()
        self._received = [0] * world
        self._thread: threading.Thread | None = None
        self._dead_since: float | None = None

    def start(self) -> None:
        import torch.distributed as dist

        self._store.set(f"{PREFIX}/session", self._ctx.session)
        dist.barrier()  # the other ranks start once the cache is swept and the run row written
        spec = worker_spec(self._ctx, worker=0, device=torchrun_device())
        self._thread = threading.Thread(
            target=self._own_worker, args=(spec,), name="dflash-worker-0", daemon=True
        )
        self._thread.start()

    def _own_worker(self, spec: WorkerSpec) -> None:
        # A failure is reported as WorkerFailed: the coordinator stops the run with its traceback.
        with contextlib.suppress(BaseException):
            _work_reporting(spec, self.channel, self._local, self._stop)

    def get_event(self, timeout: float) -> object | None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._local.get_nowait()
            except queue.Empty:
                pass
            for rank in range(1, self.num_workers):
                key = f"{PREFIX}/events/{rank}/{self._received[rank]}"
                if self._store.check([key]):
                    payload = self._store.get(key)
                    self._store.delete_key(key)
                    self._received[rank] += 1
                    event: object = pickle.loads(payload)
                    return event
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def check_alive(self, finished: Container[int]) -> None:
        """Rank 0's own worker thread; a dead rank elsewhere makes torchrun stop this one."""
        if self._thread is None or self._thread.is_alive() or 0 in finished:
            return
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
        elif now - self._dead_since > 1.0:
            raise WorkerError("rank 0's worker ended without finishing; the cache is resumable")

    def stop(self) -> None:
        self._stop.set()
        self._store_channel.finish(self.num_workers)  # ranks waiting for a job get an end marker

    def drain_and_join(self, on_event: Callable[[object], None]) -> None:
        if self._thread is not None:
            self._thread.join(timeout=600)
        while (event := self.get_event(0.0)) is not None:
            on_event(event)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the coordinator record the run
    raise RankTerminatedError(
        "torchrun stopped rank 0 (SIGTERM): another rank failed or was killed; the cache is "
        "resumable: rerun the same command"
    )


def run_generate_distributed(config: GenerateConfig) -> GenerateSummary | None:
    """One rank of a ``torchrun`` generate; returns the summary on rank 0, None elsewhere."""
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")  # only for the store and barriers: no tensors move
    rank, world = dist.get_rank(), dist.get_world_size()
    store = LockedStore(dist.distributed_c10d._get_default_store())
    try:
        if rank == 0:
            previous = signal.signal(signal.SIGTERM, _raise_terminated)
            try:
                ctx = prepare_run(config, lock=True)
                store.set(f"{PREFIX}/ready", b"1")
                summary: GenerateSummary | None = coordinate(ctx, lambda ctx: RankWorkers(ctx, store, world))
            finally:
                signal.signal(signal.SIGTERM, previous)
        else:
            store.get(f"{PREFIX}/ready")  # blocks until rank 0 has created or checked the cache
            ctx = prepare_run(config)  # reads only; meanwhile rank 0 sweeps and writes the run row
            dist.barrier()  # rank 0 has swept the cache: workers may write
            ctx = replace(ctx, session=store.get(f"{PREFIX}/session").decode())
            spec = worker_spec(ctx, worker=rank, device=torchrun_device())
            channel = StoreJobChannel(store, prefix=f"{PREFIX}/jobs", lookahead=2 * world + 2)
            _work_reporting(spec, channel, _StoreEvents(store, rank), _StoreStop(store))
            summary = None
        dist.barrier()  # every rank leaves after rank 0's run row and index merge
        return summary
    finally:
        dist.destroy_process_group()
