"""``dflash generate``: capture target hidden states into the cache (resumable)."""

from __future__ import annotations

import click

from dflash_offline.cli.options import config_options
from dflash_offline.generate.config import GenerateConfig


@click.command()
@config_options(GenerateConfig)
def generate(config: GenerateConfig) -> None:
    """Run the target over a chat data set and store the hidden states of a few layers."""
    from dflash_offline.generate.launch import generate_from_config

    generate_from_config(config)
