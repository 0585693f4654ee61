"""``--compile auto|on|off`` (train/config.py): auto compiles the drafter's layers on CUDA only and not
under ``--deterministic`` (``train/prepare.py:compiles``, checked against the rule written out here); a run
honours it; a ``compile: true``/``false`` written into config.json before the option took three values
still exports and resumes; a bool given in code is refused, not read as "off"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
import torch

from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError
from dflash_offline.train.checkpoint import export_run, list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.launch import run_training
from dflash_offline.train.prepare import compiles
from tests.train.helpers import flat_config_json, train_config

# (--compile, device, --deterministic, compiles?): the rule as the option's help states it.
RULE = [
    ("auto", "cuda", False, True),
    ("auto", "cuda:1", False, True),
    ("auto", "cuda", True, False),
    ("auto", "cpu", False, False),
    ("auto", "cpu", True, False),
    ("on", "cpu", False, True),
    ("on", "cpu", True, True),
    ("on", "cuda", True, True),
    ("off", "cuda", False, False),
    ("off", "cpu", False, False),
]


@pytest.mark.parametrize(("option", "device", "deterministic", "expected"), RULE)
def test_compile_resolves_as_its_help_says(
    tmp_path: Path, option: Literal["auto", "on", "off"], device: str, deterministic: bool, expected: bool
) -> None:
    config = TrainConfig.from_options(
        cache_dir=tmp_path / "c", out_dir=tmp_path / "run", compile=option, deterministic=deterministic
    )
    assert compiles(config, torch.device(device)) is expected


def test_the_default_is_auto(tmp_path: Path) -> None:
    assert (
        TrainConfig.from_options(cache_dir=tmp_path / "c", out_dir=tmp_path / "run").launch.compile == "auto"
    )


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_in_code_is_refused_naming_the_choices(tmp_path: Path, value: bool) -> None:
    with pytest.raises(ConfigError, match=rf"`LaunchConfig\.compile` {value}: expected auto, on or off"):
        TrainConfig.from_options(cache_dir=tmp_path / "c", out_dir=tmp_path / "run", compile=value)


def test_an_old_run_directory_exports_and_resumes_and_the_run_honours_the_option(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run (on the CPU, not deterministic) does not compile under auto; its config.json is then
    rewritten as a run of the older flag wrote it (``"compile": true``); ``dflash export`` reads it, and a
    resume with ``--compile on`` continues the run, compiling the drafter once."""
    calls: list[str] = []
    monkeypatch.setattr(DFlashDrafter, "compile_training", lambda self, **kw: calls.append("compile"))
    run = tmp_path / "run"
    config = train_config(tiny_cache, run, max_steps=2, checkpoint_every=2, deterministic=False)
    assert config.launch.compile == "auto"
    run_training(config)
    assert calls == []  # auto on the CPU: eager
    saved = json.loads((run / "config.json").read_text())
    assert saved["launch"]["compile"] == "auto"
    for old in (True, False):
        (run / "config.json").write_text(json.dumps({**flat_config_json(saved), "compile": old}))
        assert TrainConfig.from_dict(json.loads((run / "config.json").read_text())).launch.compile == (
            "on" if old else "off"
        )
        export_run(run, tmp_path / f"export-{old}", dtype="float32")
        assert (tmp_path / f"export-{old}" / "model.safetensors").is_file()
    capsys.readouterr()
    run_training(config.with_options(max_steps=3, compile="on"))  # config.json says false
    assert "resuming with `OptimizerConfig.max_steps` 3 (the previous run used 2)" in capsys.readouterr().err
    assert [step for step, _ in list_checkpoints(run)] == [2, 3]
    assert calls == ["compile"]
    assert json.loads((run / "config.json").read_text())["launch"]["compile"] == "on"
