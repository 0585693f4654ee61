"""``dflash status CACHE``: samples, tokens, bytes, buckets, failures and runs of a cache."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("cache", type=click.Path(path_type=Path))
def status(cache: Path) -> None:
    """Summarise CACHE from its live manifest (accurate while writers run)."""
    from dflash_offline.cache.status import cache_status

    click.echo(cache_status(cache).render())
