"""Test-only entry points for spawned regenerate workers (imported by name in the child process), so that
the production worker carries no fault-injection hook."""

from __future__ import annotations

from typing import Any

from dflash_offline.regenerate import worker
from dflash_offline.workers.records import WorkerSpec

FAULT_TEXT = "injected fault in the record loop"


def faulty_worker_process(spec: WorkerSpec[worker.AnswerTask], events: Any, stop: Any) -> None:
    """``worker.worker_process`` whose record loop raises once the engine is loaded."""

    def failing_record_loop(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{FAULT_TEXT} of worker {spec.worker}")

    worker.answer_records = failing_record_loop  # type: ignore[assignment]
    worker.worker_process(spec, events, stop)
