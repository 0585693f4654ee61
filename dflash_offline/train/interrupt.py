"""Ctrl-C during ``dflash train``: finish the step, write a checkpoint, exit 130 (as ``generate`` does).

SIGINT only sets a flag; the loop reads it at each step boundary (all ranks agree through one tiny
all-reduce, so every rank stops after the same step) and raises ``TrainInterrupted`` once the
checkpoint is on disk. In one process a second Ctrl-C aborts at once; spawned DDP workers keep the
flag idempotent, since a terminal's Ctrl-C reaches them and the parent forwards it again.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

_stop = threading.Event()
_depth = 0


class TrainInterrupted(Exception):  # noqa: N818 (not an error: the user asked for it)
    """Training stopped on request after ``step`` with a checkpoint of that step on disk."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"interrupted after step {step}: checkpoint written; rerun the same command to resume"
        )


def stop_requested() -> bool:
    return _stop.is_set()


@contextlib.contextmanager
def stop_on_sigint(*, second_aborts: bool) -> Iterator[None]:
    """Turn SIGINT into a stop request for the duration (main thread only; nests)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        _stop.clear()
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: FrameType | None) -> None:
        if _stop.is_set():
            if second_aborts:
                raise KeyboardInterrupt
            return
        _stop.set()
        print(
            "dflash train: stopping after this step (a checkpoint is written first)"
            + ("; Ctrl-C again to abort without it" if second_aborts else ""),
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGINT, handler)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signal.signal(signal.SIGINT, previous)
        if _depth == 0:
            _stop.clear()
