"""Test-only entry points for regenerate workers (imported by name in the child process), so that the
production worker carries no fault-injection or hold hook: a spawned worker that fails; a spawned worker
that logs the turns it submits and holds after its k-th answer (``recording_worker_process``); and (run as
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


def _held_after_first_written(
    spec: WorkerSpec[worker.AnswerTask], emit: Callable[[Any], None], should_stop: Callable[[], bool]
) -> Callable[[Any], None]:
    """``emit`` that, once the worker's first conversation is written (and flushed), says so with a file
    ``w<worker>`` in ``$DFLASH_TEST_HOLD_DIR`` and holds there until ``should_stop`` (the run's Ctrl-C) or
    10 minutes pass."""
    held = Path(os.environ[HOLD_ENV])

    def held_emit(event: Any) -> None:
        emit(event)
        mark = held / f"w{spec.worker}"
        if isinstance(event, worker.WorkerProgress) and event.delta.written and not mark.exists():
            mark.touch()
            deadline = time.monotonic() + 600
            while not should_stop() and time.monotonic() < deadline:
                time.sleep(0.05)

    return held_emit


def run_worker_held_after_first_answer(
    spec: WorkerSpec[worker.AnswerTask], emit: Callable[[Any], None], should_stop: Callable[[], bool]
) -> worker.WorkerDone:
    """``worker.run_worker`` held after its first written conversation (``_held_after_first_written``): a
    test can interrupt the run while every worker is mid-run with an answer written, however fast the
    machine."""
    return worker.run_worker(spec, _held_after_first_written(spec, emit, should_stop), should_stop)


def answer_records_held_after_first_answer(
    spec: WorkerSpec[worker.AnswerTask],
    loaded: Any,
    emit: Callable[[Any], None],
    should_stop: Callable[[], bool],
) -> worker.WorkerDone:
    """``worker.answer_records`` (the single worker in the command's own process) held the same way."""
    held_emit = _held_after_first_written(spec, emit, should_stop)
    return worker.answer_records(spec, loaded, held_emit, should_stop)


SUBMITS_ENV = "DFLASH_TEST_SUBMITS_DIR"
"""Read by ``recording_worker_process``: where each worker logs the turns it submits (set by the test)."""
HOLD_AFTER_ENV = "DFLASH_TEST_HOLD_AFTER_ANSWERS"
"""Read by ``recording_worker_process``: hold after this many answers (unset: never hold)."""


def log_submits(log: Path) -> None:
    """Make every ``SlotEngine`` of this process append the key of each turn it is given to ``log`` (one
    flushed line per submit: ``<sample id>#<turn>``)."""
    from dflash_offline.regenerate.slot_engine import SlotEngine

    submit = SlotEngine.submit

    def logged(engine: SlotEngine, key: str, prompt: Any, **hints: Any) -> None:
        with open(log, "a") as f:
            f.write(key + "\n")
        submit(engine, key, prompt, **hints)

    SlotEngine.submit = logged  # type: ignore[method-assign]


def recording_worker_process(spec: WorkerSpec[worker.AnswerTask], events: Any, stop: Any) -> None:
    """``worker.worker_process`` that logs its submits to ``$DFLASH_TEST_SUBMITS_DIR/submits-w<worker>`` and,
    with ``$DFLASH_TEST_HOLD_AFTER_ANSWERS`` = k, once it has k answers and a conversation in progress
    (answered turns and a turn in the engine) writes ``answered-w<worker>`` there and holds until its stop
    flag (or 10 minutes): a test can stop the run while each worker has answers and conversations in
    progress, however fast the machine and whichever order the engine answers in."""
    from dflash_offline.regenerate.driver import Driver

    directory = Path(os.environ[SUBMITS_ENV])
    log_submits(directory / f"submits-w{spec.worker}")
    hold_after = int(os.environ.get(HOLD_AFTER_ENV, "0"))
    run_worker = worker.run_worker
    answered = Driver._answered

    def run_held(held_spec: Any, emit: Callable[[Any], None], should_stop: Callable[[], bool]) -> Any:
        answers = 0
        held = False

        def held_answered(driver: Driver, key: str, tokens: Any) -> None:
            nonlocal answers, held
            answered(driver, key, tokens)  # the answer is added and the conversation's next turn submitted
            answers += 1
            if hold_after and not held and answers >= hold_after and driver.in_progress():
                held = True
                (directory / f"answered-w{spec.worker}").touch()
                deadline = time.monotonic() + 600
                while not should_stop() and time.monotonic() < deadline:
                    time.sleep(0.05)

        Driver._answered = held_answered  # type: ignore[method-assign]
        return run_worker(held_spec, emit, should_stop)

    worker.run_worker = run_held  # type: ignore[assignment]
    worker.worker_process(spec, events, stop)


if __name__ == "__main__":
    # The CLI with held workers (above); each process records its exit status as exit-<RANK>.
    from dflash_offline.cli import main
    from dflash_offline.regenerate import run

    run.run_worker = run_worker_held_after_first_answer  # type: ignore[assignment]
    run.answer_records = answer_records_held_after_first_answer  # type: ignore[assignment]
    status: Any = "an exception"
    try:
        main()
        status = 0
    except SystemExit as e:
        status = e.code
        raise
    finally:
        (Path(os.environ[HOLD_ENV]) / f"exit-{os.environ.get('RANK', '0')}").write_text(str(status))
