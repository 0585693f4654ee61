"""The typed configuration of ``dflash train``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.errors import ConfigError, ResumeError

MAX_BLOCK_SIZE = 128
"""A block is drafted in one forward and its attention holds num_anchors × block_size queries per row
(B × A × (S + A·B) mask entries): DFlash drafters use 8–16; 100,000 would try to allocate terabytes."""

SHAPE_FIELDS = (
    "target",
    "num_layers",
    "block_size",
    "num_anchors",
    "gamma",
    "mask_token_id",
    "optimizer",
    "seed",
    "tokens_per_microbatch",
    "feature_scale",
)
"""Options a resume must not change: they define the drafter's tensors, its loss or the sample plan."""

APPLIED_ON_RESUME = ("lr", "weight_decay", "warmup_ratio", "grad_clip", "epochs", "max_steps")
"""Options a resume takes over from the command line (optimizer hyper-parameters and the run length;
the LR schedule is recomputed from them), each announced when it differs from the previous run."""


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
    tensorboard: bool = True
    """Write TensorBoard event files: to ``tensorboard_dir``, else to RUN/tb when the package is there."""
    tensorboard_dir: Path | None = None
    """Explicit event-file directory (``--tensorboard DIR``): then the package is required."""
    on_damaged: Literal["stop", "skip"] = "stop"
    """A sample failing its crc32c when read: ``stop`` the run naming it, or ``skip`` it (recorded in
    RUN/damaged_samples.jsonl, announced at the end)."""
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
        def finite(x: float) -> bool:
            return isinstance(x, int | float) and math.isfinite(x)

        checks = {
            "--num-layers": (self.num_layers, 1 <= self.num_layers <= 64, "an integer in 1..64"),
            "--block-size": (
                self.block_size,
                2 <= self.block_size <= MAX_BLOCK_SIZE,
                f"an integer in 2..{MAX_BLOCK_SIZE} (a block is drafted in one forward and its "
                f"attention grows with num_anchors × block_size; DFlash uses 8–16)",
            ),
            "--num-anchors": (self.num_anchors, 1 <= self.num_anchors <= 65536, "an integer in 1..65536"),
            "--gamma": (self.gamma, self.gamma is None or (finite(self.gamma) and self.gamma > 0), "> 0"),
            "--mask-token-id": (
                self.mask_token_id,
                self.mask_token_id is None or self.mask_token_id >= 0,
                "a token id ≥ 0",
            ),
            "--lr": (self.lr, finite(self.lr) and self.lr > 0, "a finite number > 0"),
            "--final-norm-init": (
                self.final_norm_init,
                finite(self.final_norm_init) and self.final_norm_init > 0,
                "a finite number > 0",
            ),
            "--weight-decay": (
                self.weight_decay,
                finite(self.weight_decay) and self.weight_decay >= 0,
                "a finite number ≥ 0",
            ),
            "--warmup-ratio": (self.warmup_ratio, 0 <= self.warmup_ratio < 1, "in [0, 1)"),
            "--grad-clip": (
                self.grad_clip,
                finite(self.grad_clip) and self.grad_clip > 0,
                "a finite number > 0",
            ),
            "--epochs": (self.epochs, self.epochs >= 1, "an integer ≥ 1"),
            "--max-steps": (self.max_steps, self.max_steps is None or self.max_steps >= 1, "an integer ≥ 1"),
            "--grad-accum": (self.grad_accum, self.grad_accum >= 1, "an integer ≥ 1"),
            "--tokens-per-microbatch": (
                self.tokens_per_microbatch,
                2 <= self.tokens_per_microbatch <= 1 << 24,
                "an integer in 2..16777216",
            ),
            "--prefetch": (self.prefetch, 1 <= self.prefetch <= 1024, "an integer in 1..1024"),
            "--loader-threads": (
                self.loader_threads,
                1 <= self.loader_threads <= 256,
                "an integer in 1..256",
            ),
            "--checkpoint-every": (self.checkpoint_every, self.checkpoint_every >= 1, "an integer ≥ 1"),
            "--keep-checkpoints": (self.keep_checkpoints, self.keep_checkpoints >= 1, "an integer ≥ 1"),
            "--log-every": (self.log_every, self.log_every >= 1, "an integer ≥ 1"),
            "--workers": (self.num_cpu_workers, 1 <= self.num_cpu_workers <= 1024, "an integer in 1..1024"),
            "--threads": (
                self.threads_per_worker,
                0 <= self.threads_per_worker <= 4096,
                "an integer in 0..4096 (0: the machine's cores divided among the workers)",
            ),
        }
        bad = [f"{name} {value}: expected {valid}" for name, (value, ok, valid) in checks.items() if not ok]
        if bad:
            raise ConfigError("invalid " + "; ".join(bad))
        if self.on_damaged not in ("stop", "skip"):
            raise ConfigError(f"--on-damaged {self.on_damaged!r}: expected stop or skip")
        if self.autocast not in ("auto", "bf16", "off"):
            raise ConfigError(f"--autocast {self.autocast!r}: expected auto, bf16 or off")
        if self.feature_scale not in ("none", "layer", "dim"):
            raise ConfigError(f"--feature-scale {self.feature_scale!r}: expected none, layer or dim")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"--optimizer {self.optimizer!r}: expected adamw or sgd")
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"--resume {self.resume!r}: expected auto or never")
        if self.tensorboard_dir is not None:
            if not self.tensorboard:
                raise ConfigError("--tensorboard DIR and --no-tensorboard contradict each other: give one")
            from dflash_offline.tensorboard import require_tensorboard

            require_tensorboard()

    def resolved_tensorboard_dir(self) -> Path | None:
        """Where event files go: the explicit directory, RUN/tb when tensorboard is installed, or None."""
        from dflash_offline.tensorboard import tensorboard_available

        if not self.tensorboard:
            return None
        if self.tensorboard_dir is not None:
            return self.tensorboard_dir
        return self.out_dir / "tb" if tensorboard_available() else None

    @property
    def world_size(self) -> int:
        return len(self.gpus) if self.gpus else self.num_cpu_workers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        d["out_dir"] = str(self.out_dir)
        d["tensorboard_dir"] = None if self.tensorboard_dir is None else str(self.tensorboard_dir)
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
        if values.get("tensorboard_dir") is not None:
            values["tensorboard_dir"] = Path(values["tensorboard_dir"])
        values["gpus"] = tuple(values.get("gpus", ()))
        return cls(**values)


def check_resume(previous: dict[str, Any], config: TrainConfig) -> list[str]:
    """Compare the run's saved config with this invocation's: refuse a changed shape option (naming
    it), return one note per applied change (optimizer options, run length)."""
    current = config.to_dict()
    for name in SHAPE_FIELDS:
        if name in previous and previous[name] != current[name]:
            flag = "--" + name.replace("_", "-")
            raise ResumeError(
                f"{config.out_dir} was trained with {flag} {previous[name]!r}, this run asks for "
                f"{current[name]!r}; resume with the same {flag}, or train into a new --out "
                "(or pass --resume never to start over there)"
            )
    return [
        f"resuming with --{name.replace('_', '-')} {current[name]!r} (the previous run used "
        f"{previous[name]!r}): applied from the resumed step on"
        for name in APPLIED_ON_RESUME
        if name in previous and previous[name] != current[name]
    ]
