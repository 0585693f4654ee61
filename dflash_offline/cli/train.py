"""``dflash train``: train the DFlash drafter from a cache (partial caches included)."""

from __future__ import annotations

import click

from dflash_offline.cli.flags import flag, render
from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import config_options
from dflash_offline.train.config import TrainConfig, ValidationConfig

HELP_ORDER = (
    *("cache_dir", "out_dir", "target", "num_layers", "block_size", "num_anchors", "gamma", "mask_token_id"),
    *("feature_scale", "final_norm_init", "init_from", "autocast", "algorithm", "lr", "weight_decay"),
    *("warmup_ratio", "grad_clip", "epochs", "max_steps", "grad_accum", "tokens_per_microbatch"),
    *("fuse_microbatches", "prefetch", "loader_threads", "seed", "deterministic", "checkpoint_every"),
    *("keep_checkpoints", "resume", "allow_topology_change", "attention", "export_initial", "log_every"),
    *("val_fraction", "val_samples", "val_group", "train_samples", "val_every", "val_chain_tokens"),
    *("early_stop", "compile", "tensorboard_dir", "tensorboard", "on_damaged", "follow", "passes", "gpus"),
    *("num_cpu_workers", "threads_per_worker", "progress"),
)
"""The options in ``dflash train --help``, by name: the order they had before the config was nested by
section (the help snapshot, tests/cli/help_snapshot.json, holds it)."""


@click.command()
@config_options(TrainConfig, order=HELP_ORDER)
@ctrl_c_exits_130(
    "interrupted before a step boundary: the newest checkpoint (if any) is kept; rerun the same command "
    "to resume"
)
def train(config: TrainConfig) -> None:
    """Train the DFlash drafter on the samples the cache has committed."""
    import time

    started_at = time.time()  # the start-up counts from here: the train command's first line
    from dflash_offline.interrupt import EXIT_INTERRUPTED
    from dflash_offline.train.damaged import DAMAGED_FILE, read_damaged
    from dflash_offline.train.launch import run_training
    from dflash_offline.train.trainer import TrainInterrupted

    if config.window.follow:
        from dflash_offline.train.follow import run_follow

        try:
            followed = run_follow(config)
        except TrainInterrupted as e:
            click.echo(render(str(e)), err=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        click.echo(followed.render())
        return
    try:
        result = run_training(config, started_at=started_at)
    except TrainInterrupted as e:
        click.echo(render(str(e)), err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    damaged = read_damaged(config.out_dir) if config.launch.on_damaged == "skip" else []
    if damaged:
        click.echo(
            f"skipped {len(damaged)} damaged sample(s) (unreadable or failing their checksum; ids in "
            f"{config.out_dir / DAMAGED_FILE}); run `dflash verify {config.cache_dir}`",
            err=True,
        )
    if result is None:  # a torchrun rank other than 0
        return
    loss = "n/a" if result.final_loss is None else f"{result.final_loss:.4f}"
    click.echo(f"trained {result.global_step} steps; final loss {loss}")
    if result.wall is not None:
        click.echo(result.wall.describe())
    click.echo(f"metrics: {config.out_dir / 'metrics.jsonl'}")
    tb_dir = config.resolved_tensorboard_dir()
    if tb_dir is not None:
        click.echo(f"tensorboard: tensorboard --logdir {tb_dir}")
    if result.export_dir is not None and result.best_validation_tau is not None:
        click.echo(
            f"drafter (z-lab DFlash layout): {result.export_dir}, the best validation chain τ "
            f"({result.best_validation_tau:.3f} over {flag(ValidationConfig, 'val_chain_tokens')} "
            f"{config.validation.val_chain_tokens}, step {result.best_validation_step}); the last weights: "
            f"{config.out_dir / 'drafter-last'}"
        )
        if result.stopped_early:
            patience = flag(ValidationConfig, "early_stop")
            click.echo(f"stopped early: no better validation chain τ in {patience} validations")
    elif result.export_dir is not None:
        click.echo(f"drafter (z-lab DFlash layout): {result.export_dir}")
