"""The demo's stage runner (real CLI subprocesses, timed in wall and CPU seconds) and its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from dflash_offline import demo
from dflash_offline.cli import main
from dflash_offline.demo import DemoSizes, StageTime, _run, compared_drafters
from dflash_offline.eval.prompts import resolve_held_out, select_prompts
from dflash_offline.target_model.loader import load_tokenizer
from dflash_offline.train.checkpoint import export_run
from dflash_offline.train.launch import run_training
from tests.train.helpers import train_config


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
            report = {"summary": {"tau": 1.0}, "prompts": [{"bench": "data", "sample_id": "a", "turn": 1}]}
            Path(args[args.index("--json") + 1]).write_text(json.dumps(report))

    for folder in ("cache", "run/drafter-initial", "run/drafter"):  # the paths the stages read must exist
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.setattr(demo, "_run", parse_only)
    demo.run_demo(tmp_path, DemoSizes())
    assert parsed == ["regenerate", "generate", "train", "export", "eval", "eval", "plot", "plot"]


def test_the_compared_drafters_are_evaluated_on_the_same_prompts(
    uncompressed_cache: Path, tmp_path: Path
) -> None:
    """The demo's two evals (``--exclude-cache`` the demo's cache, prompts from the data it was generated
    from) select the same held-out prompts for the untrained and the trained drafter: the validation split
    of their one run. The export copied out of the run (what the demo compared before) holds out the whole
    cache, so it would have been evaluated on other prompts (here: none)."""
    run = tmp_path / "run"
    run_training(train_config(uncompressed_cache, run, max_steps=2, export_initial=True, val_fraction=0.2))
    data = uncompressed_cache.parent / "chat.jsonl"
    tokenizer = load_tokenizer("random:tiny")

    def prompts(drafter: Path) -> list[str]:
        held_out = resolve_held_out(exclude_cache=uncompressed_cache, drafter_dir=drafter, data=data)
        selection = select_prompts(data, tokenizer, held_out=held_out, limit=1000, max_prompt_tokens=512)
        return [p.sample_id for p in selection.prompts]

    compared = compared_drafters(tmp_path)
    assert set(compared) == {"untrained", "trained"}
    assert all((d / "model.safetensors").is_file() for d in compared.values())
    untrained, trained = prompts(compared["untrained"]), prompts(compared["trained"])
    assert untrained == trained
    assert len(trained) >= 1
    copied = export_run(run, tmp_path / "drafter", dtype="float32", step=None, eval_report=None)
    assert prompts(copied) != trained
