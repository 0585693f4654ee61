"""Ctrl-C during ``dflash train``: finish the step, write a checkpoint, exit 130 (as ``generate`` does).

SIGINT only sets a flag (``dflash_offline.interrupt``); the loop reads it at each step boundary (all
ranks agree through one tiny all-reduce, so every rank stops after the same step) and raises
``TrainInterrupted`` once the checkpoint is on disk. In one process a second Ctrl-C aborts at once;
spawned DDP workers keep the flag idempotent, since a terminal's Ctrl-C reaches them and the parent
forwards it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dflash_offline import interrupt
from dflash_offline.interrupt import stop_requested

__all__ = ["TrainInterrupted", "stop_on_sigint", "stop_requested"]


class TrainInterrupted(Exception):  # noqa: N818 (not an error: the user asked for it)
    """Training stopped on request after ``step`` with a checkpoint of that step on disk."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"interrupted after step {step}: checkpoint written; rerun the same command to resume"
        )


@contextlib.contextmanager
def stop_on_sigint(*, second_aborts: bool) -> Iterator[None]:
    """Turn SIGINT into a stop request at the next step boundary for the duration (main thread only)."""
    with interrupt.stop_on_sigint(
        "dflash train: stopping after this step (a checkpoint is written first)",
        second_aborts=second_aborts,
        abort_note="abort without it",
    ):
        yield
