"""Eval results as records, a table for people, JSON for programs and TensorBoard scalars.

Per set (and pooled over all sets): τ = Σ over its cycles of (accepted + 1) ÷ number of cycles (a mean
over cycles, not over prompts); decode tok/s of a loop = Σ new tokens ÷ Σ its decode seconds (prefill
excluded); speedup = Σ target-only decode seconds ÷ Σ speculative decode seconds
(docs/drafter.md#metrics). The mean row is the unweighted mean of the per-set values (each set counts once, as
in DFlash's tables). A "prompt" is one decoded turn: an MT-Bench question gives two.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_offline.decode import DecodeResult
from dflash_offline.errors import ConfigError
from dflash_offline.eval.exactness import Divergence, first_divergence
from dflash_offline.tensorboard import open_writer

TIMED_MIN_TOKENS = 1000
TIMED_MIN_SECONDS = 5.0
TIMING_RULE = (
    f"timed: yes when the figures come from at least {TIMED_MIN_TOKENS:,} new tokens and "
    f"{TIMED_MIN_SECONDS:g} s of decoding in each loop; below that (one prompt, a short run, a tiny model) "
    "start-up, allocator and scheduling jitter outweigh the loops' difference, so tok/s and speedup are "
    "noise, not a measurement"
)
"""When decode timings mean something. A per-step jitter of a few ms against steps of a few ms (a small
model, the CPU, a shared machine) averages out only over many steps: the rule asks for both many tokens
and seconds of decoding, whatever the device."""

EVAL_REPORT_VERSION = 2
"""2: per-set summaries (``sets``), the ``mean`` row, per-prompt ``bench``/``turn``/``question_id`` and the
tie-aware ``divergence``; ``summary`` (pooled) and the per-prompt fields of version 1 are unchanged."""


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
    bench: str = "data"
    """The question set: ``mt-bench``, ``humaneval``, ``sharegpt``, or ``data`` (``--data``, no --bench)."""
    turn: int = 1
    """1-based user turn of the question (MT-Bench has two)."""
    question_id: str = ""
    """MT-Bench question_id / HumanEval task_id (empty for chat data: see sample_id)."""
    divergence: Divergence | None = None
    """Tie-aware comparison with target-only greedy (exactness.py); None when not classified."""
    timed: bool = False
    """Its tok/s and speedup are a measurement by ``TIMING_RULE`` (rarely, for one prompt)."""


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
    """Prompts whose speculative output equals the target-only output token for token."""
    name: str = "all"
    """The set, or ``all`` for every prompt pooled."""
    num_questions: int = 0
    """Distinct questions (num_prompts counts decoded turns)."""
    near_ties: int = 0
    """Prompts that diverge first at a rounding near-tie (exactness.py)."""
    mismatches: int = 0
    """Prompts that diverge where rounding cannot explain it (the run fails)."""
    timed: bool = False
    """Its tok/s and speedup are a measurement by ``TIMING_RULE`` (else noise)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeanRow:
    """The unweighted mean over sets (a set without a value is left out of that column's mean)."""

    num_sets: int
    tau: float | None
    target_tokens_per_s: float | None
    spec_tokens_per_s: float | None
    speedup: float | None


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
    """Every prompt of every set pooled."""
    sets: list[EvalSummary] = field(default_factory=list)
    """One summary per question set, in table order."""
    mean: MeanRow | None = None
    """Unweighted mean of the per-set values."""
    exactness: dict[str, Any] = field(default_factory=dict)
    """How the identity check ran: dtype, tie_ulps, rule."""
    interrupted: bool = False
    """Stopped by Ctrl-C (or SIGINT) before every turn was decoded: the figures cover the finished turns."""
    timing_rule: str = TIMING_RULE
    """When a summary's or prompt's ``timed`` is true."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        check_report_path(path, option="--json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")


def check_report_path(path: Path, *, option: str) -> None:
    """``path`` may receive a report: it does not exist, or holds an earlier report (a JSON object with
    the report's ``summary`` and ``prompts``). Anything else there (a run's or an export's config.json, a
    weights file) is refused (``ConfigError``) rather than replaced."""
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        data = None
    if not (isinstance(data, dict) and {"summary", "prompts"} <= data.keys()):
        raise ConfigError(
            f"{option} {path}: the file there is not an earlier dflash eval report, and the report would "
            "replace it; name a new file"
        )


def histogram(accepted: Sequence[int], block_size: int) -> list[int]:
    """Counts of accepted lengths 0..B−1."""
    counts = [0] * block_size
    for a in accepted:
        counts[a] += 1
    return counts


first_mismatch = first_divergence


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and num > 0 else None


def is_timed(*, new_tokens: int, spec_seconds: float, target_seconds: float) -> bool:
    """``TIMING_RULE``: enough tokens and seconds in each loop for tok/s and speedup to be measured."""
    return new_tokens >= TIMED_MIN_TOKENS and min(spec_seconds, target_seconds) >= TIMED_MIN_SECONDS


def prompt_result(
    *,
    sample_id: str,
    record_id: str,
    prompt_tokens: int,
    spec: DecodeResult,
    target_only: DecodeResult,
    block_size: int,
    text: str,
    bench: str = "data",
    turn: int = 1,
    question_id: str = "",
    divergence: Divergence | None = None,
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
        bench=bench,
        turn=turn,
        question_id=question_id,
        divergence=divergence,
        timed=is_timed(
            new_tokens=len(spec.tokens),
            spec_seconds=spec.decode_seconds,
            target_seconds=target_only.decode_seconds,
        ),
    )


def summarize(results: Sequence[PromptResult], *, block_size: int, name: str = "all") -> EvalSummary:
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
        name=name,
        num_questions=len({(r.bench, r.question_id or r.sample_id) for r in results}),
        near_ties=sum(r.divergence is not None and r.divergence.kind == "near_tie" for r in results),
        mismatches=sum(r.divergence is not None and r.divergence.kind == "mismatch" for r in results),
        timed=is_timed(new_tokens=new_tokens, spec_seconds=spec_s, target_seconds=target_s),
    )


def summarize_sets(
    results: Sequence[PromptResult], *, block_size: int
) -> tuple[list[EvalSummary], MeanRow, EvalSummary]:
    """Per-set summaries (in order of first appearance), their mean row, and the pooled summary."""
    names = list(dict.fromkeys(r.bench for r in results))
    sets = [summarize([r for r in results if r.bench == n], block_size=block_size, name=n) for n in names]

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    row = MeanRow(
        num_sets=len(sets),
        tau=mean([s.tau for s in sets]),
        target_tokens_per_s=mean([s.target_tokens_per_s for s in sets]),
        spec_tokens_per_s=mean([s.spec_tokens_per_s for s in sets]),
        speedup=mean([s.speedup for s in sets]),
    )
    return sets, row, summarize(results, block_size=block_size)


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_table(report: EvalReport) -> str:
    """The human-readable report: one row per set, the mean row and the pooled row, the accepted-length
    histogram of each set, and every divergence from target-only greedy."""
    s = report.summary
    check = report.exactness
    lines = [
        f"target {report.target.get('target_id')} ({report.target.get('device')}, "
        f"{report.target.get('dtype')}{', compiled' if report.target.get('compiled') else ''}), "
        f"drafter {report.drafter.get('directory')} (B={s.block_size}"
        f"{', compiled' if report.drafter.get('compiled') else ''})",
        report.held_out,
        *(f"warning: {w}" for w in report.warnings),
        "",
        *_aligned(_set_rows(report)),
        "",
        "tau = mean accepted+1 over cycles; tok/s = decode only (prefill excluded), same loop and clock for "
        "both; speedup = target-only / speculative decode time",
        *_timing_lines(report),
    ]
    if check:
        lines.append(
            f"exactness: speculative vs target-only greedy in {check.get('dtype')}; a first divergence is a "
            f"near-tie when both tokens are within {check.get('tie_ulps')} ulp of the top logit of a "
            "full forward over the prefix, else a mismatch"
        )
    lines += ["", f"accepted draft tokens per cycle, % of the set's cycles (a = 0..{s.block_size - 1}):"]
    hist_rows: list[tuple[str, ...]] = [("set", *(str(a) for a in range(s.block_size)))]
    for summary in report.sets or [report.summary]:
        total = sum(summary.accepted_histogram) or 1
        hist_rows.append((summary.name, *(f"{100 * n / total:.0f}" for n in summary.accepted_histogram)))
    lines += _aligned(hist_rows)
    return "\n".join(lines + _divergence_lines(report))


def _timing_lines(report: EvalReport) -> list[str]:
    """The rule, when a row of the table is too short to time (its tok/s and speedup are noise)."""
    rows = report.sets or [report.summary]
    if all(s.timed for s in [*rows, report.summary]):
        return []
    return [f"{TIMING_RULE} (per-prompt figures in the JSON: the same rule, prompt by prompt)"]


def _set_rows(report: EvalReport) -> list[tuple[str, ...]]:
    """The table's header and rows: each set, then (with several sets) their mean and the pooled row."""
    sets = report.sets or [report.summary]
    head = ("set", "questions", "turns", "new tok", "cycles", "tau", "target tok/s", "spec tok/s",
            "speedup", "identical", "near-tie", "mismatch", "timed")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for s in [*sets, report.summary] if len(sets) > 1 else sets:
        rows.append(
            (
                s.name if s is not report.summary or len(sets) == 1 else "all (pooled)",
                str(s.num_questions),
                str(s.num_prompts),
                str(s.new_tokens),
                str(s.cycles),
                _fmt(s.tau, ".3f"),
                _fmt(s.target_tokens_per_s, ".1f"),
                _fmt(s.spec_tokens_per_s, ".1f"),
                _fmt(s.speedup, ".2f", "x"),
                str(s.identical_prompts),
                str(s.near_ties),
                str(s.mismatches),
                "yes" if s.timed else "no: noise",
            )
        )
    if report.mean is not None and len(sets) > 1:
        m = report.mean
        rows.insert(
            len(sets) + 1,
            (f"mean of {m.num_sets} sets", "", "", "", "", _fmt(m.tau, ".3f"),
             _fmt(m.target_tokens_per_s, ".1f"), _fmt(m.spec_tokens_per_s, ".1f"),
             _fmt(m.speedup, ".2f", "x"), "", "", "", "yes" if all(s.timed for s in sets) else "no: noise"),
        )  # fmt: skip
    return rows


