"""The disk window of a cache over time (docs/follow.md): samples committed, retired and present, and
the spans each side waited for the other. Reads the Parquet manifest only (safe while both run)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_offline.plot.common import pyplot, save


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowSeries:
    """The window's counts at each event (a commit or a retirement), seconds from the first commit."""

    seconds_E: np.ndarray
    """float [E]."""
    committed_E: np.ndarray
    """int [E]: samples committed so far."""
    retired_E: np.ndarray
    """int [E]: samples retired so far."""
    waits: tuple[tuple[str, float, float], ...]
    """(side, start second, length in seconds) of each recorded wait."""

    @property
    def present_E(self) -> np.ndarray:
        return self.committed_E - self.retired_E


def window_series(cache_dir: Path) -> WindowSeries | None:
    """The series of a cache that had a window (a sealed store); None otherwise."""
    from dflash_offline.cache.manifest import read_table

    if read_table(cache_dir, "seals", ["shard"]).num_rows == 0:
        return None
    commits = read_table(cache_dir, "samples", ["created_at"]).column("created_at").to_pylist()
    retired = read_table(cache_dir, "retirements", ["retired_at", "num_samples"]).to_pydict()
    waits = read_table(cache_dir, "waits").to_pydict()
    events = [(t, 1, 0) for t in commits]
    events += [(t, 0, n) for t, n in zip(retired["retired_at"], retired["num_samples"], strict=True)]
    events.sort(key=lambda e: e[0])
    start = events[0][0]
    return WindowSeries(
        seconds_E=np.array([(t - start).total_seconds() for t, _, _ in events]),
        committed_E=np.cumsum([c for _, c, _ in events]),
        retired_E=np.cumsum([r for _, _, r in events]),
        waits=tuple(
            (side, (t - start).total_seconds(), float(s))
            for side, t, s in zip(waits["side"], waits["started_at"], waits["seconds"], strict=True)
        ),
    )


def plot_window(cache_dir: Path, out: Path) -> list[Path]:
    """Write window.png into ``out`` for a cache that had a window (nothing otherwise)."""
    series = window_series(cache_dir)
    if series is None:
        return []
    return [save(_window_figure(pyplot(), series, cache_dir.resolve().name), out / "window.png")]


def _window_figure(plt: Any, series: WindowSeries, name: str) -> Any:
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(series.seconds_E, series.committed_E, where="post", label="committed")
    ax.step(series.seconds_E, series.retired_E, where="post", label="trained and retired")
    ax.step(series.seconds_E, series.present_E, where="post", label="on disk (the window)")
    colours = {"generate": "tab:red", "train": "tab:grey"}
    labelled: set[str] = set()
    for side, begin, length in series.waits:
        label = None if side in labelled else f"{side} waited"
        labelled.add(side)
        ax.axvspan(begin, begin + length, color=colours.get(side, "tab:grey"), alpha=0.15, label=label)
    ax.set_xlabel("seconds since the first commit")
    ax.set_ylabel("samples")
    ax.set_title(f"{name}: the disk window")
    ax.legend(loc="upper left")
    return fig
