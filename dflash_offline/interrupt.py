"""Ctrl-C in the long commands (generate, regenerate, train, eval): the first asks for a stop, the second
aborts.

A process started in the background by a script (``cmd &`` in a non-interactive shell) inherits SIGINT
as ignored, and Python then installs no KeyboardInterrupt handler: such a run never reacted to Ctrl-C or
``kill -INT``. So every long command installs its handler explicitly (``take_sigint``), whatever it
inherited:

  - outside a stop-checking loop (imports, loading the target): SIGINT raises KeyboardInterrupt. Python
    reports and drops an exception raised inside a finalizer (``__del__``, a weakref callback), so a
    KeyboardInterrupt that lands there is lost and loading goes on; the handler also records the SIGINT,
    and entering ``stop_on_sigint`` raises it again (``_sigint_seen``);
  - inside ``stop_on_sigint``: the first SIGINT only sets a flag, which the command's loop reads between
    steps (a decode step, a generate job, a train step) before it stops cleanly, keeping everything
    finished, and raises ``StopRequested``; the second raises KeyboardInterrupt at once, and restores
    the default action, so that a third kills the process.

The CLI turns both into exit status ``EXIT_INTERRUPTED`` with one line (``cli/interrupts.py``).
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Generic, TypeVar

T = TypeVar("T")

EXIT_INTERRUPTED = 130
"""Exit status of a command stopped by Ctrl-C (128 + SIGINT, what a shell reports)."""

INTERRUPT_GRACE_S = 10.0
"""How long ``wait_interruptibly`` waits for interrupted work to return before the interrupt goes on
without it (the work's thread is a daemon: the process exit ends it)."""

_stop = threading.Event()
_depth = 0
_sigint_seen = threading.Event()
"""Set by a SIGINT outside ``stop_on_sigint``: the KeyboardInterrupt it raised may have been lost."""


class StopRequested(KeyboardInterrupt):
    """A loop saw the first Ctrl-C and stopped cleanly (a KeyboardInterrupt: every cleanup path that
    handles one handles it)."""


def take_sigint() -> None:
    """SIGINT raises KeyboardInterrupt in this process, even when it was started with SIGINT ignored
    (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        _sigint_seen.clear()
        signal.signal(signal.SIGINT, _raise_keyboard_interrupt)


def forget_sigint() -> None:
    """The command has ended: a SIGINT it saw is not carried into the next one run in this process."""
    _sigint_seen.clear()


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    """``signal.default_int_handler``, remembering the SIGINT for ``stop_on_sigint``."""
    _sigint_seen.set()
    raise KeyboardInterrupt


def skip_exit_collection() -> None:
    """Leave the objects alive now out of the garbage collection that interpreter shutdown runs: with
    torch and transformers loaded it walks millions of objects (6 s of a stopped regenerate's 6.2 s
    from Ctrl-C to exit on a 2-core machine) to free memory the exit returns anyway."""
    gc.freeze()


def stop_requested() -> bool:
    return _stop.is_set()


@contextlib.contextmanager
def stop_on_sigint(
    announce: str, *, second_aborts: bool = True, abort_note: str = "abort at once"
) -> Iterator[None]:
    """Turn SIGINT into a stop request for the duration (main thread only; nests).

    ``announce``: the line printed at the first Ctrl-C (what the command does now), followed by
    "; Ctrl-C again to <abort_note>". ``second_aborts``: a second Ctrl-C raises KeyboardInterrupt (False
    where a parent forwards the terminal's Ctrl-C again, as to train's spawned ranks)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _sigint_seen.is_set():
        # A Ctrl-C came before the loop and its KeyboardInterrupt did not end the command: it was raised
        # inside a finalizer, which Python reports ("Exception ignored in ...") and drops.
        raise KeyboardInterrupt
    if _depth == 0:
        _stop.clear()
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: FrameType | None) -> None:
        if _stop.is_set():
            if second_aborts:
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # a third Ctrl-C kills, whatever runs now
                raise KeyboardInterrupt
            return
        _stop.set()
        print(
            announce + (f"; Ctrl-C again to {abort_note}" if second_aborts else ""),
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


@dataclass(frozen=True, kw_only=True, slots=True)
class _Outcome(Generic[T]):
    """What ``wait_interruptibly``'s work thread hands back: its value, or the exception it raised."""

    value: T | None = None
    error: BaseException | None = None


def wait_interruptibly(work: Callable[[], T], *, interrupt: Callable[[], None], name: str) -> T:
    """``work()``, run on a thread while the calling (main) thread waits in short slices.

    Native code that holds the main thread (a DuckDB query) looks at signals late or never, and Python
    runs a SIGINT handler only between bytecodes of the main thread: a Ctrl-C (or ``kill -INT``) would
    wait for the query to end. Here the main thread only waits, so KeyboardInterrupt comes at once; it
    then calls ``interrupt`` (which must make ``work`` return soon, e.g. DuckDB's
    ``connection.interrupt()``; it is called until the work returns, at most ``INTERRUPT_GRACE_S``), and
    re-raises. An exception
    of ``work`` is re-raised here, never lost with its thread."""
    outcomes: list[_Outcome[T]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcomes.append(_Outcome(value=work()))
        except BaseException as e:  # carried to the caller
            outcomes.append(_Outcome(error=e))
        finally:
            done.set()

    # Waiting on an Event, not Thread.join: a KeyboardInterrupt inside join makes Python 3.11 mark the
    # thread finished while it still runs (``_wait_for_tstate_lock`` releases the lock the thread holds),
    # and the process then exits under a query still running in native code, which aborts.
    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        while not done.wait(0.05):
            pass
    except KeyboardInterrupt:
        # Again and again: an interrupt that comes between two statements of ``work`` misses the second.
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while not done.is_set() and time.monotonic() < deadline:
            interrupt()
            done.wait(0.05)
        raise
    outcome = outcomes[0]
    if outcome.error is not None:
        raise outcome.error
    return outcome.value  # type: ignore[return-value]
