"""A fixed feature scale computed once from cache statistics, against massive activations.

SmolLM2-135M's captured residual streams have max |x| ≈ 24,800 in a few dimensions (507, 247, 17) at
every position, per-layer RMS 3–47 (docs/facts.md#features-of-a-real-target): through a randomly
initialised ``fc`` those few dimensions set the direction of every context vector, so the context starts out
nearly the same at every position. Dividing each feature by its RMS over a sample of the cache (``dim``) or
each captured layer by its own RMS (``layer``) puts every input of ``fc`` on the same footing. The scale is
saved in ``RUN/feature_scale.safetensors`` (a resumed run reuses it) and folded into ``fc.weight`` at
export, so the exported drafter keeps z-lab's layout and needs no scale at serving time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash_offline.errors import ConfigError

FeatureScaleMode = Literal["none", "layer", "dim"]
FEATURE_SCALE_MODES: tuple[str, ...] = ("none", "layer", "dim")
FEATURE_SCALE_FILE = "feature_scale.safetensors"
SAMPLE_TOKENS = 65_536
"""Tokens read for the statistics (streamed: one sample's features in float32 at a time)."""
RMS_FLOOR = 1e-2
"""A dimension's RMS is floored at this fraction of its layer's median RMS, so that a dead dimension
does not get an enormous multiplier."""


def feature_rms(features: Iterable[torch.Tensor], feature_width: int) -> np.ndarray:
    """float64 [F]: root mean square of each feature over all rows of ``features`` ([T_i, F] tensors)."""
    sum_sq = torch.zeros(feature_width, dtype=torch.float64)
    count = 0
    for f in features:
        x = f.float()
        sum_sq += (x * x).sum(0).double()
        count += int(x.shape[0])
    if count == 0:
        raise ConfigError("the cache has no tokens to compute a feature scale from; generate first")
    rms: np.ndarray = np.sqrt(sum_sq.numpy() / count)
    return rms


def scale_from_rms(rms_F: np.ndarray, *, num_layers: int, mode: FeatureScaleMode) -> torch.Tensor:
    """float32 [F] multipliers: 1/RMS per dimension (``dim``) or per captured layer (``layer``)."""
    if mode not in ("layer", "dim"):
        raise ConfigError(f"feature scale mode {mode!r}: expected one of {FEATURE_SCALE_MODES}")
    by_layer = rms_F.reshape(num_layers, -1)
    if mode == "layer":
        layer_rms = np.sqrt((by_layer**2).mean(1, keepdims=True))
        out = np.broadcast_to(1.0 / np.maximum(layer_rms, 1e-12), by_layer.shape)
    else:
        floor = RMS_FLOOR * np.median(by_layer, axis=1, keepdims=True)
        out = 1.0 / np.maximum(by_layer, np.maximum(floor, 1e-12))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(-1))


def compute_feature_scale(
    reader: object,
    rows_N: np.ndarray,
    *,
    num_layers: int,
    feature_width: int,
    mode: FeatureScaleMode,
    seed: int,
    sample_tokens: int = SAMPLE_TOKENS,
) -> torch.Tensor:
    """The scale from a seeded random sample of the snapshot's rows (≈ ``sample_tokens`` tokens)."""
    order = np.random.default_rng(seed).permutation(np.asarray(rows_N, dtype=np.int64))

    def sampled() -> Iterator[torch.Tensor]:
        tokens = 0
        for start in range(0, len(order), 16):
            for sample in reader.read_rows(order[start : start + 16]):  # type: ignore[attr-defined]
                yield sample.features_TF
                tokens += int(sample.features_TF.shape[0])
            if tokens >= sample_tokens:
                return

    return scale_from_rms(feature_rms(sampled(), feature_width), num_layers=num_layers, mode=mode)


def save_feature_scale(scale_F: torch.Tensor, run_dir: Path, *, mode: str) -> Path:
    path = run_dir / FEATURE_SCALE_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"feature_scale": scale_F.contiguous()}, str(tmp), metadata={"mode": mode})
    tmp.replace(path)
    return path


def load_feature_scale(run_dir: Path) -> torch.Tensor:
    return load_file(str(run_dir / FEATURE_SCALE_FILE))["feature_scale"]
