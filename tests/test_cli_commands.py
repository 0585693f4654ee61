"""Every command the CLI names loads and is listed by ``dflash --help`` (a command whose module is
missing is an import error, not a command that silently disappears from the list)."""

from __future__ import annotations

import click
from click.testing import CliRunner

from dflash_offline.cli import COMMANDS, main


def test_every_command_loads_and_is_listed() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.output.split("Commands:", 1)[1].splitlines() if line.strip()]
    assert listed == list(COMMANDS)
    for name in COMMANDS:
        assert isinstance(main.get_command(click.Context(main), name), click.Command), name
