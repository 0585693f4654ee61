"""``dflash train --init-from DIR``: a fresh run starts from an exported drafter's weights. Its first weights,
exported with ``--export-initial``, are the export it started from (fc through another feature scale than the
first run's: folded back, the same matrix); a drafter of another shape, or no export there, is refused with
what to change; a resume keeps its checkpoint and refuses another ``--init-from``; the path is stored
absolute in config.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.launch import run_training
from tests.train.helpers import train_config


@pytest.fixture(scope="module")
def first_run(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short run with the default per-dimension feature scale; its export is RUN/drafter."""
    run = tmp_path_factory.mktemp("first") / "run"
    run_training(train_config(tiny_cache, run, feature_scale="dim", max_steps=3, checkpoint_every=3))
    return run


def test_a_fresh_run_starts_from_the_export(
    first_run: Path, tiny_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "second"
    config = train_config(
        tiny_cache,
        run,
        feature_scale="layer",  # another scale than the first run's: fc must be unfolded by this one
        init_from=first_run / "drafter",
        export_initial=True,
        max_steps=2,
        checkpoint_every=2,
    )
    run_training(config)
    assert f"starting from the weights of {first_run / 'drafter'}" in capsys.readouterr().err
    want = load_file(str(first_run / "drafter" / "model.safetensors"))
    got = load_file(str(run / "drafter-initial" / "model.safetensors"))
    assert set(got) == set(want)
    for key, tensor in want.items():
        if key == "fc.weight":  # divided by this run's scale, multiplied back at export: rounding only
            torch.testing.assert_close(got[key], tensor, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(got[key], tensor), key
    assert not torch.equal(got["norm.weight"], torch.full_like(got["norm.weight"], 0.1))  # not the init
    # It trained from there: the last export moved away from the first weights.
    last = load_file(str(run / "drafter" / "model.safetensors"))
    assert not torch.equal(last["fc.weight"], want["fc.weight"])
    saved = json.loads((run / "config.json").read_text())
    assert saved["drafter"]["init_from"] == str((first_run / "drafter").resolve())


def test_a_relative_path_is_stored_absolute(first_run: Path, tiny_cache: Path, tmp_path: Path) -> None:
    here = os.getcwd()
    os.chdir(first_run.parent)
    try:
        config = train_config(tiny_cache, tmp_path / "run", init_from=Path("run/drafter"))
    finally:
        os.chdir(here)
    assert config.drafter.init_from == first_run / "drafter"


def test_another_shape_or_no_export_is_refused(first_run: Path, tiny_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        run_training(
            train_config(
                tiny_cache, tmp_path / "a", num_layers=2, block_size=4, init_from=first_run / "drafter"
            )
        )
    message = str(refused.value)
    assert (
        f"`DrafterTrainConfig.init_from` {first_run / 'drafter'}: that drafter differs from this run's in "
        in message
    )
    assert "num_layers 1 (this run: 2; pass `DrafterTrainConfig.num_layers`)" in message
    assert "block_size 8 (this run: 4; pass `DrafterTrainConfig.block_size`)" in message
    with pytest.raises(ConfigError, match="not a directory"):
        run_training(train_config(tiny_cache, tmp_path / "b", init_from=tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="is missing: not a drafter export directory"):
        run_training(train_config(tiny_cache, tmp_path / "c", init_from=first_run))  # the run, not its export


def test_a_resume_keeps_its_checkpoint_and_its_init_from(
    first_run: Path, tiny_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    config = train_config(tiny_cache, run, init_from=first_run / "drafter", max_steps=2, checkpoint_every=2)
    run_training(config)
    capsys.readouterr()
    run_training(config.with_options(max_steps=3))
    out = capsys.readouterr().err
    assert "resumed from the checkpoint of step 2" in out
    assert "starting from the weights" not in out
    assert [step for step, _ in list_checkpoints(run)][-1] == 3
    with pytest.raises(ResumeError, match=r"`DrafterTrainConfig\.init_from`"):
        run_training(config.with_options(init_from=None, max_steps=4))
