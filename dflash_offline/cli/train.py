"""``dflash train``: train the DFlash drafter from a cache (partial caches included)."""

from __future__ import annotations

import click

from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import config_options
from dflash_offline.config_fields import flag
from dflash_offline.train.config import TrainConfig


@click.command()
@config_options(TrainConfig)
@ctrl_c_exits_130(
    "interrupted before a step boundary: the newest checkpoint (if any) is kept; rerun the same command "
    "to resume"
)
def train(config: TrainConfig) -> None:
    """Train the DFlash drafter on the samples the cache has committed."""
    import time

    started_at = time.time()  # the start-up counts from here: the train command's first line
    from dflash_offline.interrupt import EXIT_INTERRUPTED
    from dflash_offline.train.loader import DAMAGED_FILE, read_damaged
    from dflash_offline.train.trainer import TrainInterrupted, run_training

    if config.follow:
        from dflash_offline.train.follow import run_follow

        try:
            followed = run_follow(config)
        except TrainInterrupted as e:
            click.echo(str(e), err=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        click.echo(followed.render())
        return
    try:
        result = run_training(config, started_at=started_at)
    except TrainInterrupted as e:
        click.echo(str(e), err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    damaged = read_damaged(config.out_dir) if config.on_damaged == "skip" else []
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
            f"({result.best_validation_tau:.3f} over {flag(TrainConfig, 'val_chain_tokens')} "
            f"{config.val_chain_tokens}, step {result.best_validation_step}); the last weights: "
            f"{config.out_dir / 'drafter-last'}"
        )
        if result.stopped_early:
            patience = flag(TrainConfig, "early_stop")
            click.echo(f"stopped early: no better validation chain τ in {patience} validations")
    elif result.export_dir is not None:
        click.echo(f"drafter (z-lab DFlash layout): {result.export_dir}")
