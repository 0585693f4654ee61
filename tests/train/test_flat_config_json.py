"""A run whose ``RUN/config.json`` is one flat object, as dflash-offline wrote it before the config was
nested by section (format 1), still reads as the same config, resumes and exports; a run written now holds
the sections (format 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash_offline.errors import ConfigError
from dflash_offline.train.checkpoint import export_run, list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.launch import run_training
from dflash_offline.train.resume_contract import ResumeContract
from tests.train.helpers import assert_export_equals_checkpoint, train_config

FLAT_CONFIG_JSON: dict[str, Any] = {
    "cache_dir": "CACHE", "out_dir": "RUN", "target": None, "num_layers": 1, "block_size": 8,
    "num_anchors": 32, "gamma": None, "mask_token_id": None, "feature_scale": "dim", "final_norm_init": 0.1,
    "init_from": None, "autocast": "auto", "optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0,
    "warmup_ratio": 0.04, "grad_clip": 1.0, "epochs": 100, "max_steps": 2, "grad_accum": 1,
    "tokens_per_microbatch": 600, "fuse_microbatches": False, "prefetch": 2, "loader_threads": 2, "seed": 0,
    "deterministic": True, "checkpoint_every": 4, "keep_checkpoints": 2, "resume": "auto",
    "allow_topology_change": False, "attention": "auto", "export_initial": False, "log_every": 1,
    "val_fraction": 0.02, "val_samples": None, "val_group": "sample", "train_samples": None, "val_every": 200,
    "val_chain_tokens": 256, "early_stop": None, "compile": "auto", "tensorboard_dir": None,
    "tensorboard": True, "on_damaged": "stop", "follow": False, "passes": 2, "export_at_end": True,
    "layout_by_device": [], "gpus": [], "num_cpu_workers": 1, "threads_per_worker": 1, "progress": False,
}  # fmt: skip
"""``to_dict()`` of ``train_config(CACHE, RUN, max_steps=2, optimizer="sgd", lr=0.05)`` by the flat
``TrainConfig`` (format 1), verbatim but for the paths: what such a run left in RUN/config.json."""


def as_written_before(cache: Path, run: Path) -> dict[str, Any]:
    return {**FLAT_CONFIG_JSON, "cache_dir": str(cache), "out_dir": str(run)}


def test_a_flat_config_json_reads_as_the_nested_config(tmp_path: Path) -> None:
    cache, run = tmp_path / "cache", tmp_path / "run"
    config = TrainConfig.from_dict(as_written_before(cache, run))
    assert config == train_config(cache, run, max_steps=2, algorithm="sgd", lr=0.05)
    assert (config.optimizer.algorithm, config.optimizer.lr, config.data.tokens_per_microbatch) == (
        "sgd",
        0.05,
        600,
    )
    assert config.to_dict()["version"] == 2
    assert config.to_dict()["optimizer"]["algorithm"] == "sgd"  # by section now
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_an_older_flat_config_json_reads_with_what_its_missing_options_meant(tmp_path: Path) -> None:
    """Before --feature-scale, --final-norm-init, --init-from, --train-samples and --follow, and while
    --compile was a flag (true/false): those runs trained unscaled, from a final norm of 1.0, at random."""
    older = as_written_before(tmp_path / "cache", tmp_path / "run")
    for name in ("feature_scale", "final_norm_init", "init_from", "train_samples", "follow", "passes"):
        del older[name]
    older["compile"] = True
    config = TrainConfig.from_dict(older)
    assert config.drafter.feature_scale == "none"
    assert config.drafter.final_norm_init == 1.0
    assert config.drafter.init_from is None
    assert config.data.train_samples is None
    assert (config.window.follow, config.window.passes) == (False, 2)
    assert config.launch.compile == "on"


def test_a_config_json_of_an_unknown_format_or_option_is_refused(tmp_path: Path) -> None:
    config = train_config(tmp_path / "cache", tmp_path / "run")
    with pytest.raises(ConfigError, match=r"format version 3; this dflash-offline reads 1 and 2"):
        TrainConfig.from_dict({**config.to_dict(), "version": 3})
    with pytest.raises(ConfigError, match=r"unknown fields \['new_option'\]"):
        TrainConfig.from_dict({**as_written_before(tmp_path / "cache", tmp_path / "run"), "new_option": 1})
    nested = config.to_dict()
    nested["drafter"]["new_option"] = 1
    with pytest.raises(ConfigError, match=r"unknown fields \['new_option'\]"):
        TrainConfig.from_dict(nested)


def test_a_run_with_a_flat_config_json_resumes_and_exports(tiny_cache: Path, tmp_path: Path) -> None:
    cache, run = tiny_cache, tmp_path / "run"
    config = train_config(cache, run, max_steps=2, algorithm="sgd", lr=0.05)
    run_training(config)
    assert json.loads((run / "config.json").read_text())["version"] == 2
    (run / "config.json").write_text(json.dumps(as_written_before(cache, run), indent=2))  # as before
    step, path = list_checkpoints(run)[-1]
    assert step == 2
    stored = ResumeContract.stored(run, torch.load(path / "state.pt", weights_only=False)["planner"])
    assert stored.options is not None
    assert stored.options["algorithm"] == "sgd"
    assert stored.options["num_layers"] == 1

    exported = export_run(run, tmp_path / "export", dtype="float32")
    model = torch.load(path / "state.pt", map_location="cpu", weights_only=False)["model"]
    assert_export_equals_checkpoint(load_file(str(exported / "model.safetensors")), model)

    result = run_training(config.with_options(max_steps=3))  # resumes from step 2: nothing refused
    assert result is not None
    assert result.global_step == 3
    assert [s for s, _ in list_checkpoints(run)][-1] == 3
    assert TrainConfig.from_dict(json.loads((run / "config.json").read_text())) == config.with_options(
        max_steps=3
    )
