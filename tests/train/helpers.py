"""In-process training runs for the train tests: one tiny configuration that each test adjusts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dflash_offline.train.config import TrainConfig


def train_config(cache: Path, out: Path, **overrides: object) -> TrainConfig:
    base = TrainConfig(
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
    return replace(base, **overrides)  # type: ignore[arg-type]
