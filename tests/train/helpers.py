"""In-process training runs for the train tests: one tiny configuration that each test adjusts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_offline.train.config import TrainConfig


def train_config(cache: Path, out: Path, **overrides: object) -> TrainConfig:
    base = TrainConfig.from_options(
        cache_dir=cache,
        out_dir=out,
        num_layers=1,
        block_size=8,
        num_anchors=32,
        tokens_per_microbatch=600,
        grad_accum=1,
        lr=3e-3,
        epochs=100,
        max_steps=12,
        checkpoint_every=4,
        loader_threads=2,
        prefetch=2,
        progress=False,
        deterministic=True,
        threads_per_worker=1,
    )
    return base.with_options(**overrides)


def flat_config_json(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's config.json (by section, format 2) as dflash-offline wrote it before the sections: one flat
    object of options, the optimizer's algorithm under its flag's name, no format version."""
    flat: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, dict):
            flat.update(value)
        elif key != "version":
            flat[key] = value
    flat["optimizer"] = flat.pop("algorithm")
    return flat


def assert_export_equals_checkpoint(
    exported: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor]
) -> None:
    """An export holds a checkpoint's weights, with the feature scale (``--feature-scale``, on by default)
    folded into fc by hand here: fc(x·s) = (W·diag(s)) x, so column j of fc.weight is multiplied by s[j]."""
    expected = dict(model_state)
    scale_F = expected.pop("feature_scale_F", None)
    if scale_F is not None:
        expected["fc.weight"] = expected["fc.weight"].float() * scale_F.float()[None, :]
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        if name == "fc.weight" and scale_F is not None:
            torch.testing.assert_close(tensor.float(), expected[name], rtol=1e-6, atol=0, msg=name)
        else:
            assert torch.equal(tensor, expected[name]), name
