"""Export a training run's drafter (from a checkpoint) in z-lab's DFlash layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_offline.cache.layout import read_fingerprint
from dflash_offline.errors import ResumeError
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.model_setup import build_drafter_setup


def export_run(run_dir: Path, out_dir: Path, *, dtype: str = "bfloat16", step: int | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` for the checkpoint at ``step`` (default newest)."""
    from dflash_offline.drafter.export import export_drafter

    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ResumeError(f"{run_dir} is not a training run directory (no config.json)")
    config = TrainConfig.from_dict(json.loads(config_path.read_text()))
    found = dict(list_checkpoints(run_dir))
    if not found:
        raise ResumeError(f"{run_dir} has no checkpoint yet")
    chosen = max(found) if step is None else step
    if chosen not in found:
        raise ResumeError(f"{run_dir} has no checkpoint of step {step}; it has {sorted(found)}")
    setup = build_drafter_setup(config, read_fingerprint(config.cache_dir), device=torch.device("cpu"))
    state = torch.load(found[chosen] / "state.pt", map_location="cpu", weights_only=False)
    if "feature_scale_F" in state["model"]:  # a --feature-scale run: the export folds it into fc
        setup.model.set_feature_scale(state["model"]["feature_scale_F"])
    setup.model.load_state_dict(state["model"])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return export_drafter(setup.model, out_dir, dtype=torch_dtype)
