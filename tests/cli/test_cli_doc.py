"""docs/cli.md is every command's current ``--help`` (tests/cli/_cli_doc.py writes it)."""

from __future__ import annotations

import difflib
import subprocess
import sys

from tests.cli._cli_doc import CLI_DOC, render_fresh


def test_cli_doc_is_the_commands_current_help() -> None:
    expected = render_fresh()
    actual = CLI_DOC.read_text(encoding="utf-8") if CLI_DOC.is_file() else ""
    if actual != expected:
        diff = "".join(
            list(
                difflib.unified_diff(
                    actual.splitlines(keepends=True),
                    expected.splitlines(keepends=True),
                    "docs/cli.md",
                    "--help",
                )
            )[:40]
        )
        raise AssertionError(
            "docs/cli.md differs from the commands' --help; regenerate it with "
            f"`PYTHONPATH=. python -m tests.cli._cli_doc`:\n{diff}"
        )


def test_the_reference_holds_each_commands_help_as_the_cli_prints_it() -> None:
    """An independent reading: ``dflash train --help`` run as a user runs it, at the doc's width."""
    out = subprocess.run(
        [sys.executable, "-m", "dflash_offline", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "100", "PATH": "", "PYTHONPATH": str(CLI_DOC.parents[1])},
    ).stdout
    section = render_fresh().split("## dflash train\n\n```\n", 1)[1].split("\n```", 1)[0]
    assert section.replace("Usage: dflash train", "Usage: python -m dflash_offline train") == out.rstrip()
