"""Plots of a ``dflash eval --json`` report: accepted draft tokens per cycle, τ and speedup per prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dflash_offline.errors import ConfigError
from dflash_offline.plot.common import pyplot, save, set_title


def read_eval_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read an eval report ({e})") from e
    if not isinstance(report, dict) or "summary" not in report or "prompts" not in report:
        raise ConfigError(f"{path} is not a `dflash eval --json` report (no summary / prompts)")
    return report


def plot_eval(path: Path, out: Path) -> list[Path]:
    """Write eval_acceptance.png into ``out``."""
    report = read_eval_report(path)
    summary = report["summary"]
    prompts = report["prompts"]
    hist = np.asarray(summary["accepted_histogram"], dtype=np.float64)
    plt = pyplot()
    fig, (ax_h, ax_p) = plt.subplots(1, 2, figsize=(12, 4.5))
    share = 100 * hist / hist.sum() if hist.sum() else hist
    ax_h.bar(np.arange(len(hist)), share, color="tab:purple")
    ax_h.set_xlabel("accepted draft tokens in a cycle (τ_cycle − 1)")
    ax_h.set_ylabel("% of cycles")
    tau = summary.get("tau")
    set_title(ax_h, f"τ = {tau:.2f} over {summary['cycles']} cycles" if tau is not None else "no cycle")
    x = np.arange(len(prompts))
    taus = [p["tau"] if p["tau"] is not None else np.nan for p in prompts]
    speedups = [p["speedup"] if p["speedup"] is not None else np.nan for p in prompts]
    ax_p.bar(x - 0.2, taus, width=0.4, color="tab:purple", label="τ")
    ax_p.bar(x + 0.2, speedups, width=0.4, color="tab:orange", label="speedup ×")
    ax_p.axhline(1.0, color="grey", ls=":", lw=1)
    ax_p.set_xlabel("prompt")
    title = (
        f"per prompt; overall speedup {summary['speedup']:.2f}×" if summary.get("speedup") else "per prompt"
    )
    # eval/report.py:TIMING_RULE (a report older than it has no ``timed``)
    noise = " (speedups too short to time: noise)" if summary.get("timed") is False else ""
    set_title(ax_p, title + noise)
    ax_p.legend()
    return [save(fig, out / "eval_acceptance.png")]
