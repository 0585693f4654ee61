"""``dflash verify CACHE``: re-read and re-checksum every committed sample; exit 1 on damage.
``--repair`` prints a repair plan (under the lock) and carries it out only with ``--yes``;
``--dry-run`` prints the plan alone."""

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
    help="Plan a repair and print it: move damaged manifest parts aside, rebuild damaged zarr.json "
    "files, keep one good copy of each sample committed twice, drop samples whose bytes fail (rerun "
    "generate to recompute them), delete orphan shard bytes and stale temp files. Changes nothing "
    "without --yes. Takes the cache's writer lock (refused while a generate runs).",
)
@click.option("--dry-run", is_flag=True, default=False, help="Print the repair plan only (implies --repair).")
@click.option("--yes", is_flag=True, default=False, help="Carry out the repair plan (with --repair).")
def verify(cache: Path, progress: bool, threads: int, repair: bool, dry_run: bool, yes: bool) -> None:
    """Re-read every committed sample of CACHE, check its crc32c, check every manifest part against
    the sha256 in its name and every shard group's metadata, and report damage (by shard), duplicated
    ids and unreferenced bytes. Exits 1 when anything is damaged or duplicated, or when --repair has a
    plan it was not told (--yes) to carry out."""
    from dflash_offline.cache.verify import verify_cache

    if yes and dry_run:
        raise click.UsageError("--yes and --dry-run contradict each other: pick one")
    if yes and not repair:
        raise click.UsageError("--yes carries out a repair plan: use it with --repair")
    if repair or dry_run:
        from dflash_offline.cache.repair import apply_repair, repair_session

        with repair_session(cache, progress=progress) as plan:
            click.echo(plan.render())
            if dry_run:
                return
            if plan.changes and not yes:
                click.echo(f"nothing changed: to carry out this plan, dflash verify --repair --yes {cache}")
                raise SystemExit(1)
            if plan.changes:
                click.echo(apply_repair(plan).render())
    report = verify_cache(cache, progress=progress, num_threads=threads)
    click.echo(report.render())
    if not report.ok:
        raise SystemExit(1)
