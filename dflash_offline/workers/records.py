"""What every worker is given and what its failure sends back, whatever the command.

``WorkerSpec`` is one worker of a group: its index, its device and its command's task (pickled to a
spawned process). ``WorkerFailed`` is an exception raised in a worker, carried with its traceback to the
coordinator, which stops the run with it (``group.GroupPolicy.failed_error``); a ``DflashError`` is rebuilt
there as itself (``user_error``), so it still reads as one line.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from dflash_offline import errors as errors_module
from dflash_offline.errors import DflashError, find_no_space

TaskT = TypeVar("TaskT")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSpec(Generic[TaskT]):
    """One worker of a group (pickled to a spawned process)."""

    worker: int
    """Index in the group, 0 .. num_workers - 1 (generate's shard group ``w<worker>``, regenerate's part
    ``w<worker>.jsonl``, train's rank)."""
    num_workers: int
    device: str
    """``cpu``, ``cuda`` or ``cuda:N``."""
    cpu_threads: int | None
    """torch intra-op threads (CPU workers share the machine's cores); None: torch's default."""
    task: TaskT
    """What the command's worker does: ``CaptureTask`` (generate), ``AnswerTask`` (regenerate),
    ``RankTask`` (train)."""


class EventSink(Protocol):
    """Where a worker puts its event records: a multiprocessing queue, a thread's queue, a torchrun store."""

    def put(self, event: object) -> None: ...


class StopFlag(Protocol):
    """The coordinator's request that its workers stop after their current step."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFailed:
    """A worker raised: its last event (the coordinator stops the run with it)."""

    worker: int
    device: str
    error_type: str
    """The exception's class name."""
    message: str
    """The exception's text (``str(error)``)."""
    traceback: str
    """The worker's formatted traceback."""
    is_dflash_error: bool
    """The exception was a ``DflashError`` (the user's to fix): ``user_error`` rebuilds it."""
    no_space: bool
    """The disk filled up (``errors.find_no_space``): reported in one line, without the traceback."""


def failure_of(spec: WorkerSpec[Any], error: BaseException) -> WorkerFailed:
    """The record of ``error``; call it in the ``except`` block that caught it (the record carries the
    traceback being handled)."""
    return WorkerFailed(
        worker=spec.worker,
        device=spec.device,
        error_type=type(error).__name__,
        message=str(error),
        traceback=traceback.format_exc(),
        is_dflash_error=isinstance(error, DflashError),
        no_space=find_no_space(error) is not None,
    )


@contextlib.contextmanager
def failure_reported(spec: WorkerSpec[Any], events: EventSink) -> Iterator[None]:
    """Put the ``WorkerFailed`` record of any exception on ``events``, then let the exception go on."""
    try:
        yield
    except BaseException as e:
        events.put(failure_of(spec, e))
        raise


def user_error(failed: WorkerFailed) -> DflashError | None:
    """The ``DflashError`` a worker raised, rebuilt (as its class when ``errors.py`` defines it, else as
    ``DflashError``) with its message; None for any other failure."""
    if not failed.is_dflash_error:
        return None
    cls = getattr(errors_module, failed.error_type, DflashError)
    if not (isinstance(cls, type) and issubclass(cls, DflashError)):
        cls = DflashError
    error = cls.__new__(cls)
    DflashError.__init__(error, failed.message)
    return error
