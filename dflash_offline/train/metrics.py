"""Per-step training metrics: accumulated over a step's microbatches and ranks, logged as JSON lines
and, with a TensorBoard directory, as scalars with these tags:
  train/loss, train/lr, train/grad_norm, train/simulated_tau, train/tokens_per_s, train/step_seconds,
  train/data_wait_fraction, train/acc/pos_01 .. pos_{B−1}       (step = optimizer step)
  val/loss, val/simulated_tau, val/block_tau, val/chain_tau, val/acc/pos_01 ..
                                                                (steps where validation ran)

Shape legend: K = B − 1 block positions that carry loss.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from dflash_offline import strict_json
from dflash_offline import tensorboard as tb
from dflash_offline.config_fields import flag
from dflash_offline.drafter.loss import simulated_acceptance_length
from dflash_offline.drafter.model import DrafterOutput
from dflash_offline.errors import DataError
from dflash_offline.placement import DistInfo
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.dist import all_reduce_sum


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationMetrics:
    """One evaluation of the split, after optimizer step ``step``."""

    step: int
    loss: float
    """Σ w·CE / Σ w over the whole split (the training loss's weighting)."""
    acc_by_position: list[float]
    """[K] greedy accuracy at block positions 1..B−1 over the whole split."""
    simulated_tau: float
    """1 + Σ_k Π_{i≤k} acc_i of those accuracies (the training metric's definition)."""
    block_tau: float
    """1 + the mean over blocks of the leading run of correct positions (within the document): the
    acceptance length of the blocks themselves over every answer position."""
    chain_tau: float
    """Mean over cycles of (accepted + 1) of ``dflash eval``'s anchor rule walked over the drafts at every
    anchor of each turn's first ``--val-chain-tokens`` tokens (train/chain_tau.py): what eval measures
    where its target reproduces the cached answers (1.0 without a cycle). The best export's criterion."""
    chain_cycles: int
    """The cycles ``chain_tau`` averages, over the whole split."""
    chain_tau_by_turn: tuple[float | None, ...] = ()
    """``chain_tau`` of each group of ``chain_tau.TURN_GROUPS`` (a sample's first assistant turn, its second,
    the later ones), as eval reports τ by turn; None for a group without a cycle."""
    num_blocks: int
    num_samples: int
    num_tokens: int
    seconds: float | None = None
    """Wall seconds of the pass, the device synchronized before and after (train/wall_time.py); None where
    the caller did not time it (``val_seconds`` is then left out of the line)."""

    def fields(self) -> dict[str, Any]:
        """The ``val_*`` fields of this evaluation's line in metrics.jsonl."""
        timed = {} if self.seconds is None else {"val_seconds": self.seconds}
        return {
            "val_loss": self.loss,
            "val_acc_by_position": self.acc_by_position,
            "val_simulated_tau": self.simulated_tau,
            "val_block_tau": self.block_tau,
            "val_chain_tau": self.chain_tau,
            "val_chain_cycles": self.chain_cycles,
            "val_chain_tau_by_turn": list(self.chain_tau_by_turn),
            "val_num_blocks": self.num_blocks,
            "val_num_samples": self.num_samples,
            "val_num_tokens": self.num_tokens,
        } | timed


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One line of ``RUN/metrics.jsonl``."""

    step: int
    """Optimizer steps completed, this one included (1-based)."""
    epoch: int
    loss: float
    """Σ w·CE / Σ w over every microbatch of the step on every rank (the step's true loss)."""
    lr: float
    grad_norm: float
    """Total gradient norm before clipping."""
    acc_by_position: list[float]
    """Greedy accuracy at block positions 1..B−1."""
    simulated_tau: float
    """1 + Σ_k Π_{i≤k} acc_i: the acceptance length the accuracies imply (eval's τ convention)."""
    tokens: int
    """Real tokens of the step over all ranks."""
    tokens_per_s: float
    """Training throughput in wall-clock time over the window since the previous read-back of the step
    results (the previous line, or every step with an ``on_step`` caller): the real tokens of the
    window's steps over all ranks ÷ the wall seconds from the end of the previous read-back's sync (the
    first window: the first step's start) to the end of this one's, validation and checkpoints excluded
    (train/throughput.py). Under DDP the tokens are every rank's and the seconds this rank's (rank 0's
    in the file): the whole run's throughput, not one GPU's."""
    step_seconds: float
    """Mean wall seconds a step over the same window (its seconds ÷ its steps), not one step's host time:
    on a GPU the host only queues a step, and the device's time shows at the read-back."""
    data_wait_fraction: float
    """Share of the window's wall seconds (``step_seconds`` × its steps) that this rank waited for the
    prefetcher (rank 0's view): data wait as a share of the training time it could have cost."""
    buckets: list[int]
    """Bucket ids of the step's samples (all ranks)."""
    num_blocks: int
    """Anchors (blocks) trained on in the step, all ranks."""
    validation: ValidationMetrics | None = None
    """The evaluation of the validation split after this step, when one ran (its ``val_*`` fields
    join the line: readers of the training fields see the line they always saw)."""
    startup_seconds: float | None = None
    """On the first line an invocation writes (a resumed run writes one again): wall seconds from the
    command's start to the end of its first optimizer step (``WallSplit.startup_seconds``). None (left
    out of the line) on every other line."""

    def to_json(self) -> str:
        record = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "validation" and not (f.name == "startup_seconds" and self.startup_seconds is None)
        }
        if self.validation is not None:
            record.update(self.validation.fields())
        return strict_json.dumps(record)  # a diverged loss is null, not NaN: see strict_json


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTotals:
    """Loss and accuracies over every microbatch of every rank (``StepAccumulator.totals``)."""

    loss: float
    """Σ w·CE / Σ w (0.0 when the step had no weight)."""
    acc_by_position: list[float]
    """[K] greedy accuracy at block position 1..B−1 (0.0 where no position carried loss)."""
    simulated_tau: float
    """The acceptance length the accuracies imply."""
    num_blocks: int
    """Anchors (blocks) trained on."""
    block_tau: float
    """1 + the mean over blocks of the run of leading positions that carry loss and are correct: the
    acceptance length of the blocks themselves (1.0 without blocks)."""


class StepAccumulator:
    """Sums microbatch outputs on the device (no host sync: ``pack`` gives the sums as one tensor, to
    all-reduce and read when needed, ``totals`` turns the read values into ``StepTotals``)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self._sums = torch.zeros(4, dtype=torch.float64, device=device)  # ce, weight, blocks, prefix
        self._correct_K = torch.zeros(block_size - 1, dtype=torch.float64, device=device)
        self._total_K = torch.zeros(block_size - 1, dtype=torch.float64, device=device)

    def add(self, out: DrafterOutput) -> None:
        self._sums[0] += out.weighted_ce_sum.detach().double()
        self._sums[1] += out.weight_sum.detach().double()
        self._sums[2] += out.num_blocks
        self._sums[3] += out.accepted_prefix_sum.double()
        self._correct_K += out.correct_K.double()
        self._total_K += out.total_K.double()

    def pack(self) -> torch.Tensor:
        """float64 [4 + 2K] on the device: Σ ce, Σ w, blocks, Σ accepted prefix, correct_K, total_K."""
        return torch.cat([self._sums, self._correct_K, self._total_K])

    @staticmethod
    def totals(values: list[float], block_size: int) -> StepTotals:
        """``StepTotals`` of ``pack()``'s values (summed over ranks), read back to the host."""
        k = block_size - 1
        ce, weight, blocks, prefix = values[:4]
        correct_K, total_K = values[4 : 4 + k], values[4 + k : 4 + 2 * k]
        acc_K = [c / t if t > 0 else 0.0 for c, t in zip(correct_K, total_K, strict=True)]
        # τ from the float32 accuracies, as the metrics have always been computed.
        tau = float(simulated_acceptance_length(torch.tensor(acc_K, dtype=torch.float64).float()))
        return StepTotals(
            loss=ce / weight if weight > 0 else 0.0,
            acc_by_position=acc_K,
            simulated_tau=tau,
            num_blocks=int(blocks),
            block_tau=1.0 + prefix / blocks if blocks > 0 else 1.0,
        )

    def reduce(self, info: DistInfo) -> StepTotals:
        """The totals over all ranks now (one all-reduce, one host sync)."""
        packed = all_reduce_sum(self.pack(), info)
        return self.totals(packed.tolist(), self._correct_K.numel() + 1)


STEP_SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "simulated_tau",
    "tokens_per_s",
    "step_seconds",
    "data_wait_fraction",
)
"""``StepMetrics`` fields written as ``train/<field>``; ``acc_by_position`` goes to ``train/acc/pos_NN``."""


