"""``dflash plot``: PNGs of a training run, a cache or an eval report."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("path", type=click.Path(path_type=Path, exists=True), required=False)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="The cache to plot (as the positional PATH; as every cache command takes it).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Folder for the PNGs (default: RUN/plots, CACHE-plots next to a cache, REPORT-plots next to "
    "an eval report).",
)
def plot(path: Path | None, cache_dir: Path | None, out_dir: Path | None) -> None:
    """Plot PATH: a training run (loss, accuracy per block position, simulated τ, throughput), a cache
    (samples and tokens per bucket, lengths, failures) or a `dflash eval --json` report (acceptance)."""
    from dflash_offline.errors import ConfigError
    from dflash_offline.plot import plot_path

    if path is None and cache_dir is None:
        raise click.UsageError("give what to plot: PATH (a run, a cache or an eval report) or --cache C")
    if path is not None and cache_dir is not None and path != cache_dir:
        raise click.UsageError(f"PATH {path} and --cache {cache_dir} name different things: give one")
    if cache_dir is not None and not (cache_dir / "cache.json").is_file():
        raise ConfigError(f"--cache {cache_dir}: not a cache (no cache.json); plot a run or report as PATH")
    target = cache_dir if cache_dir is not None else path
    assert target is not None
    result = plot_path(target, out_dir)
    for file in result.files:
        click.echo(str(file))
    if result.kind == "run":
        from dflash_offline.plot.run_plots import first_non_finite, non_finite_label, read_run_metrics

        found = first_non_finite(read_run_metrics(target))
        if found is not None:  # drawn on loss.png too; said here so that a script sees it
            click.echo(f"warning: {non_finite_label(found)} (marked on the loss and τ plots)", err=True)
