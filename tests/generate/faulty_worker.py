"""A test-only worker entry point: the production worker, with its capture step made to raise after
``FAULT_AFTER_JOBS`` jobs. Spawned workers import this module by name (it must live in a module, not in
a test function), so the fault reaches the worker process without any hook in production code."""

from __future__ import annotations

from typing import Any

from dflash_offline.generate import worker
from dflash_offline.generate.channel import JobChannel

FAULT_AFTER_JOBS = 2


def run_faulty_worker(spec: worker.WorkerSpec, channel: JobChannel, events: Any, stop: Any) -> None:
    """``worker.run_worker`` whose ``capture_job`` raises once this process has captured 2 jobs."""
    real_capture_job = worker.capture_job
    jobs_done = 0

    def capture_job(*args: Any, **kwargs: Any) -> Any:
        nonlocal jobs_done
        if jobs_done >= FAULT_AFTER_JOBS:
            raise RuntimeError(f"injected fault after {jobs_done} jobs (tests/generate/faulty_worker.py)")
        jobs_done += 1
        return real_capture_job(*args, **kwargs)

    worker.capture_job = capture_job  # type: ignore[assignment]  # this spawned process only
    worker.run_worker(spec, channel, events, stop)
