"""The README's Quick start as data: its fenced block, split into the setup lines and the ``dflash``
commands, so that tests parse and run exactly what a newcomer types."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
HEADING = "## Quick start"
SETUP_LINES = ("make setup", ". .venv/bin/activate")
"""The lines that set up the environment; the tests run in the environment already set up."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuickStart:
    setup: tuple[str, ...]
    """The non-``dflash`` lines, comments stripped."""
    commands: tuple[tuple[str, ...], ...]
    """Each ``dflash`` command's arguments after ``dflash`` (``a && b`` is two commands), in order."""


def read_quick_start(readme: Path = README) -> QuickStart:
    text = readme.read_text(encoding="utf-8")
    start = text.index(HEADING)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.DOTALL)
    if block is None:
        raise ValueError(f"{readme}: no ```bash block under {HEADING!r}")
    setup: list[str] = []
    commands: list[tuple[str, ...]] = []
    # A line ending in a backslash continues on the next, as in the shell.
    for line in block.group(1).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "dflash":
            setup.append(shlex.join(words))
            continue
        current: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                if not current or current[0] != "dflash":
                    raise ValueError(f"{readme}: not a dflash command in {line!r}")
                commands.append(tuple(current[1:]))
                current = []
            else:
                current.append(word)
    return QuickStart(setup=tuple(setup), commands=tuple(commands))