def _divergence_lines(report: EvalReport) -> list[str]:
    """Every prompt whose speculative answer differs from target-only greedy, and how."""
    diverged = [r for r in report.prompts if not r.identical]
    if not diverged:
        return []
    from dflash_offline.eval.exactness import describe

    lines = ["", "divergences from target-only greedy:"]
    for r in diverged:
        what = (
            describe(r.divergence) if r.divergence is not None else f"differs at new token {r.first_mismatch}"
        )
        lines.append(f"  {r.bench} {r.question_id or r.record_id or r.sample_id} turn {r.turn}: {what}")
    return lines


def eval_scalars(report: EvalReport) -> dict[str, float]:
    """Tag -> value of the summary row (None values are left out)."""
    s = report.summary
    values = {
        "eval/tau": s.tau,
        "eval/speedup": s.speedup,
        "eval/spec_tokens_per_s": s.spec_tokens_per_s,
        "eval/target_tokens_per_s": s.target_tokens_per_s,
        "eval/identical_prompts": s.identical_prompts,
        "eval/cycles": s.cycles,
        "eval/new_tokens": s.new_tokens,
    }
    return {tag: float(v) for tag, v in values.items() if v is not None}


def write_eval_report(log_dir: Path, report: EvalReport, *, step: int = 0) -> Path:
    """The eval τ table as scalars under ``log_dir``; returns the directory. Tags:
    eval/tau, eval/speedup, eval/spec_tokens_per_s, eval/target_tokens_per_s, eval/identical_prompts,
    eval/cycles, eval/new_tokens                                   (step = ``step``, default 0)
    eval/prompt_tau, eval/prompt_speedup                           (step = prompt number)
    eval/accepted_histogram                                        (step = accepted draft tokens)
    """
    writer = open_writer(log_dir)
    try:
        for tag, value in eval_scalars(report).items():
            writer.add_scalar(tag, value, global_step=step)
        for i, prompt in enumerate(report.prompts):
            if prompt.tau is not None:
                writer.add_scalar("eval/prompt_tau", prompt.tau, global_step=i)
            if prompt.speedup is not None:
                writer.add_scalar("eval/prompt_speedup", prompt.speedup, global_step=i)
        for accepted, count in enumerate(report.summary.accepted_histogram):
            writer.add_scalar("eval/accepted_histogram", count, global_step=accepted)
    finally:
        writer.close()
    return log_dir
