"""Records that workers send to the coordinating process (one queue, one record type per event); a
worker's failure is the ``WorkerFailed`` of every worker group (``workers/records.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_offline.cache.rows import WriterStats
from dflash_offline.workers.records import WorkerFailed


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerStarted:
    worker: int
    device: str
    load_seconds: float
    """Time to build the target on the device and allocate the pinned host buffers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobDone:
    """A job's samples were handed to the writer (committed at the writer's next flush)."""

    worker: int
    job_index: int
    new_samples: int
    """Samples of the job that the cache did not hold yet and that were written."""
    new_tokens: int
    failures: int
    """Samples of the job that failed (non-finite features)."""
    stored_bytes: int
    """Bytes the worker's shard holds on disk so far (cumulative)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerTimings:
    """Where a worker's wall time went."""

    load_seconds: float
    """Building the target on the device and allocating the pinned buffers (``WorkerStarted``'s): the
    rest of the run's start-up is the process's spawn, imports and device set-up."""
    forward_seconds: float
    """Target forward + padding strip + async copy launch (synchronised per batch on CPU only)."""
    job_wait_seconds: float
    """Waiting for the planner to hand out a job."""
    writer_wait_seconds: float
    """Forward loop blocked because the writer queue was full (disk or encode is the bottleneck)."""
    write_seconds: float
    """Writer thread busy encoding, checksumming and writing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFinished:
    worker: int
    device: str
    jobs: int
    stats: WriterStats
    timings: WorkerTimings


WorkerEvent = WorkerStarted | JobDone | WorkerFinished | WorkerFailed
