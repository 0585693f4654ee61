"""``dflash plot``: PNGs of a training run, a cache or an eval report."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("path", type=click.Path(path_type=Path, exists=True))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Folder for the PNGs (default: RUN/plots, CACHE-plots next to a cache, REPORT-plots next to "
    "an eval report).",
)
def plot(path: Path, out_dir: Path | None) -> None:
    """Plot PATH: a training run (loss, accuracy per block position, simulated τ, throughput), a cache
    (samples and tokens per bucket, lengths, failures) or a `dflash eval --json` report (acceptance)."""
    from dflash_offline.plot import plot_path

    result = plot_path(path, out_dir)
    for file in result.files:
        click.echo(str(file))
