"""The model card (``README.md``) of a drafter export: what it drafts for, what it was trained on, how well
it drafts on held-out prompts, and the commands that serve it.

The serve commands are those of the engines' own documentation for DFlash drafters in z-lab's layout:
vLLM's ``--speculative-config`` with ``"method": "dflash"`` (vLLM 0.20 and later), where
``num_speculative_tokens`` is the block size − 1 (the anchor is not drafted), and SGLang's
``--speculative-algorithm DFLASH`` with ``--speculative-num-draft-tokens`` = the block size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.errors import ConfigError

SMOLLM2_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""What a server loads for ``--target default`` (the embedded GGUF is this model, quantized)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TauRow:
    """One question set of an eval report."""

    name: str
    prompts: int
    tau: float | None
    speedup: float | None
    timed: bool = True
    """False: the report says its decode was too short to time (``eval/report.py:TIMING_RULE``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalFacts:
    """The held-out table of a ``dflash eval --json`` report."""

    report: str
    """Where the report was read."""
    drafter_dir: str
    """The drafter directory the report measured."""
    rows: tuple[TauRow, ...]
    """Per set, then the unweighted mean (``mean``) when the report has several sets."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CardFacts:
    """What the card says besides the drafter's own config."""

    target_id: str
    """The target the features were captured from (``default``, a directory, a GGUF, a preset)."""
    weights_hash: str
    serve_target: str
    """What a server loads as the target: the Hugging Face id or directory."""
    data_source: str
    cache_dir: str
    step: int
    """The exported checkpoint's optimizer step."""
    run_length: str
    """The run's planned length (``--max-steps`` / ``--epochs``) in words."""
    dtype: str
    eval: EvalFacts | None


def serve_target_for(target_id: str, spec: str | None) -> str:
    """The model a server loads for a target: SmolLM2's hub id for the embedded GGUF, else the spec."""
    if target_id == "default":
        return SMOLLM2_HF_ID
    return spec or target_id


def read_eval_report(path: Path) -> EvalFacts:
    """The τ table of a ``dflash eval --json`` report."""
    try:
        report = json.loads(path.read_text())
        sets = report.get("sets") or [report["summary"]]
        rows = [_row(s["name"], s) for s in sets]
        mean = report.get("mean")
        if len(sets) > 1 and isinstance(mean, dict):
            prompts = sum(int(s.get("num_prompts") or 0) for s in sets)
            timed = all(row.timed for row in rows)
            rows.append(
                TauRow(
                    name="mean",
                    prompts=prompts,
                    tau=mean.get("tau"),
                    speedup=mean.get("speedup"),
                    timed=timed,
                )
            )
        drafter_dir = str((report.get("drafter") or {}).get("directory", "?"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"--eval-report {path}: not a dflash eval --json report ({type(e).__name__}: {e})"
        ) from e
    return EvalFacts(report=str(path), drafter_dir=drafter_dir, rows=tuple(rows))


def _row(name: str, summary: dict[str, Any]) -> TauRow:
    return TauRow(
        name=str(name),
        prompts=int(summary.get("num_prompts") or 0),
        tau=summary.get("tau"),
        speedup=summary.get("speedup"),
        timed=summary.get("timed") is not False,  # a report older than the rule says nothing
    )


def _number(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def vllm_command(serve_target: str, export_dir: str, block_size: int) -> str:
    spec = json.dumps({"method": "dflash", "model": export_dir, "num_speculative_tokens": block_size - 1})
    return (
        f"vllm serve {serve_target} \\\n  --speculative-config '{spec}' \\\n  --attention-backend flash_attn"
    )


def sglang_command(serve_target: str, export_dir: str, block_size: int) -> str:
    return (
        f"python -m sglang.launch_server --model-path {serve_target} \\\n"
        "  --speculative-algorithm DFLASH \\\n"
        f"  --speculative-draft-model-path {export_dir} \\\n"
        f"  --speculative-num-draft-tokens {block_size}"
    )


def _tau_section(eval_facts: EvalFacts | None) -> list[str]:
    """The card's τ table, or how to measure it when no eval report was given."""
    if eval_facts is None:
        return [
            "No eval report was given. Measure τ with `dflash eval --drafter DIR --json eval.json` and",
            "export again with `--eval-report eval.json` (a run's `RUN/eval.json` is read by itself).",
        ]
    return [
        f"`dflash eval` on prompts held out of the training data (report `{eval_facts.report}`, drafter",
        f"`{eval_facts.drafter_dir}`; greedy, batch 1; τ = mean tokens per draft–verify cycle).",
        "",
        "| question set | prompts | τ | speedup |",
        "|---|---|---|---|",
        *(
            f"| {r.name} | {r.prompts} | {_number(r.tau, '.3f')} | {_number(r.speedup, '.2f')}×"
            f"{'' if r.timed else ' (too short to time: noise)'} |"
            for r in eval_facts.rows
        ),
    ]


def render_model_card(facts: CardFacts, config: DrafterConfig, export_dir: Path) -> str:
    """The README.md text of an export at ``export_dir``."""
    where = str(export_dir.resolve())
    B = config.block_size
    lines = [
        "---",
        "tags: [dflash, speculative-decoding, draft-model]",
        "---",
        "",
        f"# DFlash drafter for `{facts.target_id}`",
        "",
        "A [DFlash](https://github.com/z-lab/dflash) block-diffusion drafter for speculative decoding,",
        "trained with dflash-offline on the target's own hidden states. It holds no embedding and no LM",
        "head: the serving engine uses the target's, so it drafts for this target only.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{facts.target_id}` (weights `{facts.weights_hash}`) |",
        f"| training data | `{facts.data_source}` (cache `{facts.cache_dir}`) |",
        f"| training | checkpoint of step {facts.step} ({facts.run_length}) |",
        f"| drafter | {config.num_layers} layers, block size {B}, target layers "
        f"{list(config.target_layer_ids)}, mask token id {config.mask_token_id}, {facts.dtype} |",
        "",
        "## Held-out acceptance length τ",
        "",
        *_tau_section(facts.eval),
    ]
    lines += [
        "",
        "## Serve it",
        "",
        f"vLLM 0.20 or later (`num_speculative_tokens` = block size − 1 = {B - 1}):",
        "",
        "```bash",
        vllm_command(facts.serve_target, where, B),
        "```",
        "",
        f"SGLang with DFLASH speculative decoding (`--speculative-num-draft-tokens` = block size = {B}):",
        "",
        "```bash",
        sglang_command(facts.serve_target, where, B),
        "```",
        "",
    ]
    return "\n".join(lines)