def step_scalars(metrics: StepMetrics) -> dict[str, float]:
    """Tag -> value of one training step."""
    scalars = {f"train/{name}": float(getattr(metrics, name)) for name in STEP_SCALARS}
    for k, acc in enumerate(metrics.acc_by_position, start=1):
        scalars[f"train/acc/pos_{k:02d}"] = float(acc)
    val = metrics.validation
    if val is not None:
        scalars.update(
            {
                "val/loss": val.loss,
                "val/simulated_tau": val.simulated_tau,
                "val/block_tau": val.block_tau,
                "val/chain_tau": val.chain_tau,
            }
        )
        for k, acc in enumerate(val.acc_by_position, start=1):
            scalars[f"val/acc/pos_{k:02d}"] = float(acc)
        for k, tau in enumerate(val.chain_tau_by_turn, start=1):
            if tau is not None:  # turn 1, 2, 3 and later (chain_tau.TURN_GROUPS)
                scalars[f"val/chain_tau_turn_{k}"] = tau
    return scalars


def write_step(writer: Any, metrics: StepMetrics) -> None:
    for tag, value in step_scalars(metrics).items():
        writer.add_scalar(tag, value, global_step=metrics.step)
    writer.flush()  # a killed run keeps what it logged, as metrics.jsonl does


