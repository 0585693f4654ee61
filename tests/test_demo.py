"""The demo's stage runner (real CLI subprocesses, timed in wall and CPU seconds) and its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from dflash_offline import demo
from dflash_offline.cli import main
from dflash_offline.demo import DemoSizes, StageTime, _run


@pytest.mark.timeout(120)
def test_stage_records_wall_and_cpu_time() -> None:
    times: list[StageTime] = []
    _run("help", ["--help"], times)
    (stage,) = times
    assert stage.command == "dflash --help"
    # A Python start-up that imports the CLI burns CPU time in the child, which RUSAGE_CHILDREN sees.
    assert stage.cpu_seconds > 0.05
    assert stage.seconds > 0


@pytest.mark.timeout(120)
def test_failed_stage_names_itself() -> None:
    times: list[StageTime] = []
    with pytest.raises(SystemExit, match="'bad'"):
        _run("bad", ["no-such-command"], times)
    assert times[0].name == "bad"


def test_every_stage_is_a_command_dflash_accepts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The demo's recipe, stage by stage, parsed by the real click commands (options, values, choices):
    a renamed option breaks here, not ten minutes into ``make demo``."""
    parsed: list[str] = []

    def parse_only(name: str, args: list[str], times: list[StageTime]) -> None:
        command = main.get_command(click.Context(main), args[0])
        assert command is not None, args
        command.make_context(args[0], args[1:])  # raises a UsageError for an unknown option or bad value
        parsed.append(args[0])
        if "--json" in args:  # run_demo reads the report the eval stage writes
            Path(args[args.index("--json") + 1]).write_text(json.dumps({"summary": {"tau": 1.0}}))

    for folder in ("cache", "run/drafter-initial", "drafter"):  # the paths the stages read must exist
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.setattr(demo, "_run", parse_only)
    demo.run_demo(tmp_path, DemoSizes())
    assert parsed == ["regenerate", "generate", "train", "export", "eval", "eval", "plot", "plot"]
