"""``dflash generate``: capture target hidden states into the cache (resumable)."""

from __future__ import annotations

import click

from dflash_offline.cli.flags import render
from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import config_options
from dflash_offline.generate.config import GenerateConfig


@click.command()
@config_options(GenerateConfig)
@ctrl_c_exits_130("interrupted: committed samples are kept; rerun the same command to resume")
def generate(config: GenerateConfig) -> None:
    """Run the target over a chat data set and store the hidden states of a few layers."""
    from dflash_offline.generate.launch import format_summary, generate_from_config
    from dflash_offline.generate.run import GenerateInterrupted

    try:
        summary = generate_from_config(config)
    except GenerateInterrupted as stopped:  # what was committed, and how fast, before the exit 130
        click.echo(render(format_summary(stopped.summary, cache_dir=str(config.cache_dir))))
        raise
    if summary is not None:
        click.echo(render(format_summary(summary, cache_dir=str(config.cache_dir))))
