"""A target worker: one process per GPU (or CPU worker) that captures features for the jobs it pulls.

It builds the target truncated after the last captured layer, pulls ``CaptureJob`` records from the
job channel, runs them, and hands each ``CapturedBatch`` to its writer thread, which appends to this
worker's own shard group. Every outcome goes back to the coordinator as a record on the event
queue; an exception is reported with its traceback (``workers.records.WorkerFailed``) by the process
that runs the worker (``workers.spawned``, ``workers.ranks``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.lossy import LossyLayout
from dflash_offline.cache.rolling import RollingWriter
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.generate.capture_step import PinnedBufferPool, bf16_elements, capture_job
from dflash_offline.generate.channel import JobChannel
from dflash_offline.generate.events import JobDone, WorkerFinished, WorkerStarted, WorkerTimings
from dflash_offline.generate.writer_thread import BatchWritten, WriterThread
from dflash_offline.workers.device import bind_device
from dflash_offline.workers.records import EventSink, StopFlag, WorkerSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureTask:
    """What a generate worker captures and where it writes it (``WorkerSpec.task``, pickled at spawn);
    the spec's ``worker`` names its shard group ``w<worker>``."""

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
    rolling: bool = False
    """Write through bounded, sealed stores (``cache/rolling.py``): on under ``--window-limit`` or
    ``--store-size``."""
    store_bytes: int | None = None
    """Bytes a store holds before it is sealed (None: one store a session, sealed at its end)."""
    val_fraction: float = 0.0
    """Validation share routed into stores of their own (0: none)."""
    chunk_bytes: int | None = None
    """Inner chunk bytes of the stores (None: the cache library's default)."""
    shard_file_bytes: int | None = None
    """Shard file bytes of the stores (None: the cache library's default)."""


def build_capture(task: CaptureTask, device: torch.device) -> Any:
    """The truncated target as a callable (input_ids_BS, attention_mask_BS) -> features_BSF."""
    from dflash_offline.target_model.capture import FeatureCapture
    from dflash_offline.target_model.loader import compute_dtype, load_target

    layer_ids = task.fingerprint.layer_ids
    # The coordinator tokenizes; a worker only runs the forward, so it loads no tokenizer.
    target = load_target(
        task.target,
        device=device,
        dtype=compute_dtype(task.dtype, device),
        max_layer=max(layer_ids),
        tokenizer=False,
    )
    return FeatureCapture(target, layer_ids)


def run_worker(spec: WorkerSpec[CaptureTask], events: EventSink, stop: StopFlag, channel: JobChannel) -> None:
    """A worker's whole life: load the target, capture the jobs it pulls from ``channel`` until the end
    marker or ``stop``, and report on ``events`` (``WorkerStarted``, ``JobDone``, ``WorkerFinished``).
    The entry point of a spawned worker (``workers.spawned``) and of a torchrun rank's (``workers.ranks``)."""
    task = spec.task
    device = bind_device(spec)
    start = time.perf_counter()
    capture = build_capture(task, device)
    # What the host rows hold: bf16 features, or fp8 rows encoded on this device (capture_step.py).
    storage = task.fingerprint.storage
    # Pinned allocations take seconds at these sizes: part of start-up, before the worker says ready.
    pool = PinnedBufferPool(
        num_buffers=task.writer_queue_depth + 2,  # queued + one being written + one being filled
        elements=bf16_elements(task.tokens_per_batch * storage.row_bytes),
        pin=device.type == "cuda",
    )
    load_seconds = time.perf_counter() - start
    events.put(WorkerStarted(worker=spec.worker, device=spec.device, load_seconds=load_seconds))
    with _open_writer(spec) as writer:

        def report(done: BatchWritten) -> None:
            events.put(_job_done(spec, done, stored_bytes=writer.stats.stored_bytes))

        writer_thread = WriterThread(
            writer,
            bucket_edges=task.fingerprint.bucket_edges,
            depth=task.writer_queue_depth,
            on_written=report,
            idle_flush_seconds=max(task.flush_seconds, 0.1) if task.rolling else None,
        )
        try:
            loop = _capture_jobs(
                spec,
                channel,
                stop,
                capture=capture,
                device=device,
                pool=pool,
                fp8=storage.lossy,
                writer_thread=writer_thread,
            )
        finally:
            writer_thread.close()
    events.put(
        WorkerFinished(
            worker=spec.worker,
            device=spec.device,
            jobs=loop.jobs,
            stats=writer.stats,
            timings=WorkerTimings(
                load_seconds=load_seconds,
                forward_seconds=loop.forward_seconds,
                job_wait_seconds=loop.job_wait_seconds,
                writer_wait_seconds=writer_thread.blocked_seconds,
                write_seconds=writer_thread.busy_seconds,
            ),
        )
    )


def _open_writer(spec: WorkerSpec[CaptureTask]) -> ShardWriter | RollingWriter:
    """This worker's shard group ``w<worker>`` of the cache (or its bounded stores)."""
    task = spec.task

    def open_store(session: str) -> ShardWriter:
        return ShardWriter(
            task.cache_dir,
            task.fingerprint,
            worker=spec.worker,
            session=session,
            fsync=task.fsync,
            flush_seconds=task.flush_seconds,
            flush_bytes=task.flush_bytes,
            known_sample_ids=(),  # the planner hands out each sample once; skip the manifest scan
            **({} if task.chunk_bytes is None else {"chunk_bytes": task.chunk_bytes}),
            **({} if task.shard_file_bytes is None else {"shard_bytes": task.shard_file_bytes}),
        )

    if not task.rolling:
        return open_store(task.session)
    return RollingWriter(
        open_store,
        worker=spec.worker,
        session=task.session,
        store_bytes=task.store_bytes,
        token_bytes=task.fingerprint.storage.token_bytes,
        val_fraction=task.val_fraction,
        fsync=task.fsync,
    )


def _job_done(spec: WorkerSpec[CaptureTask], done: BatchWritten, *, stored_bytes: int) -> JobDone:
    return JobDone(
        worker=spec.worker,
        job_index=done.job_index,
        new_samples=done.new_samples,
        new_tokens=done.new_tokens,
        failures=done.failures,
        stored_bytes=stored_bytes,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _CaptureLoop:
    """What the job loop of one worker did."""

    jobs: int
    forward_seconds: float
    """Target forward + padding strip + async copy launch."""
    job_wait_seconds: float
    """Waiting for the planner to hand out a job."""


def _capture_jobs(
    spec: WorkerSpec[CaptureTask],
    channel: JobChannel,
    stop: StopFlag,
    *,
    capture: Any,
    device: torch.device,
    pool: PinnedBufferPool,
    fp8: LossyLayout | None,
    writer_thread: WriterThread,
) -> _CaptureLoop:
    """Pull jobs until the end marker (or a stop request), capture each and hand it to the writer."""
    forward_seconds = job_wait_seconds = 0.0
    jobs = 0
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
        batch = capture_job(capture, job, device=device, pool=pool, pad_id=spec.task.pad_id, fp8=fp8)
        forward_seconds += time.perf_counter() - forward_start
        writer_thread.submit(batch)
        jobs += 1
    return _CaptureLoop(jobs=jobs, forward_seconds=forward_seconds, job_wait_seconds=job_wait_seconds)
