"""What every plot shares: a headless matplotlib, one look, saving, and a smoother for noisy curves."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DPI = 120


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed; safe on servers and in tests)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.figsize": (8.0, 4.5),
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "font.size": 10,
        }
    )
    return plt


def save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as PNG under a temp name, rename it into place, and close it."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.tight_layout()
    fig.savefig(tmp, dpi=DPI, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path


def smooth(values: Sequence[float] | np.ndarray, *, window: int | None = None) -> np.ndarray:
    """A centred moving average (window ≈ 2 % of the points, at least 1), NaN-tolerant, same length."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return x
    w = window if window is not None else max(1, n // 50)
    if w <= 1:
        return x
    ok = np.isfinite(x)
    kernel = np.ones(w)
    num = np.convolve(np.where(ok, x, 0.0), kernel, mode="same")
    den = np.convolve(ok.astype(np.float64), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1), np.nan)


TITLE_SIZE = 11.0
"""Points."""


def set_title(ax: Any, title: str, details: str = "") -> None:
    """``title`` and its ``details`` (last values, bests), wrapped to the axes' width: a one-line title
    wider than the figure was clipped at both ends."""
    fig = ax.get_figure()
    width_points = ax.get_position().width * fig.get_figwidth() * 72
    chars = max(20, int(width_points / (0.6 * TITLE_SIZE)))  # a glyph is about 0.55 em wide on average
    lines = textwrap.wrap(title, chars) + (textwrap.wrap(details, chars) if details else [])
    ax.set_title("\n".join(lines), fontsize=TITLE_SIZE)
