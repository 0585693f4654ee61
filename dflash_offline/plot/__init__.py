"""``dflash plot``: PNGs of a training run, a cache, or an eval report (matplotlib, Agg backend).

plot_path(path, out=None) -> PlotResult   picks the kind from what ``path`` holds
run_plots.plot_run / cache_plots.plot_cache / eval_plots.plot_eval
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dflash_offline.errors import ConfigError

PlotKind = Literal["run", "cache", "eval"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlotResult:
    """What ``plot_path`` wrote."""

    kind: PlotKind
    """What ``path`` was: a training run, a cache, or an eval report."""
    out_dir: Path
    files: tuple[Path, ...]
    """The PNGs written."""


def detect_kind(path: Path) -> PlotKind:
    if path.is_dir() and (path / "metrics.jsonl").is_file():
        return "run"
    if path.is_dir() and (path / "cache.json").is_file():
        return "cache"
    if path.is_file() and path.suffix == ".json":
        return "eval"
    raise ConfigError(
        f"{path}: expected a training run (RUN with metrics.jsonl), a cache (with cache.json) or a "
        "`dflash eval --json` report"
    )


def default_out_dir(path: Path, kind: PlotKind) -> Path:
    """RUN/plots for a run; CACHE-plots next to a cache (a cache holds only what its format names);
    REPORT-plots next to an eval report."""
    if kind == "run":
        return path / "plots"
    if kind == "cache":
        return path.resolve().with_name(path.resolve().name + "-plots")
    return path.with_name(path.stem + "-plots")


def plot_path(path: Path, out: Path | None = None) -> PlotResult:
    kind = detect_kind(path)
    out_dir = out if out is not None else default_out_dir(path, kind)
    if kind == "run":
        from dflash_offline.plot.run_plots import plot_run

        files = plot_run(path, out_dir)
    elif kind == "cache":
        from dflash_offline.plot.cache_plots import plot_cache

        files = plot_cache(path, out_dir)
    else:
        from dflash_offline.plot.eval_plots import plot_eval

        files = plot_eval(path, out_dir)
    return PlotResult(kind=kind, out_dir=out_dir, files=tuple(files))
