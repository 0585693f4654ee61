"""``dflash verify CACHE``: re-read and re-checksum every committed sample; exit 1 on damage.
``--repair`` first drops duplicate and damaged commits and removes orphan bytes (under the lock)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cli.options import cache_input


@click.command()
@cache_input("cache", help="The cache directory (or give it as CACHE).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@click.option("--threads", type=click.IntRange(1, 256), default=4, show_default=True, help="Reader threads.")
@click.option(
    "--repair",
    is_flag=True,
    default=False,
    help="First repair: keep one good copy of each sample committed twice, drop damaged samples (rerun "
    "generate to recompute them), delete orphan shard bytes and stale temp files. Takes the cache's "
    "writer lock (refused while a generate runs).",
)
def verify(cache: Path, progress: bool, threads: int, repair: bool) -> None:
    """Re-read every committed sample of CACHE, check its crc32c, and report damaged samples (by
    shard), duplicated ids and unreferenced bytes. Exits 1 when a sample is damaged or duplicated."""
    from dflash_offline.cache.verify import verify_cache

    if repair:
        from dflash_offline.cache.repair import repair_cache

        click.echo(repair_cache(cache, progress=progress).render())
    report = verify_cache(cache, progress=progress, num_threads=threads)
    click.echo(report.render())
    if not report.ok:
        raise SystemExit(1)
