"""``dflash train``: train the DFlash drafter from a cache (partial caches included)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dflash_offline.cli.options import cache_option, placement_options, progress_option, seed_option


def _ctrl_c_exits_130(f: Callable[..., None]) -> Callable[..., None]:
    """Ctrl-C before the training loop takes it over (imports, setup) or a second one: exit 130 with
    one line, as after a clean stop (click would print `Aborted!` and exit 1)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            f(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo(
                "interrupted before a step boundary: the newest checkpoint (if any) is kept; "
                "rerun the same command to resume",
                err=True,
            )
            raise SystemExit(130) from None

    return wrapper


@click.command()
@cache_option(help="Cache written by `dflash generate` (a run still writing is fine: its committed samples).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Run directory: config, snapshot, metrics.jsonl, checkpoints/, drafter/ (the export).",
)
@click.option(
    "--target",
    default=None,
    help="Target for the frozen embedding and LM head (default: the cache's, when it is "
    "`default` or random:<preset>).",
)
@click.option("--num-layers", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--block-size", type=click.IntRange(min=2), default=16, show_default=True)
@click.option(
    "--num-anchors",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Blocks per microbatch row.",
)
@click.option(
    "--gamma", type=float, default=None, help="Loss decay γ (default: 7 for B=16, 5 for 10, 4 for 8)."
)
@click.option("--mask-token-id", type=int, default=None)
@click.option(
    "--feature-scale",
    type=click.Choice(["none", "layer", "dim"]),
    default="none",
    show_default=True,
    help="Fixed multiplier on the features before fc from cache statistics: 1/RMS per dimension or "
    "per captured layer (against massive activations); folded into fc.weight at export.",
)
@click.option(
    "--final-norm-init",
    type=float,
    default=1.0,
    show_default=True,
    help="Initial weight of the drafter's final RMSNorm (small: the untrained drafter's logits start "
    "near uniform instead of confidently wrong; first loss ≈ ln V instead of ≈ 72 on SmolLM2).",
)
@click.option(
    "--autocast",
    type=click.Choice(["auto", "bf16", "off"]),
    default="auto",
    show_default=True,
    help="bf16 autocast of the forward: auto = on GPUs only (measure before using it on a CPU).",
)
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True)
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--warmup-ratio", type=float, default=0.04, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=6, show_default=True)
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many optimizer steps (or at the end of --epochs, whichever is first).",
)
@click.option(
    "--grad-accum",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Microbatches per GPU and step (a step mixes grad-accum × GPUs microbatches of all lengths).",
)
@click.option("--tokens-per-microbatch", type=click.IntRange(min=2), default=8192, show_default=True)
@click.option(
    "--prefetch",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Microbatches prepared ahead.",
)
@click.option("--loader-threads", type=click.IntRange(min=1), default=4, show_default=True)
@seed_option
@click.option("--deterministic", is_flag=True, help="Deterministic kernels (same loss curve across runs).")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--resume",
    type=click.Choice(["auto", "never"]),
    default="auto",
    show_default=True,
    help="auto: continue from the newest checkpoint in --out, if any.",
)
@click.option(
    "--allow-topology-change",
    is_flag=True,
    help="Resume with another world size / grad accumulation (the epoch is re-planned).",
)
@click.option("--attention", type=click.Choice(["auto", "flex", "sdpa"]), default="auto", show_default=True)
@click.option(
    "--export-initial",
    is_flag=True,
    help="Also export the untrained drafter to OUT/drafter-initial (a baseline for dflash eval).",
)
@click.option("--log-every", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--tensorboard",
    "tensorboard_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Write TensorBoard event files to DIR (default: OUT/tb when the tensorboard package is "
    "installed: pip install 'dflash-offline[tensorboard]').",
)
@click.option("--no-tensorboard", is_flag=True, help="Write no TensorBoard event files.")
@click.option(
    "--on-damaged",
    type=click.Choice(["stop", "skip"]),
    default="stop",
    show_default=True,
    help="A sample failing its checksum when read: stop naming it, or skip it (recorded in "
    "RUN/damaged_samples.jsonl, reported at the end).",
)
@placement_options
@progress_option
@_ctrl_c_exits_130
def train(
    cache_dir: Path,
    out_dir: Path,
    target: str | None,
    num_layers: int,
    block_size: int,
    num_anchors: int,
    gamma: float | None,
    mask_token_id: int | None,
    feature_scale: str,
    final_norm_init: float,
    autocast: str,
    optimizer: str,
    lr: float,
    weight_decay: float,
    warmup_ratio: float,
    grad_clip: float,
    epochs: int,
    max_steps: int | None,
    grad_accum: int,
    tokens_per_microbatch: int,
    prefetch: int,
    loader_threads: int,
    seed: int,
    deterministic: bool,
    checkpoint_every: int,
    keep_checkpoints: int,
    resume: str,
    allow_topology_change: bool,
    attention: str,
    export_initial: bool,
    log_every: int,
    tensorboard_dir: Path | None,
    no_tensorboard: bool,
    on_damaged: str,
    gpus: str | None,
    workers: int,
    threads: int,
    progress: bool,
) -> None:
    """Train the DFlash drafter on the samples the cache has committed."""
    from dflash_offline.placement import parse_gpus
    from dflash_offline.train.config import TrainConfig
    from dflash_offline.train.launch import run_training

    config = TrainConfig(
        cache_dir=cache_dir,
        out_dir=out_dir,
        target=target,
        num_layers=num_layers,
        block_size=block_size,
        num_anchors=num_anchors,
        gamma=gamma,
        mask_token_id=mask_token_id,
        feature_scale=feature_scale,  # type: ignore[arg-type]
        final_norm_init=final_norm_init,
        autocast=autocast,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        lr=lr,
        weight_decay=weight_decay,
        warmup_ratio=warmup_ratio,
        grad_clip=grad_clip,
        epochs=epochs,
        max_steps=max_steps,
        grad_accum=grad_accum,
        tokens_per_microbatch=tokens_per_microbatch,
        prefetch=prefetch,
        loader_threads=loader_threads,
        seed=seed,
        deterministic=deterministic,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        resume=resume,  # type: ignore[arg-type]
        allow_topology_change=allow_topology_change,
        log_every=log_every,
        tensorboard=not no_tensorboard,
        tensorboard_dir=tensorboard_dir,
        on_damaged=on_damaged,  # type: ignore[arg-type]
        export_initial=export_initial,
        attention=attention,  # type: ignore[arg-type]
        progress=progress,
        gpus=parse_gpus(gpus),
        num_cpu_workers=workers,
        threads_per_worker=threads,
    )
    from dflash_offline.train.damaged import DAMAGED_FILE, read_damaged
    from dflash_offline.train.interrupt import TrainInterrupted

    try:
        result = run_training(config)
    except TrainInterrupted as e:
        click.echo(str(e), err=True)
        raise SystemExit(130) from None
    damaged = read_damaged(out_dir) if on_damaged == "skip" else []
    if damaged:
        click.echo(
            f"skipped {len(damaged)} damaged sample(s) (failed their checksum; ids in "
            f"{out_dir / DAMAGED_FILE}); run `dflash verify {cache_dir}`",
            err=True,
        )
    if result is not None:
        loss = "n/a" if result.final_loss is None else f"{result.final_loss:.4f}"
        click.echo(f"trained {result.global_step} steps; final loss {loss}")
        click.echo(f"metrics: {out_dir / 'metrics.jsonl'}")
        tb_dir = config.resolved_tensorboard_dir()
        if tb_dir is not None:
            click.echo(f"tensorboard: tensorboard --logdir {tb_dir}")
        if result.export_dir is not None:
            click.echo(f"drafter (z-lab DFlash layout): {result.export_dir}")
