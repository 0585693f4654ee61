"""Spawned workers (``workers.spawned``): a worker's exception stops the run with its traceback, one that
dies without a word stops it too, a stop request ends every worker, the events a worker puts just before
its exit all arrive, and the first worker to fail is the one reported while the others are ended. A
worker's ``DflashError`` is rebuilt as itself in the coordinator (``workers.records.user_error``)."""

from __future__ import annotations

import os
import time

import pytest

from dflash_offline.errors import ConfigError, DflashError, WorkerError
from dflash_offline.workers.group import GroupPolicy, watch
from dflash_offline.workers.records import WorkerFailed, WorkerSpec, failure_of, user_error
from dflash_offline.workers.spawned import SpawnedWorkers, WorkerExit
from tests.process_helpers import workers_of
from tests.workers import entries

POLICY = GroupPolicy(
    label="test worker",
    resumable="the output",
    process_name="dflash-test",
    drain_seconds=60.0,
    finished=entries.Done,
)


def _specs(num_workers: int, task: str = "") -> list[WorkerSpec[str]]:
    return [
        WorkerSpec(worker=w, num_workers=num_workers, device="cpu", cpu_threads=1, task=task)
        for w in range(num_workers)
    ]


def _wait_until_ended() -> None:
    deadline = time.monotonic() + 60
    while workers_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workers_of(os.getpid()), "a worker process outlived its group"


@pytest.mark.timeout(120)
def test_a_workers_exception_stops_the_run_with_its_traceback_and_stop_ends_the_others() -> None:
    group = SpawnedWorkers(entries.raise_error, _specs(2, "task of worker 0"), policy=POLICY)
    events: list[object] = []
    group.start()
    try:
        with pytest.raises(WorkerError) as failed:
            watch(group, events.append)
    finally:
        group.stop()  # worker 1 waits for it
        group.drain_and_join(events.append)
    text = str(failed.value)
    assert text.startswith("test worker 0 (cpu) failed; the output is resumable. Its traceback:\n")
    assert f"RuntimeError: {entries.FAULT_TEXT} (task of worker 0)" in text
    assert "Traceback (most recent call last)" in text
    assert [type(e) for e in events] == [WorkerFailed]
    _wait_until_ended()


@pytest.mark.timeout(120)
def test_a_worker_killed_without_a_word_stops_the_run() -> None:
    group = SpawnedWorkers(entries.die_silently, _specs(3), policy=POLICY)
    events: list[object] = []
    group.start()
    try:
        with pytest.raises(WorkerError) as failed:
            watch(group, events.append)
    finally:
        group.stop()
        group.drain_and_join(events.append)
    assert str(failed.value) == (
        "test worker 1 exited with code -9 without finishing (killed, or out of memory?); "
        "the output is resumable: rerun the same command"
    )
    _wait_until_ended()


@pytest.mark.timeout(120)
def test_events_put_just_before_a_workers_exit_all_arrive() -> None:
    group = SpawnedWorkers(entries.say_and_leave, _specs(2), policy=POLICY)
    group.start()
    _wait_until_ended()  # every event is in the queue, none read yet
    events: list[object] = []
    group.drain_and_join(events.append)
    said = sorted((e.worker, e.n) for e in events if isinstance(e, entries.Said))
    assert said == [(w, n) for w in range(2) for n in range(100)]
    assert sorted(e.worker for e in events if isinstance(e, entries.Done)) == [0, 1]


@pytest.mark.timeout(120)
def test_the_first_worker_to_fail_is_reported_and_the_others_are_ended() -> None:
    group = SpawnedWorkers(entries.exit_or_wait, _specs(3), policy=POLICY)
    events: list[object] = []
    group.start()
    exited = group.wait_for_exit(events.append)
    group.terminate()  # workers 0 and 2 would wait for ten minutes
    group.drain_and_join(events.append)
    assert exited is not None
    assert (exited.worker, exited.exit_code) == (1, 3)
    assert isinstance(exited, WorkerExit)
    assert events == []
    _wait_until_ended()


class _ElsewhereError(DflashError):
    """A ``DflashError`` that ``errors.py`` does not define."""


def test_a_workers_dflash_error_is_rebuilt_as_itself() -> None:
    spec = _specs(1)[0]
    failures = []
    for error in (
        ConfigError("--lr must be > 0"),
        _ElsewhereError("no such cache"),
        RuntimeError("bug"),
    ):
        try:
            raise error
        except Exception as e:
            failures.append(failure_of(spec, e))
    rebuilt = [user_error(f) for f in failures]
    assert type(rebuilt[0]) is ConfigError
    assert str(rebuilt[0]) == "--lr must be > 0"
    assert type(rebuilt[1]) is DflashError  # its class cannot be looked up: the base class, same text
    assert str(rebuilt[1]) == "no such cache"
    assert rebuilt[2] is None  # a bug keeps its traceback (failures[2].traceback)
    assert "RuntimeError: bug" in failures[2].traceback