class MetricsLog:
    """Appends ``StepMetrics`` lines; on resume, drops lines of steps after the checkpoint so that the
    file reads as one uninterrupted run. With ``tensorboard_dir``, each line also goes to TensorBoard
    (``write_step``: the same values, one place)."""

    def __init__(self, path: Path, *, resume_from_step: int, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        if path.exists():
            kept = [
                line for line, record in _parse_lines(path) if int(record.get("step", 0)) <= resume_from_step
            ]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self._file = open(path, "a")  # noqa: SIM115 (held open for the whole run)
        self._tb = (
            None
            if tensorboard_dir is None
            else tb.open_writer(tensorboard_dir, purge_step=resume_from_step + 1)
        )

    def write(self, metrics: StepMetrics) -> None:
        try:
            self._file.write(metrics.to_json() + "\n")
            self._file.flush()
        except OSError as e:
            from dflash_offline.train.checkpoint import CheckpointNoSpaceError, is_no_space

            if is_no_space(e, self.path.parent):
                raise CheckpointNoSpaceError(self.path) from None
            raise
        if self._tb is not None:
            write_step(self._tb, metrics)

    def close(self) -> None:
        # A flush a full disk refused was already reported by write().
        with contextlib.suppress(OSError):
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every complete line. A last line that does not parse (cut by a kill or a
    full disk mid-write) is dropped, as regenerate's JSONL repair does; a bad line before the last
    means the file is not one this command wrote."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    out = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise DataError(
                f"{path}:{number} is not valid JSON ({e}): not a metrics file dflash train wrote; "
                f"move it aside or train into another {flag(TrainConfig, 'out_dir')}"
            ) from e
        if isinstance(record, dict):
            out.append((line, record))
    return out


def read_metrics(path: Path) -> list[dict[str, object]]:
    """Every line of ``RUN/metrics.jsonl``: one a logged step (with ``val_*`` fields where the
    validation split was evaluated after it)."""
    return [record for _line, record in _parse_lines(path)]


def recorded_loss(path: Path, *, step: int) -> float | None:
    """The loss of the last line at or before ``step`` in ``RUN/metrics.jsonl`` (None without one)."""
    if not path.is_file():
        return None
    losses = [r["loss"] for _line, r in _parse_lines(path) if "loss" in r and int(r.get("step", 0)) <= step]
    return recorded_number(losses[-1]) if losses else None


def recorded_number(value: object) -> float:
    """A number read from a metrics line: ``null`` is what a NaN or infinite value was written as
    (``strict_json``), and reads back as NaN."""
    return math.nan if value is None else float(value)  # type: ignore[arg-type]


def validation_records(records: list[dict[str, object]]) -> list[dict[str, object]]:
    """The lines that carry a validation evaluation."""
    return [r for r in records if "val_simulated_tau" in r]
