"""Ctrl-C in a long command: its SIGINT handler is installed whatever the process inherited, and an
interrupted run exits 130 with one line (click alone would print ``Aborted!`` and exit 1)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from dflash_offline.interrupt import EXIT_INTERRUPTED, forget_sigint, skip_exit_collection, take_sigint


def ctrl_c_exits_130(message: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command: take SIGINT first (a run started by a script as ``cmd &`` inherits it
    ignored), and turn a KeyboardInterrupt (a first Ctrl-C that stopped the loop cleanly, or a second
    one) into ``message`` on stderr and exit status 130."""

    def decorate(f: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            take_sigint()
            try:
                f(*args, **kwargs)
            except KeyboardInterrupt:
                click.echo(message, err=True)
                skip_exit_collection()
                raise SystemExit(EXIT_INTERRUPTED) from None
            finally:
                forget_sigint()

        return wrapper

    return decorate
