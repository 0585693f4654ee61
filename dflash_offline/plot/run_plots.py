"""Plots of a training run (``RUN/metrics.jsonl``): loss, accuracy per block position, simulated τ,
throughput. Block position k = 1..B−1 predicts the token k after the anchor. Where the run evaluated
its validation split (the lines with ``val_*`` fields), the loss and τ figures draw the validation
curves on the training one (τ: simulated, per block and eval's chain, which picks RUN/drafter)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dflash_offline.errors import ConfigError
from dflash_offline.plot.common import pyplot, save, set_title, smooth

METRICS_FILE = "metrics.jsonl"

CHAIN_LABEL = "validation, eval's cycles (chain τ)"
"""The legend of ``val_chain_tau``: ``dflash eval``'s anchor rule over the first --val-chain-tokens
answer tokens of each turn, the τ that picks RUN/drafter."""


def read_run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step records of ``RUN/metrics.jsonl``, by step. A last line still being written is passed over."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no {METRICS_FILE}: not a `dflash train` run directory")
    rows: dict[int, dict[str, Any]] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break  # a writer is mid-line
            raise ConfigError(f"{path}:{number} is not valid JSON ({e})") from e
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows[row["step"]] = row  # a resumed run may repeat a step: the later line wins
    if not rows:
        raise ConfigError(f"{path} has no step yet: plot again once training has logged a step")
    return [rows[s] for s in sorted(rows)]


def _column(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) if isinstance(r.get(key), int | float) else np.nan for r in rows])


def _validation(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the lines that carry validation field ``key``."""
    val = [r for r in rows if isinstance(r.get(key), int | float)]
    return _column(val, "step"), _column(val, key)


TURN_LABELS = ("chain τ, first turns", "chain τ, second turns", "chain τ, later turns")
"""The legends of ``val_chain_tau_by_turn`` (train/validation.py: TURN_GROUPS)."""


