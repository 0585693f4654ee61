"""A target worker: one process per GPU (or CPU worker) that captures features for the jobs it pulls.

It builds the target truncated after the last captured layer, pulls ``CaptureJob`` records from the
job channel, runs them, and hands each ``CapturedBatch`` to its writer thread, which appends to this
worker's own shard group. Every outcome goes back to the coordinator as a record on the event
queue; an exception is reported with its traceback and the process exits non-zero.
"""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.errors import find_no_space
from dflash_offline.generate.capture_step import PinnedBufferPool, capture_job
from dflash_offline.generate.channel import JobChannel
from dflash_offline.generate.events import JobDone, WorkerFailed, WorkerFinished, WorkerStarted, WorkerTimings
from dflash_offline.generate.writer_thread import BatchWritten, WriterThread
from dflash_offline.interrupt import skip_exit_collection
from dflash_offline.workers.lifeline import die_with_parent


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs (pickled to it at spawn)."""

    worker: int
    """Worker index: the shard group prefix ``w<worker>``."""
    device: str
    """``cuda:<i>`` or ``cpu``."""
    cpu_threads: int
    """torch intra-op threads (CPU workers share the machine's cores)."""
    target: str
    dtype: str | None
    """A key of ``target.loader.DTYPES``, or None for the device's default."""
    cache_dir: Path
    fingerprint: CacheFingerprint
    session: str
    fsync: bool
    flush_seconds: float
    flush_bytes: int
    tokens_per_batch: int
    writer_queue_depth: int
    pad_id: int


def build_capture(spec: WorkerSpec, device: torch.device) -> Any:
    """The truncated target as a callable (input_ids_BS, attention_mask_BS) -> features_BSF."""
    from dflash_offline.target.capture import FeatureCapture
    from dflash_offline.target.loader import compute_dtype, load_target

    layer_ids = spec.fingerprint.layer_ids
    target = load_target(
        spec.target, device=device, dtype=compute_dtype(spec.dtype, device), max_layer=max(layer_ids)
    )
    return FeatureCapture(target, layer_ids)


def run_worker(spec: WorkerSpec, channel: JobChannel, events: Any, stop: Any) -> None:
    """Process entry point. ``events`` is a queue of ``WorkerEvent`` records; ``stop`` an Event."""
    die_with_parent()  # a killed coordinator must not leave workers polling for jobs forever
    # Ctrl-C goes to the whole process group: the coordinator decides, workers finish their job.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _work(spec, channel, events, stop)
    except BaseException as e:
        events.put(failure_event(spec, e))
        raise SystemExit(1) from None
    skip_exit_collection()  # the coordinator waits for this exit (seconds of garbage collection else)


def failure_event(spec: WorkerSpec, error: BaseException) -> WorkerFailed:
    """The ``WorkerFailed`` record of ``error``; call it in the ``except`` block that caught it (the record
    carries the traceback being handled)."""
    no_space = find_no_space(error)
    return WorkerFailed(
        worker=spec.worker,
        device=spec.device,
        traceback=traceback.format_exc(),
        no_space_path="" if no_space is None else str(spec.cache_dir),
    )


def run_worker_in_process(spec: WorkerSpec, channel: JobChannel, events: Any, stop: Any) -> None:
    """The worker loop in the calling process (a torchrun rank); exceptions propagate."""
    _work(spec, channel, events, stop)


def _work(spec: WorkerSpec, channel: JobChannel, events: Any, stop: Any) -> None:
    device = torch.device(spec.device)
    if device.type == "cuda":
        if device.index is None:  # `--device cuda`: the current device (set_device needs an index)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.cpu_threads)
    start = time.perf_counter()
    capture = build_capture(spec, device)
    feature_width = spec.fingerprint.feature_width
    # Pinned allocations take seconds at these sizes: part of start-up, before the worker says ready.
    pool = PinnedBufferPool(
        num_buffers=spec.writer_queue_depth + 2,  # queued + one being written + one being filled
        elements=spec.tokens_per_batch * feature_width,
        pin=device.type == "cuda",
    )
    events.put(
        WorkerStarted(worker=spec.worker, device=spec.device, load_seconds=time.perf_counter() - start)
    )
    forward_seconds = job_wait_seconds = 0.0
    jobs = 0
    with ShardWriter(
        spec.cache_dir,
        spec.fingerprint,
        worker=spec.worker,
        session=spec.session,
        fsync=spec.fsync,
        flush_seconds=spec.flush_seconds,
        flush_bytes=spec.flush_bytes,
        known_sample_ids=(),  # the planner hands out each sample once; skip the manifest scan
    ) as writer:

        def report(done: BatchWritten) -> None:
            events.put(
                JobDone(
                    worker=spec.worker,
                    job_index=done.job_index,
                    new_samples=done.new_samples,
                    new_tokens=done.new_tokens,
                    failures=done.failures,
                    stored_bytes=writer.stats.stored_bytes,
                )
            )

        writer_thread = WriterThread(
            writer,
            bucket_edges=spec.fingerprint.bucket_edges,
            depth=spec.writer_queue_depth,
            on_written=report,
        )
        try:
            while not stop.is_set():
                wait_start = time.perf_counter()
                job = channel.get(timeout=0.5)
                job_wait_seconds += time.perf_counter() - wait_start
                if job is False:
                    continue
                if job is None:
                    break
                assert not isinstance(job, bool)
                forward_start = time.perf_counter()
                batch = capture_job(capture, job, device=device, pool=pool, pad_id=spec.pad_id)
                forward_seconds += time.perf_counter() - forward_start
                writer_thread.submit(batch)
                jobs += 1
        finally:
            writer_thread.close()
    events.put(
        WorkerFinished(
            worker=spec.worker,
            device=spec.device,
            jobs=jobs,
            stats=writer.stats,
            timings=WorkerTimings(
                forward_seconds=forward_seconds,
                job_wait_seconds=job_wait_seconds,
                writer_wait_seconds=writer_thread.blocked_seconds,
                write_seconds=writer_thread.busy_seconds,
            ),
        )
    )
