"""The typed configuration of ``dflash train``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; saved as ``RUN/config.json``."""

    cache_dir: Path
    out_dir: Path
    target: str | None = None
    """Where the frozen embedding and LM head come from; None = the cache's target when it is
    ``default`` or ``random:<preset>`` (a model directory must be named again: the cache stores
    only its name)."""
    # The drafter (DESIGN §4 defaults).
    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    """Anchors per microbatch row (the packed row is one 'sequence')."""
    gamma: float | None = None
    """Loss decay; None = 7 for B=16, 5 for B=10, 4 for B=8."""
    mask_token_id: int | None = None
    feature_scale: Literal["none", "layer", "dim"] = "none"
    """A fixed multiplier on the features before fc, from cache statistics (train/feature_scale.py):
    1/RMS per feature dimension (dim) or per captured layer (layer); folded into fc.weight at export."""
    final_norm_init: float = 1.0
    """Initial value of every weight of the drafter's final RMSNorm. With a tied head of row norm ~3
    (SmolLM2), a unit-RMS hidden of width 576 gives logits spread over tens of units, so the untrained
    drafter is confidently wrong (first loss ≈ 72 ≫ ln V); a small value starts it near ln V."""
    # Optimisation.
    autocast: Literal["auto", "bf16", "off"] = "auto"
    """bf16 autocast of the forward (weights stay fp32): auto = on CUDA only. On the 2-core
    development CPU a SmolLM2-width step took 6.0 s with bf16 against 2.2 s in float32."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """AdamW (fp32 master weights) by default; plain SGD makes gradients comparable across topologies
    (Adam's per-element normalisation amplifies float summation noise on near-zero gradients)."""
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    epochs: int = 6
    max_steps: int | None = None
    """Stop after this many optimizer steps, or at the end of ``epochs``: whichever comes first."""
    grad_accum: int = 4
    """Microbatches per rank and step: a step draws grad_accum × world_size microbatches across
    buckets, so with one GPU and grad_accum 1 every step would hold a single length bucket."""
    tokens_per_microbatch: int = 8192
    # Data path.
    prefetch: int = 4
    loader_threads: int = 4
    # Run management.
    seed: int = 0
    deterministic: bool = False
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    resume: Literal["auto", "never"] = "auto"
    allow_topology_change: bool = False
    """Resume even though the world size differs from the checkpoint's (the planner re-plans)."""
    log_every: int = 1
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    progress: bool = True
    export_at_end: bool = True
    export_initial: bool = False
    """Also export the untrained drafter to RUN/drafter-initial (the baseline for eval)."""
    # Placement.
    gpus: tuple[int, ...] = ()
    num_cpu_workers: int = 1
    threads_per_worker: int = 0

    def __post_init__(self) -> None:
        checks = {
            "--num-layers": self.num_layers >= 1,
            "--block-size": self.block_size >= 2,
            "--num-anchors": self.num_anchors >= 1,
            "--lr": self.lr > 0,
            "--final-norm-init": self.final_norm_init > 0,
            "--warmup-ratio": 0 <= self.warmup_ratio < 1,
            "--grad-clip": self.grad_clip > 0,
            "--epochs": self.epochs >= 1,
            "--max-steps": self.max_steps is None or self.max_steps >= 1,
            "--grad-accum": self.grad_accum >= 1,
            "--tokens-per-microbatch": self.tokens_per_microbatch >= 2,
            "--prefetch": self.prefetch >= 1,
            "--loader-threads": self.loader_threads >= 1,
            "--checkpoint-every": self.checkpoint_every >= 1,
            "--keep-checkpoints": self.keep_checkpoints >= 1,
            "--log-every": self.log_every >= 1,
            "--workers": self.num_cpu_workers >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid value for {', '.join(bad)} (see dflash train --help)")
        if self.autocast not in ("auto", "bf16", "off"):
            raise ConfigError(f"--autocast {self.autocast!r}: expected auto, bf16 or off")
        if self.feature_scale not in ("none", "layer", "dim"):
            raise ConfigError(f"--feature-scale {self.feature_scale!r}: expected none, layer or dim")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"--optimizer {self.optimizer!r}: expected adamw or sgd")
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"--resume {self.resume!r}: expected auto or never")

    @property
    def world_size(self) -> int:
        return len(self.gpus) if self.gpus else self.num_cpu_workers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        d["out_dir"] = str(self.out_dir)
        d["gpus"] = list(self.gpus)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = set(cls.__dataclass_fields__)
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"run config has unknown fields {sorted(unknown)}: written by another version?")
        values = dict(d)
        values["cache_dir"] = Path(values["cache_dir"])
        values["out_dir"] = Path(values["out_dir"])
        values["gpus"] = tuple(values.get("gpus", ()))
        return cls(**values)
