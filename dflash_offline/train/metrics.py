"""What a training run measures: per-step sums over ranks, the metrics log, the throughput and where
the wall time goes."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from dflash_offline import strict_json
from dflash_offline import tensorboard as tb
from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.loss import simulated_acceptance_length
from dflash_offline.drafter.model import DrafterOutput
from dflash_offline.errors import DataError, NoSpaceError, is_no_space
from dflash_offline.placement import DistInfo
from dflash_offline.train.config import TrainConfig

# ─── Wall time ──────────────────────────────────────────────────────────────────────────────────────────────
# Where a training run's wall time goes: start-up, steps, validation, checkpoints and exports.
#
# The throughput window (train/metrics.py) measures the steps alone; a run also spends time before its
# first step (cache and snapshot, model build, the resumed checkpoint, ``--compile``'s warm-up inside the
# first step), in validations and in checkpoints and exports. ``WallClock`` times those parts on rank 0's
# host, synchronizing the device at each boundary so that the work queued before it counts where it was
# queued, and ``WallSplit`` is what the run reports once at its end (``dflash train``'s summary line).
#
# The clock is the wall clock (``time.time``), not ``perf_counter``: a spawned rank's start-up counts from
# its launcher's start (``RankTask.started_at``), and only the wall clock is shared between processes.


Part = Literal["validation", "checkpoint"]
"""A pause of the steps: a validation pass, or a checkpoint or export (the best drafter's included)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WallSplit:
    """The wall seconds of one ``dflash train`` invocation, by what they were spent on (rank 0's host).

    ``startup + steps + validation + checkpoint + other == total``."""

    total_seconds: float
    """From the command's start (``started_at``) to the end of the run, the final export included."""
    startup_seconds: float | None
    """From the command's start to the end of this invocation's first optimizer step (device synchronized):
    cache, snapshot, model, the resumed checkpoint, and the first step with its ``--compile`` warm-up.
    None when no step ran (a finished or early-stopped run resumed)."""
    step_seconds: float
    """The other steps: from the end of the first to the end of the last, validations and checkpoints
    between them left out (data waits included: they are the steps' cost)."""
    num_steps: int
    """Optimizer steps this invocation ran (the first included)."""
    validation_seconds: float
    """Validation passes (``val_seconds`` summed)."""
    num_validations: int
    checkpoint_seconds: float
    """Checkpoints, the best-drafter exports after validations, and the export at the end."""

    @property
    def other_seconds(self) -> float:
        """What no part claims: the set-up of a run that ran no step, the prefetcher's shutdown, …"""
        parts = (self.startup_seconds or 0.0) + self.step_seconds + self.validation_seconds
        return self.total_seconds - parts - self.checkpoint_seconds

    def describe(self) -> str:
        """One line for the end-of-run summary."""
        mean = f"{self.step_seconds / (self.num_steps - 1):.3f} s a step, " if self.num_steps > 1 else ""
        startup = "no step ran" if self.startup_seconds is None else f"{self.startup_seconds:.1f} s start-up"
        return (
            f"wall time {self.total_seconds:.1f} s: {startup} (to the end of the first step), "
            f"{self.step_seconds:.1f} s in {max(self.num_steps - 1, 0)} more steps ({mean}validation "
            f"and checkpoints excluded), {self.validation_seconds:.1f} s in {self.num_validations} "
            f"validations, {self.checkpoint_seconds:.1f} s in checkpoints and exports, "
            f"{self.other_seconds:.1f} s other"
        )


@dataclass(kw_only=True, slots=True)
class Lap:
    """The seconds of one timed part (set when its ``with`` block ends)."""

    seconds: float = 0.0


class WallClock:
    """Times a run's parts (module docstring). ``clock``: seconds since the epoch (a test's fake clock);
    ``device``: synchronized before each reading, so that queued device work counts where it was queued."""

    def __init__(
        self, *, started_at: float, device: torch.device, clock: Callable[[], float] | None = None
    ) -> None:
        self._started_at = started_at
        self._device = device
        # time.time looked up at each reading (not bound here): a test's patch of the module holds.
        self._clock = clock if clock is not None else lambda: time.time()
        self._first_step_end: float | None = None
        self._steps_end: float | None = None
        self._num_steps = 0
        self._seconds: dict[Part, float] = {"validation": 0.0, "checkpoint": 0.0}
        self._in_steps: dict[Part, float] = {"validation": 0.0, "checkpoint": 0.0}
        """The part of ``_seconds`` spent between the first step's end and the last step's."""
        self._num_validations = 0

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return self._clock()

    def step_done(self) -> None:
        """An optimizer step was queued; the first one's end (one device sync) ends the start-up."""
        self._num_steps += 1
        if self._first_step_end is None:
            self._first_step_end = self._now()

    @property
    def startup_seconds(self) -> float | None:
        """The start-up (``WallSplit.startup_seconds``) once the first step ended, else None."""
        return None if self._first_step_end is None else self._first_step_end - self._started_at

    def steps_ended(self) -> None:
        """The last step of this invocation ran (or none will)."""
        if self._steps_end is None:
            self._steps_end = self._now() if self._first_step_end is not None else self._clock()

    @contextlib.contextmanager
    def timed(self, part: Part) -> Iterator[Lap]:
        """Time a validation pass or a checkpoint/export; the yielded ``Lap`` holds its seconds after."""
        lap = Lap()
        began = self._now()
        try:
            yield lap
        finally:
            lap.seconds = self._now() - began
            self._seconds[part] += lap.seconds
            if self._first_step_end is not None and self._steps_end is None:
                self._in_steps[part] += lap.seconds
            if part == "validation":
                self._num_validations += 1

    def split(self) -> WallSplit:
        """The run's split, now that it ends (after its final export)."""
        end = self._clock()
        steps = 0.0
        if self._first_step_end is not None:
            steps_end = self._steps_end if self._steps_end is not None else end
            steps = steps_end - self._first_step_end - sum(self._in_steps.values())
        return WallSplit(
            total_seconds=end - self._started_at,
            startup_seconds=self.startup_seconds,
            step_seconds=steps,
            num_steps=self._num_steps,
            validation_seconds=self._seconds["validation"],
            num_validations=self._num_validations,
            checkpoint_seconds=self._seconds["checkpoint"],
        )


# ─── Throughput ─────────────────────────────────────────────────────────────────────────────────────────────
# The training throughput ``dflash train`` logs: wall-clock, over the window between two read-backs of
# the step results.
#
# On a GPU a step's call returns once the host has queued its work; the device catches up at the next
# read-back (a host sync: a log step, a validation, the last step). One step's host time is therefore not
# its cost, and a window of steps is measured instead: from the end of the previous read-back (after its
# sync; the first window from the first step's start) to the end of this one (after its sync), less the
# time the loop spent validating or checkpointing in between (the training's throughput, not the
# pipeline's).


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowThroughput:
    """The steps of one window, measured at the read-back that closes it."""

    num_steps: int
    """Optimizer steps in the window (≥ 1)."""
    tokens: int
    """Real tokens of those steps, over all ranks (``StepPlan.num_tokens``)."""
    seconds: float
    """Wall seconds of the window, validation and checkpoints excluded."""
    data_wait_s: float
    """Seconds this rank waited for the prefetcher in the window."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_seconds(self) -> float:
        """Mean wall seconds a step."""
        return self.seconds / self.num_steps

    @property
    def data_wait_fraction(self) -> float:
        """Share of the window's wall time spent waiting for the prefetcher."""
        return self.data_wait_s / self.seconds


class ThroughputWindow:
    """Accumulates the steps since the last read-back; ``close`` measures them and opens the next window.

    Reads ``time.perf_counter``. ``device``: the device the steps run on, synchronized before a pause so
    that the steps queued before it count as training time."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._start: float | None = None
        self._paused_s = 0.0
        self._num_steps = 0
        self._tokens = 0
        self._data_wait_s = 0.0

    def start(self) -> None:
        """The first step starts now."""
        self._open(time.perf_counter())

    def add_step(self, *, tokens: int, data_wait_s: float) -> None:
        """A step of ``tokens`` tokens ran; this rank waited ``data_wait_s`` for its microbatches."""
        self._num_steps += 1
        self._tokens += tokens
        self._data_wait_s += data_wait_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is left out of the window (a validation, a checkpoint)."""
        if self._device.type == "cuda":
            # The steps queued so far are training: let the device finish them on the window's clock.
            torch.cuda.synchronize(self._device)
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - began

    def close(self) -> WindowThroughput:
        """Measure the window's steps (call right after the read-back's sync) and open the next window."""
        assert self._start is not None, "close() before start()"
        assert self._num_steps > 0, "close() before a step"
        now = time.perf_counter()
        window = WindowThroughput(
            num_steps=self._num_steps,
            tokens=self._tokens,
            # A coarse clock may not have moved: never divide by zero.
            seconds=max(now - self._start - self._paused_s, 1e-9),
            data_wait_s=self._data_wait_s,
        )
        self._open(now)
        return window

    def _open(self, now: float) -> None:
        self._start = now
        self._paused_s = 0.0
        self._num_steps = 0
        self._tokens = 0
        self._data_wait_s = 0.0


# ─── Sums over ranks ────────────────────────────────────────────────────────────────────────────────────────


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """In-place sum over ranks (a no-op single-process); returns the tensor."""
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


# ─── Per-step metrics ───────────────────────────────────────────────────────────────────────────────────────
# Per-step training metrics: accumulated over a step's microbatches and ranks, logged as JSON lines
# and, with a TensorBoard directory, as scalars with these tags:
#   train/loss, train/lr, train/grad_norm, train/simulated_tau, train/tokens_per_s, train/step_seconds,
#   train/data_wait_fraction, train/acc/pos_01 .. pos_{B−1}       (step = optimizer step)
#   val/loss, val/simulated_tau, val/block_tau, val/chain_tau, val/acc/pos_01 ..
#                                                                 (steps where validation ran)
#
# Shape legend: K = B − 1 block positions that carry loss.


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
    anchor of each turn's first ``--val-chain-tokens`` tokens (train/validation.py): what eval measures
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
    """Wall seconds of the pass, the device synchronized before and after (train/metrics.py); None where
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
    (train/metrics.py). Under DDP the tokens are every rank's and the seconds this rank's (rank 0's
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
            if is_no_space(e, self.path.parent):
                raise NoSpaceError(self.path) from None
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
                f"move it aside or train into another {field_ref(TrainConfig, 'out_dir')}"
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
