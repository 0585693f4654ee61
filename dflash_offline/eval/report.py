"""Eval results as records, a table for people and JSON for programs.

τ overall = Σ over all cycles of (accepted + 1) ÷ number of cycles (a mean over cycles, not over
prompts); speedup overall = Σ target-only decode seconds ÷ Σ speculative decode seconds (DESIGN §5).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_offline.eval.speculative import DecodeResult

EVAL_REPORT_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptResult:
    """One prompt: the speculative run against the target-only run."""

    sample_id: str
    record_id: str
    prompt_tokens: int
    new_tokens: int
    """Tokens generated (speculative run; equal to the target-only count when ``identical``)."""
    cycles: int
    """Draft–verify cycles."""
    accepted_histogram: list[int]
    """Counts of cycles by accepted draft tokens 0..B−1."""
    tau: float | None
    """Mean over this prompt's cycles of accepted + 1 (None without a cycle)."""
    spec_seconds: float
    """Speculative decode time, prefill excluded."""
    target_seconds: float
    """Target-only decode time, prefill excluded."""
    speedup: float | None
    """target_seconds ÷ spec_seconds (None when either is 0)."""
    identical: bool
    """The speculative output equals the target-only greedy output token for token."""
    first_mismatch: int | None
    """Index of the first differing new token (or the shorter length) when not identical."""
    stop_reason: str
    text: str
    """The speculative output decoded (special tokens kept)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSummary:
    """All prompts together."""

    num_prompts: int
    block_size: int
    tau: float | None
    """Σ (accepted + 1) ÷ cycles over every cycle of every prompt."""
    accepted_histogram: list[int]
    """Counts of cycles by accepted draft tokens 0..B−1, all prompts."""
    cycles: int
    new_tokens: int
    spec_seconds: float
    target_seconds: float
    speedup: float | None
    """Σ target_seconds ÷ Σ spec_seconds."""
    spec_tokens_per_s: float | None
    target_tokens_per_s: float | None
    identical_prompts: int
    """Prompts whose speculative output equals the target-only output (lossless check)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport:
    """Everything ``dflash eval --json`` writes."""

    version: int
    config: dict[str, Any]
    """The EvalConfig as JSON values."""
    target: dict[str, Any]
    """target_id, weights_hash, device, dtype."""
    drafter: dict[str, Any]
    """directory, block_size, target_layer_ids, mask_token_id, num_layers, dtype."""
    held_out: str
    """Where the excluded sample ids come from (or why held-out is not guaranteed)."""
    warnings: list[str]
    """Inconsistencies worth a look (target or layers differ from the training cache's, few prompts)."""
    prompts: list[PromptResult]
    summary: EvalSummary

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")


def histogram(accepted: Sequence[int], block_size: int) -> list[int]:
    """Counts of accepted lengths 0..B−1."""
    counts = [0] * block_size
    for a in accepted:
        counts[a] += 1
    return counts


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first difference of two token sequences (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and num > 0 else None


def prompt_result(
    *,
    sample_id: str,
    record_id: str,
    prompt_tokens: int,
    spec: DecodeResult,
    target_only: DecodeResult,
    block_size: int,
    text: str,
) -> PromptResult:
    mismatch = first_mismatch(spec.tokens, target_only.tokens)
    return PromptResult(
        sample_id=sample_id,
        record_id=record_id,
        prompt_tokens=prompt_tokens,
        new_tokens=len(spec.tokens),
        cycles=spec.num_cycles,
        accepted_histogram=histogram(spec.accepted_per_cycle, block_size),
        tau=spec.tau,
        spec_seconds=spec.decode_seconds,
        target_seconds=target_only.decode_seconds,
        speedup=_ratio(target_only.decode_seconds, spec.decode_seconds),
        identical=mismatch is None,
        first_mismatch=mismatch,
        stop_reason=spec.stop_reason,
        text=text,
    )


def summarize(results: Sequence[PromptResult], *, block_size: int) -> EvalSummary:
    hist = [sum(r.accepted_histogram[a] for r in results) for a in range(block_size)]
    cycles = sum(hist)
    spec_s = sum(r.spec_seconds for r in results)
    target_s = sum(r.target_seconds for r in results)
    new_tokens = sum(r.new_tokens for r in results)
    return EvalSummary(
        num_prompts=len(results),
        block_size=block_size,
        tau=sum((a + 1) * n for a, n in enumerate(hist)) / cycles if cycles else None,
        accepted_histogram=hist,
        cycles=cycles,
        new_tokens=new_tokens,
        spec_seconds=spec_s,
        target_seconds=target_s,
        speedup=_ratio(target_s, spec_s),
        spec_tokens_per_s=_ratio(new_tokens, spec_s),
        target_tokens_per_s=_ratio(new_tokens, target_s),
        identical_prompts=sum(r.identical for r in results),
    )


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(report: EvalReport) -> str:
    """The human-readable report: one row per prompt, then the totals and the histogram."""
    rows = [("id", "prompt", "new", "cycles", "tau", "speedup", "lossless")]
    for r in report.prompts:
        rows.append(
            (
                (r.record_id or r.sample_id)[:24],
                str(r.prompt_tokens),
                str(r.new_tokens),
                str(r.cycles),
                _fmt(r.tau, ".2f"),
                _fmt(r.speedup, ".2f") + "x" if r.speedup is not None else "-",
                "yes" if r.identical else f"NO @{r.first_mismatch}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = report.summary
    lines += [
        "",
        f"target {report.target['target_id']} ({report.target['device']}, {report.target['dtype']}), "
        f"drafter {report.drafter['directory']} (B={s.block_size})",
        report.held_out,
        *(f"warning: {w}" for w in report.warnings),
        f"prompts {s.num_prompts}, new tokens {s.new_tokens}, cycles {s.cycles}",
        f"tau (mean accepted+1 over cycles): {_fmt(s.tau, '.3f')}",
        f"speedup (target-only / speculative decode time, prefill excluded): {_fmt(s.speedup, '.2f')}x  "
        f"({_fmt(s.target_tokens_per_s, '.1f')} -> {_fmt(s.spec_tokens_per_s, '.1f')} tok/s)",
        f"lossless: {s.identical_prompts}/{s.num_prompts} prompts identical to target-only greedy",
        "accepted draft tokens per cycle (count):",
    ]
    peak = max(s.accepted_histogram, default=0) or 1
    for a, n in enumerate(s.accepted_histogram):
        lines.append(f"  {a:>3}  {n:>7}  {'#' * round(40 * n / peak)}")
    return "\n".join(lines)