def _chain_by_turn(rows: list[dict[str, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(steps, chain τ) of each turn group, over the lines that carry it."""
    curves = []
    for k in range(len(TURN_LABELS)):
        points = [
            (r["step"], float(v[k]))
            for r in rows
            if isinstance(v := r.get("val_chain_tau_by_turn"), list) and len(v) > k and v[k] is not None
        ]
        curves.append((np.array([p[0] for p in points]), np.array([p[1] for p in points])))
    return curves


def _title(run_dir: Path, what: str) -> str:
    return f"{what}: {run_dir.resolve().name}"


NON_FINITE_KEYS = ("loss", "grad_norm")
"""The fields whose first null / NaN / Inf marks where a run stopped being finite."""


def first_non_finite(rows: list[dict[str, Any]]) -> tuple[int, str] | None:
    """(step, field) of the first line whose loss or grad norm is not finite: JSON ``null`` (how a strict
    writer records NaN and Inf), or ``NaN`` / ``Infinity`` (older logs); None when every value is finite."""
    for row in rows:
        for key in NON_FINITE_KEYS:
            if key not in row:
                continue
            value = row[key]
            if value is None or (isinstance(value, int | float) and not math.isfinite(value)):
                return int(row["step"]), key
    return None


def non_finite_label(found: tuple[int, str]) -> str:
    step, key = found
    return f"{'loss' if key == 'loss' else 'grad norm'} not finite from step {step}"


def _mark_non_finite(axes: list[Any], found: tuple[int, str] | None) -> None:
    """A vertical line at the first non-finite step on each of ``axes``, labelled on the first."""
    if found is None:
        return
    for i, ax in enumerate(axes):
        ax.axvline(
            found[0], color="black", ls="--", lw=1.2, label=non_finite_label(found) if i == 0 else None
        )
    axes[0].text(
        found[0], 0.5, f" {non_finite_label(found)}", transform=axes[0].get_xaxis_transform(), rotation=90,
        va="center", ha="left", fontsize=8,
    )  # fmt: skip


def plot_loss(rows: list[dict[str, Any]], run_dir: Path, out: Path) -> Path:
    plt = pyplot()
    steps = _column(rows, "step")
    loss = _column(rows, "loss")
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1.4))
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
    ax.plot(steps, smooth(loss), color="tab:blue", lw=2, label="smoothed")
    val_steps, val_loss = _validation(rows, "val_loss")
    if val_steps.size:
        ax.plot(val_steps, val_loss, color="tab:red", marker="o", ms=4, lw=1.8, label="validation")
        loss = np.concatenate([loss, val_loss])
    finite = loss[np.isfinite(loss) & (loss > 0)]
    if finite.size and finite.max() / finite.min() > 10:
        ax.set_yscale("log")
    ax.set_ylabel("decayed cross-entropy")
    last = _column(rows, "loss")[-1]
    found = first_non_finite(rows)
    details = f"(last {last:.4g})" if np.isfinite(last) else ""
    set_title(ax, _title(run_dir, "training loss"), f"({non_finite_label(found)})" if found else details)
    _mark_non_finite([ax, ax_lr], found)
    ax.legend(loc="upper right")
    ax_lr.plot(steps, _column(rows, "lr"), color="tab:green", lw=1.5)
    ax_lr.set_ylabel("learning rate", color="tab:green")
    ax_lr.set_xlabel("optimizer step")
    ax_gn = ax_lr.twinx()
    ax_gn.plot(steps, _column(rows, "grad_norm"), color="tab:red", alpha=0.6, lw=0.8)
    ax_gn.set_ylabel("grad norm (pre-clip)", color="tab:red")
    ax_gn.grid(False)
    return save(fig, out / "loss.png")


def plot_accuracy(rows: list[dict[str, Any]], run_dir: Path, out: Path) -> Path:
    plt = pyplot()
    width = max((len(r.get("acc_by_position") or []) for r in rows), default=0)
    steps = _column(rows, "step")
    acc_SK = np.full((len(rows), max(width, 1)), np.nan)
    for i, r in enumerate(rows):
        values = r.get("acc_by_position") or []
        acc_SK[i, : len(values)] = values
    fig, (ax_map, ax_pos) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(1.6, 1))
    image = ax_map.imshow(
        acc_SK.T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, 0.5, width + 0.5),
        vmin=0.0,
        vmax=1.0,
        cmap="viridis",
    )
    fig.colorbar(image, ax=ax_map, label="greedy accuracy")
    ax_map.set_xlabel("optimizer step")
    ax_map.set_ylabel("block position k (predicts anchor + k)")
    set_title(ax_map, _title(run_dir, "accuracy by block position"))
    ax_map.grid(False)
    positions = np.arange(1, width + 1)
    span = max(1, len(rows) // 20)  # average a window of steps: one step's accuracy is noisy
    marks = sorted({0, len(rows) // 2, len(rows) - span})
    for j, start in enumerate(marks):
        window = acc_SK[start : start + span]
        label = f"steps {int(steps[start])}–{int(steps[min(start + span, len(rows)) - 1])}"
        with np.errstate(invalid="ignore"):
            mean = np.nanmean(window, axis=0) if np.isfinite(window).any() else np.full(width, np.nan)
        ax_pos.plot(
            positions, mean, marker="o", ms=3, lw=1.5, alpha=0.4 + 0.6 * (j + 1) / len(marks), label=label
        )
    ax_pos.set_ylim(0, 1)
    ax_pos.set_xlabel("block position k")
    ax_pos.set_ylabel("accuracy")
    ax_pos.set_title("early, middle, latest")
    ax_pos.legend(loc="upper right", fontsize=8)
    return save(fig, out / "accuracy_by_position.png")


def plot_tau(rows: list[dict[str, Any]], run_dir: Path, out: Path) -> Path:
    plt = pyplot()
    steps = _column(rows, "step")
    tau = _column(rows, "simulated_tau")
    fig, ax = plt.subplots()
    ax.plot(steps, tau, color="tab:purple", alpha=0.3, lw=0.8)
    ax.plot(steps, smooth(tau), color="tab:purple", lw=2, label="training batches")
    val_steps, val_tau = _validation(rows, "val_simulated_tau")
    if val_steps.size:
        ax.plot(val_steps, val_tau, color="tab:red", marker="o", ms=4, lw=1.8, label="validation")
        block_steps, block_tau = _validation(rows, "val_block_tau")
        ax.plot(block_steps, block_tau, color="tab:red", ls="--", lw=1.2, label="validation, per block")
        chain_steps, chain_tau = _validation(rows, "val_chain_tau")
        if chain_steps.size:  # runs trained before chain τ existed lack it
            ax.plot(chain_steps, chain_tau, color="tab:green", marker="s", ms=4, lw=1.8, label=CHAIN_LABEL)
        for label, (turn_steps, turn_tau), style in zip(
            TURN_LABELS, _chain_by_turn(rows), (":", "-.", (0, (5, 1))), strict=True
        ):
            if turn_steps.size:  # runs trained before chain τ by turn lack it
                ax.plot(turn_steps, turn_tau, color="tab:green", ls=style, lw=1.0, alpha=0.8, label=label)
        ax.legend(loc="center right", fontsize=8)
    block = max((len(r.get("acc_by_position") or []) for r in rows), default=0) + 1
    top = _tau_top(ax, block)
    if block <= top:  # the ceiling, where the data come near it
        ax.axhline(block, color="grey", ls=":", lw=1)
        ax.text(
            steps[0], block, f" B = {block} (every draft accepted)", va="bottom", fontsize=8, color="grey"
        )
    ax.set_ylim(bottom=1.0, top=top)
    _mark_non_finite([ax], first_non_finite(rows))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("simulated τ = 1 + Σ_k Π_{i≤k} acc_i")
    last = smooth(tau)[-1]
    best = f", best validation {np.nanmax(val_tau):.2f}" if val_steps.size else ""
    chain_steps, chain_tau = _validation(rows, "val_chain_tau")
    if chain_steps.size:
        best += f", best chain {np.nanmax(chain_tau):.2f} (RUN/drafter)"
    set_title(
        ax,
        _title(run_dir, "simulated acceptance length"),
        f"(smoothed last {last:.2f}{best})" if np.isfinite(last) else "",
    )
    return save(fig, out / "simulated_tau.png")


def _tau_top(ax: Any, block: int) -> float:
    """The τ axis's top, fitted to what is drawn (τ is at least 1): a run near τ 1.05 is not flattened
    under a ceiling of B; the ceiling B + 0.5 where the data reach it."""
    drawn = [np.asarray(line.get_ydata(), dtype=np.float64) for line in ax.get_lines()]
    values = np.concatenate(drawn) if drawn else np.array([])
    values = values[np.isfinite(values)]
    high = float(values.max()) if values.size else 1.0
    return min(block + 0.5, max(high, 1.0) + max(0.05, 0.1 * (max(high, 1.0) - 1.0)))


def plot_throughput(rows: list[dict[str, Any]], run_dir: Path, out: Path) -> Path:
    plt = pyplot()
    steps = _column(rows, "step")
    fig, ax = plt.subplots()
    tps = _column(rows, "tokens_per_s")
    ax.plot(steps, tps, color="tab:orange", alpha=0.3, lw=0.8)
    ax.plot(steps, smooth(tps), color="tab:orange", lw=2)
    ax.set_ylabel("tokens / s", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax_wait = ax.twinx()
    ax_wait.plot(steps, 100 * smooth(_column(rows, "data_wait_fraction")), color="tab:grey", lw=1.5)
    ax_wait.set_ylabel("% of step waiting for data", color="tab:grey")
    ax_wait.set_ylim(0, 100)
    ax_wait.grid(False)
    set_title(ax, _title(run_dir, "training throughput"))
    return save(fig, out / "throughput.png")


def plot_run(run_dir: Path, out: Path) -> list[Path]:
    """Write loss.png, accuracy_by_position.png, simulated_tau.png and throughput.png into ``out``."""
    rows = read_run_metrics(run_dir)
    return [
        plot_loss(rows, run_dir, out),
        plot_accuracy(rows, run_dir, out),
        plot_tau(rows, run_dir, out),
        plot_throughput(rows, run_dir, out),
    ]
