"""``dflash status CACHE``: samples, tokens, bytes, buckets, failures and runs of a cache."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cli.options import cache_input


@click.command()
@cache_input("cache", help="The cache directory (or give it as CACHE).")
def status(cache: Path) -> None:
    """Summarise CACHE from its live manifest (accurate while writers run)."""
    from dflash_offline.cache.status import cache_status

    click.echo(cache_status(cache).render())
