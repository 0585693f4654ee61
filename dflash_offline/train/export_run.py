"""Export a training run's drafter (from a checkpoint) in z-lab's DFlash layout, with its model card."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import read_fingerprint
from dflash_offline.errors import DivergedError, ResumeError
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.export_out import check_export_out
from dflash_offline.train.model_setup import DrafterSetup, build_drafter_setup
from dflash_offline.writable import check_writable_dir

if TYPE_CHECKING:
    from dflash_offline.drafter.model_card import EvalFacts

EVAL_REPORT_NAME = "eval.json"
"""A ``dflash eval --json`` report at ``RUN/eval.json`` goes into the model card without being named."""


def export_run(
    run_dir: Path,
    out_dir: Path,
    *,
    dtype: str = "bfloat16",
    step: int | None = None,
    eval_report: Path | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` + ``README.md`` for the checkpoint at ``step`` (default
    newest); the card's τ table comes from ``eval_report``, else from ``RUN/eval.json`` when it exists.

    The ``ResumeError`` raised here says a run directory or checkpoint is not there; nothing is resumed, so
    no resume compatibility is decided (that is train/resume_contract.py's, for ``dflash train``)."""
    from dflash_offline.drafter.export import export_drafter, nonfinite_tensors
    from dflash_offline.drafter.model_card import read_eval_report

    check_export_out(out_dir, option="--out")
    check_writable_dir(out_dir, option="--out")
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ResumeError(f"{run_dir} is not a training run directory (no config.json)")
    config = TrainConfig.from_dict(json.loads(config_path.read_text()))
    found = dict(list_checkpoints(run_dir))
    if not found:
        raise ResumeError(f"{run_dir} has no checkpoint yet")
    chosen = max(found) if step is None else step
    if chosen not in found:
        raise ResumeError(f"{run_dir} has no checkpoint of step {step}; it has {sorted(found)}")
    if eval_report is None and (run_dir / EVAL_REPORT_NAME).is_file():
        eval_report = run_dir / EVAL_REPORT_NAME
    evaluated = read_eval_report(eval_report) if eval_report is not None else None  # fails before writing
    fingerprint = read_fingerprint(config.cache_dir)
    setup = build_drafter_setup(config, fingerprint, device=torch.device("cpu"))
    state = torch.load(found[chosen] / "state.pt", map_location="cpu", weights_only=False)
    bad = nonfinite_tensors(state["model"])
    if bad:  # a checkpoint written by a diverged run before dflash-offline refused to write one
        others = sorted(set(found) - {chosen})
        raise DivergedError(
            f"{found[chosen] / 'state.pt'}: non-finite weights (NaN or Inf) in {', '.join(bad[:3])}: the run "
            f"had diverged by step {chosen}; export an earlier checkpoint with --step (the run has {others})"
        )
    if "feature_scale_F" in state["model"]:  # a --feature-scale run: the export folds it into fc
        setup.model.set_feature_scale(state["model"]["feature_scale_F"])
    setup.model.load_state_dict(state["model"])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    readme = _model_card(
        config, fingerprint, setup, step=chosen, dtype=dtype, evaluated=evaluated, out_dir=out_dir
    )
    return export_drafter(setup.model, out_dir, dtype=torch_dtype, readme=readme)


def _model_card(
    config: TrainConfig,
    fingerprint: CacheFingerprint,
    setup: DrafterSetup,
    *,
    step: int,
    dtype: str,
    evaluated: EvalFacts | None,
    out_dir: Path,
) -> str:
    from dflash_offline.drafter.model_card import CardFacts, render_model_card, serve_target_for

    length = f"--max-steps {config.max_steps}" if config.max_steps else f"--epochs {config.epochs}"
    facts = CardFacts(
        target_id=fingerprint.target_id,
        weights_hash=fingerprint.weights_hash,
        serve_target=serve_target_for(fingerprint.target_id, setup.target_spec),
        data_source=fingerprint.data_source,
        cache_dir=str(config.cache_dir),
        step=step,
        run_length=f"a run of {length}, seed {config.seed}",
        dtype=dtype,
        eval=evaluated,
    )
    return render_model_card(facts, setup.model.config, out_dir)
