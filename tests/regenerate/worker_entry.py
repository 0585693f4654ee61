"""Test-only entry points for regenerate workers (imported by name in the child process), so that the
production worker carries no fault-injection or hold hook: a spawned worker that fails, and (run as
``python -m tests.regenerate.worker_entry regenerate ARGS...``, e.g. by torchrun) the CLI with every
worker held after its first written conversation until the run asks it to stop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
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


HOLD_ENV = "DFLASH_TEST_HOLD_DIR"
"""Read by ``run_worker_held_after_first_answer`` and ``__main__`` (set by the test, inherited)."""


def run_worker_held_after_first_answer(
    spec: WorkerSpec[worker.AnswerTask], emit: Callable[[Any], None], should_stop: Callable[[], bool]
) -> worker.WorkerDone:
    """``worker.run_worker`` that, once its first conversation is written (and flushed), says so with a
    file ``w<worker>`` in ``$DFLASH_TEST_HOLD_DIR`` and holds there until ``should_stop`` (the run's
    Ctrl-C) or 10 minutes pass: a test can interrupt the run while every worker is mid-run with an answer
    written, however fast the machine."""
    held = Path(os.environ[HOLD_ENV])

    def held_emit(event: Any) -> None:
        emit(event)
        mark = held / f"w{spec.worker}"
        if isinstance(event, worker.WorkerProgress) and event.delta.written and not mark.exists():
            mark.touch()
            deadline = time.monotonic() + 600
            while not should_stop() and time.monotonic() < deadline:
                time.sleep(0.05)

    return worker.run_worker(spec, held_emit, should_stop)


if __name__ == "__main__":
    # The CLI with held workers (above); each process records its exit status as exit-<RANK>.
    from dflash_offline.cli import main
    from dflash_offline.regenerate import run

    run.run_worker = run_worker_held_after_first_answer  # type: ignore[assignment]
    status: Any = "an exception"
    try:
        main()
        status = 0
    except SystemExit as e:
        status = e.code
        raise
    finally:
        (Path(os.environ[HOLD_ENV]) / f"exit-{os.environ.get('RANK', '0')}").write_text(str(status))
