"""The demo's stage runner: real CLI subprocesses, timed in wall and CPU seconds."""

from __future__ import annotations

import pytest

from dflash_offline.demo import StageTime, _run


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
