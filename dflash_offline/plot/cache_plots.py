"""Plots of a cache: samples and tokens per length bucket, the length distribution against the bucket
edges, and failures by reason. Reads the Parquet manifest only (safe while generate still writes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_offline.plot.common import pyplot, save, set_title


def bucket_labels(edges: tuple[int, ...]) -> list[str]:
    """``≤256``, ``257–512``, ... and ``>last`` for an overflow bucket (id == len(edges))."""
    labels = []
    low = 1
    for edge in edges:
        labels.append(f"≤{edge}" if low == 1 else f"{low}–{edge}")
        low = edge + 1
    return [*labels, f">{edges[-1]}"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketSummary:
    """Per length bucket of a cache's committed samples."""

    edges: tuple[int, ...]
    """The fingerprint's bucket edges."""
    labels: tuple[str, ...]
    """One per bucket (an overflow bucket only when a sample is in it)."""
    samples: tuple[int, ...]
    """Samples per bucket."""
    tokens: tuple[int, ...]
    """Tokens per bucket."""


def bucket_summary(cache_dir: Path) -> BucketSummary:
    """Samples and tokens per bucket, from the manifest's ``bucket_id`` and ``num_tokens``."""
    from dflash_offline.cache.layout import read_fingerprint
    from dflash_offline.cache.manifest import read_table

    edges = tuple(read_fingerprint(cache_dir).bucket_edges)
    samples = read_table(cache_dir, "samples", ["bucket_id", "num_tokens"])
    bucket_N = np.asarray(samples.column("bucket_id").to_numpy(), dtype=np.int64)
    tokens_N = np.asarray(samples.column("num_tokens").to_numpy(), dtype=np.int64)
    num_buckets = len(edges) + (1 if bucket_N.size and bucket_N.max() >= len(edges) else 0)
    counts = np.bincount(bucket_N, minlength=num_buckets)
    sums = np.bincount(bucket_N, weights=tokens_N, minlength=num_buckets)
    return BucketSummary(
        edges=edges,
        labels=tuple(bucket_labels(edges)[:num_buckets]),
        samples=tuple(int(c) for c in counts),
        tokens=tuple(int(t) for t in sums),
    )


def plot_cache(cache_dir: Path, out: Path) -> list[Path]:
    """Write buckets.png, lengths.png, (when there are failures) failures.png and (when the cache had a
    disk window) window.png into ``out``."""
    from dflash_offline.cache.layout import read_fingerprint
    from dflash_offline.cache.manifest import read_table

    fp = read_fingerprint(cache_dir)
    summary = bucket_summary(cache_dir)
    samples = read_table(cache_dir, "samples", ["num_tokens", "num_loss_tokens"])
    tokens_N = np.asarray(samples.column("num_tokens").to_numpy(), dtype=np.int64)
    loss_N = np.asarray(samples.column("num_loss_tokens").to_numpy(), dtype=np.int64)
    name = cache_dir.resolve().name
    plt = pyplot()
    paths = [save(_buckets_figure(plt, summary, name), out / "buckets.png")]
    lengths = _lengths_figure(plt, tokens_N, loss_N, edges=summary.edges, name=name, max_length=fp.max_length)
    paths.append(save(lengths, out / "lengths.png"))
    failures = read_table(cache_dir, "failures", ["reason"])
    if failures.num_rows:
        reasons = np.asarray(failures.column("reason").to_pylist(), dtype=object)
        paths.append(save(_failures_figure(plt, reasons, name), out / "failures.png"))
    from dflash_offline.plot.window_plots import plot_window

    return paths + plot_window(cache_dir, out)  # window.png, for a cache that had a window


def _buckets_figure(plt: Any, summary: BucketSummary, name: str) -> Any:
    """Samples and tokens per bucket side by side, each bar labelled with its share."""
    labels = list(summary.labels)
    num_buckets = len(labels)
    counts = np.asarray(summary.samples)
    token_sums = np.asarray(summary.tokens, dtype=np.float64)
    scale, unit = _token_scale(token_sums.sum())
    fig, (ax_n, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(num_buckets)
    for ax, values, what, color in (
        (ax_n, counts, "samples", "tab:blue"),
        (ax_t, token_sums / scale, f"tokens{unit}", "tab:orange"),
    ):
        bars = ax.bar(x, values, color=color)
        total = float(np.sum(values))
        for bar, v in zip(bars, values):
            share = f"{100 * v / total:.0f}%" if total else ""
            ax.annotate(
                share,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(x, labels, rotation=30 if num_buckets > 6 else 0)
        ax.set_xlabel("bucket (tokens per sample)")
        ax.set_ylabel(what)
    set_title(ax_n, f"{name}: {int(counts.sum()):,} samples per bucket")
    set_title(ax_t, f"{int(token_sums.sum()):,} tokens per bucket")
    return fig


def _token_scale(total_tokens: float) -> tuple[float, str]:
    """(divisor, axis label suffix) that keeps token counts readable."""
    return next(
        (
            (f, u)
            for f, u in ((1e9, " (billions)"), (1e6, " (millions)"), (1e3, " (thousands)"))
            if total_tokens >= 10 * f
        ),
        (1.0, ""),
    )


def _lengths_figure(
    plt: Any, tokens_N: np.ndarray, loss_N: np.ndarray, *, edges: tuple[int, ...], name: str, max_length: int
) -> Any:
    """Histograms of tokens and trained tokens per sample, with the bucket edges dotted. The axis ends at
    the fingerprint's max length (no sample is longer), not at the last bucket edge: the default edges run
    to 3,072 whatever ``--max-len`` is."""
    fig, ax = plt.subplots()
    longest = int(tokens_N.max()) if tokens_N.size else 0
    top = max(longest, min(edges[-1], max_length))
    if tokens_N.size:
        # One bin per length when lengths are short (no empty bins between integers), else 60 bins.
        bins = np.arange(top + 2) - 0.5 if top <= 120 else np.linspace(0, top, 61)
        ax.hist(tokens_N, bins=bins, color="tab:blue", alpha=0.7, label="tokens")
        ax.hist(
            loss_N, bins=bins, color="tab:green", histtype="step", lw=1.5, label="assistant (loss) tokens"
        )
    for edge in edges:
        if edge <= top:
            ax.axvline(edge, color="grey", ls=":", lw=1)
    ax.set_xlim(0, top + (0.5 if top <= 120 else 0))
    ax.set_xlabel("tokens per sample (dotted: bucket edges)")
    ax.set_ylabel("samples")
    set_title(ax, f"{name}: sample lengths (fingerprint max length {max_length})")
    ax.legend()
    return fig


def _failures_figure(plt: Any, reason_N: np.ndarray, name: str) -> Any:
    """Failed samples per reason, the most frequent on top."""
    reasons, per_reason = np.unique(reason_N, return_counts=True)
    order = np.argsort(-per_reason)
    fig, ax = plt.subplots()
    ax.barh([str(r) for r in reasons[order]][::-1], per_reason[order][::-1], color="tab:red")
    ax.set_xlabel("samples")
    set_title(ax, f"{name}: {int(per_reason.sum()):,} failed samples by reason")
    return fig
