"""Where a training step's numbers go: ``RUN/metrics.jsonl`` (and TensorBoard), the progress bar and a
caller's ``on_step``. The step's results stay on the device until a line is due: a log step
(``--log-every``), a validation, the last step, or every step when someone asked for ``on_step``. The
throughput of a line is that of the steps since the previous read-back (train/throughput.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dflash_offline.placement import DistInfo
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.divergence import NonFiniteStep, first_nonfinite
from dflash_offline.train.metrics import MetricsLog, StepMetrics, StepTotals, ValidationMetrics
from dflash_offline.train.microbatch import StepPlan
from dflash_offline.train.step import StepOutcome
from dflash_offline.train.throughput import ThroughputWindow, WindowThroughput
from dflash_offline.train.wall_time import Lap, Part, WallClock

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass(frozen=True, kw_only=True, slots=True)
class _Pending:
    """A step run since the last read-back: its plan, its results on the device, the LR after it."""

    plan: StepPlan
    outcome: StepOutcome
    lr: float


class StepReporter:
    """Writes metrics lines on rank 0 (every ``log_every`` steps, at validations and at the last step),
    moves the progress bar, and calls ``on_step`` on every rank (which reads every step). Owns the
    throughput window and the run's ``WallClock``: the loop calls ``start`` before the first step and runs
    validations and checkpoints inside ``paused()``, which also times them on the clock."""

    def __init__(
        self,
        config: TrainConfig,
        info: DistInfo,
        total_steps: int,
        global_step: int,
        on_step: Callable[[StepMetrics], None] | None,
        clock: WallClock,
    ) -> None:
        self._log_every = config.log_every
        self._total_steps = total_steps
        self._on_step = on_step
        self._log = (
            MetricsLog(
                config.out_dir / "metrics.jsonl",
                resume_from_step=global_step,
                tensorboard_dir=config.resolved_tensorboard_dir(),
            )
            if info.is_main
            else None
        )
        self._progress = _progress_bar(config, info, total_steps, global_step)
        self._window = ThroughputWindow(info.device)
        self.clock = clock
        self._startup_logged = False
        self.last_loss: float | None = None
        """The loss of the last step read back."""
        self._pending: list[_Pending] = []
        """The steps run since the last read-back (their results still on the device)."""
        self._last_read: tuple[_Pending, tuple[StepTotals, float]] | None = None
        """The last step read back whose line is not written yet (read before its validation)."""

    def is_log_step(self, step: int) -> bool:
        return step % self._log_every == 0 or step == self._total_steps

    def start(self) -> None:
        """The first step starts now (the first throughput window opens)."""
        self._window.start()

    @contextlib.contextmanager
    def paused(self, part: Part) -> Iterator[Lap]:
        """Time spent inside (a validation, a checkpoint) is left out of the throughput and counted as
        ``part`` on the clock; the ``Lap`` holds its seconds after."""
        with self._window.paused(), self.clock.timed(part) as lap:
            yield lap

    def step_ran(self, plan: StepPlan, outcome: StepOutcome, *, lr: float, data_wait_s: float) -> None:
        """Step ``plan`` ran and computed ``outcome`` (left on the device); ``lr`` is the learning rate after
        it (what the next step uses), ``data_wait_s`` the seconds this rank waited for its microbatches."""
        if self._progress is not None:
            self._progress.update(1)
        self._window.add_step(tokens=plan.num_tokens, data_wait_s=data_wait_s)
        self._pending.append(_Pending(plan=plan, outcome=outcome, lr=lr))

    def report(self, *, validation: ValidationMetrics | None = None) -> NonFiniteStep | None:
        """Write the line of the step that ran last when it is due (its ``validation`` joins it). At a
        read-back, the first step since the previous one whose loss or gradient norm is not finite, its
        line written (the caller stops the run); else None."""
        last = self._pending[-1] if self._pending else None
        if last is None and self._last_read is not None:
            last = self._last_read[0]  # read already, by check_finite before its validation
        if last is None:
            return None
        due = self.is_log_step(last.plan.global_step + 1) or validation is not None
        if not due and self._on_step is None:
            return None
        bad = self.check_finite()  # the host sync that ends the window (none when read already)
        if bad is not None:
            return bad
        assert self._last_read is not None
        pending, (totals, grad_norm) = self._last_read
        self._last_read = None
        window = self._window.close()
        metrics = step_metrics(
            pending.plan, totals, grad_norm=grad_norm, lr=pending.lr, window=window, validation=validation
        )
        self._publish(metrics, due=due)
        return None

    def check_finite(self) -> NonFiniteStep | None:
        """Before a validation or a checkpoint (and at each line): read the steps run since the last
        read-back (one host sync, none when there are none); the first whose loss or gradient norm is not
        finite, its line written; None when all are finite."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        read = list(zip(pending, StepOutcome.read_all([p.outcome for p in pending]), strict=True))
        self._last_read = read[-1]
        return self._nonfinite(read)

    def _nonfinite(self, read: list[tuple[_Pending, tuple[StepTotals, float]]]) -> NonFiniteStep | None:
        """The first of the ``read`` steps with a non-finite loss or gradient norm, its line written
        whatever ``--log-every`` says (a plot finds where the loss stopped being finite); else None."""
        bad = first_nonfinite([(p.plan.global_step + 1, t.loss, g) for p, (t, g) in read])
        if bad is not None:
            pending, (totals, grad_norm) = next(r for r in read if r[0].plan.global_step + 1 == bad.step)
            window = self._window.close()
            metrics = step_metrics(pending.plan, totals, grad_norm=grad_norm, lr=pending.lr, window=window)
            self._publish(metrics, due=True)
        return bad

    def _publish(self, metrics: StepMetrics, *, due: bool) -> None:
        """Write ``metrics`` (when ``due``), show it on the progress bar, hand it to ``on_step``."""
        self.last_loss = metrics.loss
        if self._log is not None and due:
            if not self._startup_logged:  # the invocation's first line: when its start-up ended
                metrics = replace(metrics, startup_seconds=self.clock.startup_seconds)
                self._startup_logged = True
            self._log.write(metrics)
        if self._progress is not None:
            postfix: dict[str, str] = {
                "loss": f"{metrics.loss:.3f}",
                "acc1": f"{metrics.acc_by_position[0]:.2f}",
                "tau": f"{metrics.simulated_tau:.2f}",
                "tok_s": f"{metrics.tokens_per_s:,.0f}",
                "wait": f"{metrics.data_wait_fraction:.1%}",
            }
            if metrics.validation is not None:
                postfix["val_chain_tau"] = f"{metrics.validation.chain_tau:.2f}"
            self._progress.set_postfix(postfix, refresh=False)
        if self._on_step is not None:
            self._on_step(metrics)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._log is not None:
            self._log.close()


def step_metrics(
    plan: StepPlan,
    totals: StepTotals,
    *,
    grad_norm: float,
    lr: float,
    window: WindowThroughput,
    validation: ValidationMetrics | None = None,
) -> StepMetrics:
    """The metrics line of step ``plan`` (its ``totals`` read back), with the throughput of ``window``,
    the steps since the previous read-back up to this one."""
    return StepMetrics(
        step=plan.global_step + 1,
        epoch=plan.epoch,
        loss=totals.loss,
        lr=lr,
        grad_norm=grad_norm,
        acc_by_position=totals.acc_by_position,
        simulated_tau=totals.simulated_tau,
        tokens=plan.num_tokens,
        tokens_per_s=window.tokens_per_s,
        step_seconds=window.step_seconds,
        data_wait_fraction=window.data_wait_fraction,
        buckets=sorted({b for mb in plan.microbatches for b in mb.bucket_ids}),
        num_blocks=totals.num_blocks,
        validation=validation,
    )


def _progress_bar(config: TrainConfig, info: DistInfo, total: int, initial: int) -> tqdm[Any] | None:
    if not (config.progress and info.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc="train", file=sys.stderr, dynamic_ncols=True)
