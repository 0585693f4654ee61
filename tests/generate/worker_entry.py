"""Test-only worker entry points: the production worker with its capture step wrapped. Spawned workers
import this module by name (the wrappers must live in a module, not in a test function), so a test
reaches into the worker process without any hook in production code."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from dflash_offline.generate import worker
from dflash_offline.generate.channel import JobChannel
from dflash_offline.workers.records import WorkerSpec

FAULT_AFTER_JOBS = 2
BARRIER_ENV = "DFLASH_TEST_BARRIER_DIR"
"""Read by ``run_worker_after_all_ready`` only (set by the test, inherited by spawned workers)."""


def _wrap_capture(wrapper: Any) -> None:
    real = worker.capture_job
    worker.capture_job = lambda *args, **kwargs: wrapper(real, *args, **kwargs)  # this process only


def run_faulty_worker(
    spec: WorkerSpec[worker.CaptureTask], events: Any, stop: Any, channel: JobChannel
) -> None:
    """``worker.run_worker`` whose ``capture_job`` raises once this process has captured 2 jobs."""
    jobs_done = 0

    def capture_job(real: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal jobs_done
        if jobs_done >= FAULT_AFTER_JOBS:
            raise RuntimeError(f"injected fault after {jobs_done} jobs (tests/generate/worker_entry.py)")
        jobs_done += 1
        return real(*args, **kwargs)

    _wrap_capture(capture_job)
    worker.run_worker(spec, events, stop, channel)


def run_worker_after_all_ready(
    spec: WorkerSpec[worker.CaptureTask], events: Any, stop: Any, channel: JobChannel
) -> None:
    """``worker.run_worker`` that holds its first job until every worker holds one (a file per worker
    in ``$DFLASH_TEST_BARRIER_DIR``, whose ``expected`` file says how many), so that each takes a job
    however fast the others start."""
    barrier = Path(os.environ[BARRIER_ENV])
    expected = int((barrier / "expected").read_text())
    waited = False

    def capture_job(real: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal waited
        if not waited:
            (barrier / f"w{spec.worker}").touch()
            deadline = time.monotonic() + 120
            while len(list(barrier.glob("w*"))) < expected:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the other workers never took a job ({barrier})")
                time.sleep(0.05)
            waited = True
        return real(*args, **kwargs)

    _wrap_capture(capture_job)
    worker.run_worker(spec, events, stop, channel)


LOAD_DELAY_SECONDS = 2.0


def run_worker_slow_to_load(
    spec: WorkerSpec[worker.CaptureTask], events: Any, stop: Any, channel: JobChannel
) -> None:
    """``worker.run_worker`` whose target takes ``LOAD_DELAY_SECONDS`` longer to build: a start-up that
    the run's summary must tell apart from its capture rate."""
    real = worker.build_capture

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        time.sleep(LOAD_DELAY_SECONDS)
        return real(*args, **kwargs)

    worker.build_capture = slow_build  # this process only
    worker.run_worker(spec, events, stop, channel)


NONFINITE_ENV = "DFLASH_TEST_NONFINITE_DIR"
"""Read by ``run_worker_with_nonfinite_features`` (set by the test, inherited by spawned workers)."""


def run_worker_with_nonfinite_features(
    spec: WorkerSpec[worker.CaptureTask], events: Any, stop: Any, channel: JobChannel
) -> None:
    """``worker.run_worker`` whose target, on the first job of at least 3 samples of different lengths
    (sorted by length: the first one is padded), puts NaNs in the first sample's padding (not its
    features: it must be stored), a NaN in the second sample's first token and an Inf in the last
    sample's last token. The sample ids go to ``$DFLASH_TEST_NONFINITE_DIR/w<worker>.json``:
    ``{"nonfinite": [second, last], "padding": first}``."""
    out = Path(os.environ[NONFINITE_ENV])
    done = False

    def capture_job(real: Any, capture: Any, job: Any, **kwargs: Any) -> Any:
        nonlocal done
        lengths = [s.num_tokens for s in job.samples]
        if done or len(lengths) < 3 or lengths[0] == job.padded_length:
            return real(capture, job, **kwargs)
        done = True
        last = len(lengths) - 1

        def poisoned(ids_BS: Any, mask_BS: Any) -> Any:
            features_BSF = capture(ids_BS, mask_BS).clone()
            features_BSF[0, lengths[0] :] = math.nan
            features_BSF[1, 0, 0] = math.nan
            features_BSF[last, lengths[last] - 1, -1] = math.inf
            return features_BSF

        ids = {
            "nonfinite": [job.samples[1].sample_id, job.samples[last].sample_id],
            "padding": job.samples[0].sample_id,
        }
        (out / f"w{spec.worker}.json").write_text(json.dumps(ids))
        return real(poisoned, job, **kwargs)

    _wrap_capture(capture_job)
    worker.run_worker(spec, events, stop, channel)


HOLD_ENV = "DFLASH_TEST_HOLD_DIR"
"""Read by ``run_worker_held_after_first_job`` (set by the test, inherited by spawned workers)."""


def run_worker_held_after_first_job(
    spec: WorkerSpec[worker.CaptureTask], events: Any, stop: Any, channel: JobChannel
) -> None:
    """``worker.run_worker`` that, once it has captured its first job, says so with a file
    ``w<worker>`` in ``$DFLASH_TEST_HOLD_DIR`` and holds that job until the run asks its workers to stop
    (Ctrl-C) or 10 minutes pass: a test can interrupt or kill the run while every worker is mid-run with
    data written, however fast the machine."""
    held = Path(os.environ[HOLD_ENV])

    def capture_job(real: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if not (held / f"w{spec.worker}").exists():
            (held / f"w{spec.worker}").touch()
            stop.wait(timeout=600)
        return result

    _wrap_capture(capture_job)
    worker.run_worker(spec, events, stop, channel)


def held_cmd(cmd: list[str], held: Path) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that run a ``python -m dflash_offline ...`` command line with every worker
    held after its first job (``run_worker_held_after_first_job``; ``held`` receives their files)."""
    assert cmd[1:3] == ["-m", "dflash_offline"], cmd
    return [cmd[0], "-m", "tests.generate.worker_entry", *cmd[3:]], {**os.environ, HOLD_ENV: str(held)}


def wait_until_held(held: Path, workers: int, process: Any) -> None:
    """Until ``workers`` workers hold their first job (or the run ends: the assertion says so)."""
    deadline = time.monotonic() + 300
    while len(list(held.glob("w*"))) < workers and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(held.glob("w*"))) == workers, "the workers did not each capture a job"


if __name__ == "__main__":
    # `python -m tests.generate.worker_entry generate ARGS...`: the CLI with held workers (above).
    import sys

    from dflash_offline.cli import main
    from dflash_offline.generate import run

    run.run_worker = run_worker_held_after_first_job  # type: ignore[assignment]
    sys.exit(main())
