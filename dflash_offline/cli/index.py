"""``dflash index CACHE``: merge the Parquet manifest into CACHE/index.duckdb."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cli.options import cache_input


@click.command()
@cache_input("cache", help="The cache directory (or give it as CACHE).")
def index(cache: Path) -> None:
    """Merge the manifest parts of CACHE into CACHE/index.duckdb (tables samples, shards, failures,
    runs; views bucket_stats, shard_stats, failure_stats, progress). Safe while writers run: the
    index is a snapshot, replaced atomically."""
    from dflash_offline.cache.index import build_index

    click.echo(build_index(cache).render())
