"""docs/cli.md, the option reference: every ``dflash`` command's ``--help``, as a user's terminal shows it.

Regenerate after a CLI change with ``PYTHONPATH=. python -m tests.cli._cli_doc`` (it rewrites docs/cli.md);
tests/cli/test_cli_doc.py fails while the file differs from the commands' current help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from dflash_offline.cli import COMMANDS, LazyGroup, main

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
WIDTH = 78
"""The help's line width: what click prints at a terminal of 80 columns or more (its maximum less 2), fixed
so that the file does not depend on the terminal that wrote it."""

HEADER = """# Command reference

Every `dflash` command's `--help`, generated from the commands themselves (`PYTHONPATH=. python -m
tests.cli._cli_doc` rewrites this file; a test fails while it differs). The README has the overview.
"""


def _context(command: click.Command, name: str, parent: click.Context | None = None) -> click.Context:
    settings = {**command.context_settings, "terminal_width": WIDTH}
    return click.Context(command, info_name=name, parent=parent, **settings)


def _help(command: click.Command, name: str, parent: click.Context | None = None) -> str:
    return command.get_help(_context(command, name, parent)).rstrip()


def render() -> str:
    """The whole of docs/cli.md: the group's help, then one section per command in --help order."""
    root = _context(main, "dflash")
    parts = [HEADER, "```\n" + _help(main, "dflash") + "\n```\n"]
    for name in COMMANDS:
        command = LazyGroup._load(name)
        assert command is not None
        parts.append(f"## dflash {name}\n\n```\n{_help(command, name, root)}\n```\n")
    return "\n".join(parts)


def render_fresh() -> str:
    """``render()`` in a new interpreter: click caches each command's help option on the command, so a
    process that built contexts of its own (a test run) may print another help option list."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.cli._cli_doc", "--print"],
        capture_output=True,
        text=True,
        check=True,
        cwd=CLI_DOC.parents[1],
    )
    return out.stdout


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        sys.stdout.write(render())
    else:
        CLI_DOC.write_text(render(), encoding="utf-8")
        print(f"wrote {CLI_DOC}")
