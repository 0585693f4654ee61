"""TensorBoard event files for training metrics and eval reports (an optional extra, never required).

Written with ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package:
``pip install 'dflash-offline[tensorboard]'``. Training writes, per logged step, the very values of
``metrics.jsonl`` (``train/metrics.py`` calls ``write_step``); ``dflash eval --tensorboard`` writes the
τ table. Tags:
  train/loss, train/lr, train/grad_norm, train/simulated_tau, train/tokens_per_s, train/step_seconds,
  train/data_wait_fraction, train/acc/pos_01 .. pos_{B−1}       (step = optimizer step)
  val/loss, val/simulated_tau, val/block_tau, val/acc/pos_01 ..  (steps where validation ran)
  eval/tau, eval/speedup, eval/spec_tokens_per_s, eval/target_tokens_per_s, eval/identical_prompts,
  eval/cycles, eval/new_tokens                                   (step = ``step``, default 0)
  eval/prompt_tau, eval/prompt_speedup                           (step = prompt number)
  eval/accepted_histogram                                        (step = accepted draft tokens)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_offline.errors import ConfigError

if TYPE_CHECKING:
    from dflash_offline.eval.report import EvalReport
    from dflash_offline.train.metrics import StepMetrics

INSTALL_HINT = "pip install 'dflash-offline[tensorboard]'"
STEP_SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "simulated_tau",
    "tokens_per_s",
    "step_seconds",
    "data_wait_fraction",
)
"""StepMetrics fields written as ``train/<field>``; ``acc_by_position`` goes to ``train/acc/pos_NN``."""


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write (the ``tensorboard`` package is importable)."""
    return importlib.util.find_spec("tensorboard") is not None


def require_tensorboard(flag: str = "--tensorboard") -> None:
    """Fail before any work when event files are asked for and cannot be written."""
    if not tensorboard_available():
        raise ConfigError(f"{flag} needs the tensorboard package: {INSTALL_HINT}")


def open_writer(log_dir: Path, *, purge_step: int | None = None) -> Any:
    """A ``SummaryWriter`` on ``log_dir``. ``purge_step``: hide events of earlier runs at steps >= it
    (a resumed run rewrites the steps after its checkpoint, as ``metrics.jsonl`` does)."""
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    log_dir.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def step_scalars(metrics: StepMetrics) -> dict[str, float]:
    """Tag -> value of one training step."""
    scalars = {f"train/{name}": float(getattr(metrics, name)) for name in STEP_SCALARS}
    for k, acc in enumerate(metrics.acc_by_position, start=1):
        scalars[f"train/acc/pos_{k:02d}"] = float(acc)
    val = metrics.validation
    if val is not None:
        scalars.update(
            {"val/loss": val.loss, "val/simulated_tau": val.simulated_tau, "val/block_tau": val.block_tau}
        )
        for k, acc in enumerate(val.acc_by_position, start=1):
            scalars[f"val/acc/pos_{k:02d}"] = float(acc)
    return scalars


def write_step(writer: Any, metrics: StepMetrics) -> None:
    for tag, value in step_scalars(metrics).items():
        writer.add_scalar(tag, value, global_step=metrics.step)
    writer.flush()  # a killed run keeps what it logged, as metrics.jsonl does


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
    """The eval τ table as scalars under ``log_dir``; returns the directory."""
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
