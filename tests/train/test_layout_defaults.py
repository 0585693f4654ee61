"""The microbatch layout left to its default (0) is resolved by device when the config is built, so that
config.json, the resume contract and every reader see numbers, and an explicit value is never replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import read_metrics
from tests.train.helpers import train_config


def _config(tmp_path: Path, **fields: object) -> TrainConfig:
    return TrainConfig.from_options(cache_dir=tmp_path / "cache", out_dir=tmp_path / "run", **fields)


def _layout(config: TrainConfig) -> tuple[int, int, int]:
    return config.topology.grad_accum, config.data.tokens_per_microbatch, config.data.num_anchors


def test_cpu_workers_get_four_microbatches_of_8k_tokens_and_512_blocks(tmp_path: Path) -> None:
    assert _layout(_config(tmp_path)) == (4, 8192, 512)
    assert _layout(_config(tmp_path, num_cpu_workers=3)) == (4, 8192, 512)


def test_gpus_get_one_microbatch_of_32k_tokens_and_2048_blocks(tmp_path: Path) -> None:
    assert _layout(_config(tmp_path, gpus=(0,))) == (1, 32768, 2048)
    assert _layout(_config(tmp_path, gpus=(0, 1, 2, 3))) == (1, 32768, 2048)


def test_blocks_follow_the_given_tokens_and_explicit_values_stay(tmp_path: Path) -> None:
    assert _layout(_config(tmp_path, gpus=(0,), tokens_per_microbatch=16384)) == (1, 16384, 1024)
    assert _layout(_config(tmp_path, tokens_per_microbatch=100)) == (4, 100, 6)
    assert _layout(_config(tmp_path, tokens_per_microbatch=8)) == (4, 8, 1)
    assert _layout(_config(tmp_path, gpus=(0,), grad_accum=2, num_anchors=300)) == (2, 32768, 300)


def test_the_saved_config_holds_the_resolved_numbers(tmp_path: Path) -> None:
    config = _config(tmp_path, gpus=(0,))
    saved = config.to_dict()
    assert (
        saved["topology"]["grad_accum"],
        saved["data"]["tokens_per_microbatch"],
        saved["data"]["num_anchors"],
    ) == (
        1,
        32768,
        2048,
    )
    # Read back on a machine whose default would differ (no GPUs named): the run keeps its numbers.
    assert _layout(TrainConfig.from_dict({**saved, "launch": {**saved["launch"], "gpus": []}})) == (
        1,
        32768,
        2048,
    )
    assert _layout(config.with_options(gpus=())) == (1, 32768, 2048)


def test_a_one_token_microbatch_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`DataConfig\.tokens_per_microbatch` 1"):
        _config(tmp_path, tokens_per_microbatch=1)


def test_a_resume_takes_the_runs_own_layout_where_this_invocation_left_it_to_the_default(
    tiny_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A run begun with other numbers (an older default, or another kind of device) resumes with the same
    command: the fields left to the default take the run's values, said in a note; a field given explicitly
    and different is still refused by the resume contract."""
    run = tmp_path / "run"
    began = train_config(tiny_cache, run, max_steps=4, checkpoint_every=2)
    assert began.layout_by_device == ()
    run_training(began)
    # The same run, its layout left to the default (0 = the CPU workers' 4 × 8,192 × 512 here).
    resumed = began.with_options(max_steps=6, grad_accum=0, tokens_per_microbatch=0, num_anchors=0)
    assert _layout(resumed) == (4, 8192, 512)
    assert resumed.layout_by_device == ("grad_accum", "tokens_per_microbatch", "num_anchors")
    capfd.readouterr()
    run_training(resumed)
    err = capfd.readouterr().err
    assert (
        "resuming with the run's own `DataConfig.num_anchors` 32 (left to the device's default, 512 here)"
        in err
    )
    assert "resuming with the run's own `DataConfig.tokens_per_microbatch` 600" in err
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")][-1] == 6
    saved = json.loads((run / "config.json").read_text())
    assert (
        saved["topology"]["grad_accum"],
        saved["data"]["tokens_per_microbatch"],
        saved["data"]["num_anchors"],
    ) == (
        1,
        600,
        32,
    )
    # Given explicitly, another value is a change the contract refuses.
    with pytest.raises(ResumeError, match=r"`DataConfig\.num_anchors`"):
        run_training(began.with_options(max_steps=8, num_anchors=16))
