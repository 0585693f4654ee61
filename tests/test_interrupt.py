"""Ctrl-C before a command's stop-checking loop (dflash_offline/interrupt.py): a KeyboardInterrupt that
Python drops, because it was raised inside a finalizer, still stops the command when its loop starts."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from dflash_offline import interrupt
from dflash_offline.cli.interrupts import ctrl_c_exits_130


class _SigintInFinalizer:
    """Sends SIGINT to this process from ``__del__`` and stays there until Python has run the handler."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # the handler runs between these bytecodes, inside the finalizer
            pass


@pytest.fixture
def sigint_handler_restored() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)
    interrupt.forget_sigint()


def _lose_a_keyboard_interrupt(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A SIGINT whose KeyboardInterrupt lands in a finalizer: Python reports it to sys.unraisablehook
    and goes on. Returns what the hook saw (the precondition of the tests)."""
    dropped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    obj = _SigintInFinalizer()
    del obj  # CPython finalizes at once (reference count 0)
    return dropped


def test_a_sigint_dropped_in_a_finalizer_stops_the_loop_that_starts_next(
    sigint_handler_restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    interrupt.take_sigint()
    dropped = _lose_a_keyboard_interrupt(monkeypatch)
    assert dropped == [KeyboardInterrupt]  # lost: the code after the finalizer runs on
    with pytest.raises(KeyboardInterrupt), interrupt.stop_on_sigint("stopping"):
        pytest.fail("the loop started although Ctrl-C came before it")


def test_without_a_sigint_the_loop_runs_and_its_first_sigint_only_asks_for_a_stop(
    sigint_handler_restored: None,
) -> None:
    interrupt.take_sigint()
    with interrupt.stop_on_sigint("stopping"):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):
            pass
        assert interrupt.stop_requested()


def test_a_command_that_ended_leaves_no_sigint_to_the_next_one_in_the_process(
    sigint_handler_restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    @ctrl_c_exits_130("interrupted")
    def command() -> None:
        assert _lose_a_keyboard_interrupt(monkeypatch) == [KeyboardInterrupt]

    command()  # the dropped SIGINT is not raised again after the command
    with interrupt.stop_on_sigint("stopping"):  # a later loop in the same process starts
        assert not interrupt.stop_requested()
