"""The option table of every ``dflash`` command (flags, defaults, types, help), for the snapshot test.

Regenerate after a deliberate CLI change with
``PYTHONPATH=. python -m tests.cli._help_snapshot > tests/cli/help_snapshot.json``."""

from __future__ import annotations

import json
from typing import Any

import click

from dflash_offline.cli import COMMANDS, LazyGroup


def describe_command(command: click.Command) -> list[dict[str, Any]]:
    """One entry per parameter, in --help order, with what a user sees of it."""
    rows = []
    for p in command.params:
        row: dict[str, Any] = {
            "opts": list(p.opts) + list(p.secondary_opts),
            "kind": type(p).__name__,
            "type": p.type.to_info_dict(),
            "default": repr(p.default),
            "required": p.required,
            "nargs": p.nargs,
        }
        if isinstance(p, click.Option):
            row.update(help=p.help, show_default=p.show_default, is_flag=p.is_flag, metavar=p.metavar)
        rows.append(row)
    return rows


def snapshot() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in COMMANDS:
        command = LazyGroup._load(name)
        assert command is not None
        out[name] = {"help": command.help, "params": describe_command(command)}
    return out


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1, ensure_ascii=False, sort_keys=True))
