"""The trainer: the loop of one data-parallel rank, where a step's numbers go, and Ctrl-C (the ranks are
started by train/launch.py)."""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_offline import interrupt
from dflash_offline.cache.reader import CacheReader
from dflash_offline.config_fields import field_ref
from dflash_offline.interrupt import stop_requested
from dflash_offline.placement import DistInfo, barrier
from dflash_offline.train.checkpoint import (
    NonFiniteStep,
    TrainState,
    check_weights_finite,
    checkpoint_to_resume,
    diverged_error,
    first_nonfinite,
    rng_state,
    save_checkpoint,
)
from dflash_offline.train.config import TrainConfig, ValidationConfig
from dflash_offline.train.damaged import DamagedLog
from dflash_offline.train.loader import Prefetcher, RowReader
from dflash_offline.train.metrics import (
    Lap,
    MetricsLog,
    Part,
    StepMetrics,
    StepTotals,
    ThroughputWindow,
    ValidationMetrics,
    WallClock,
    WallSplit,
    WindowThroughput,
    all_reduce_sum,
    recorded_loss,
)
from dflash_offline.train.planner import RankSteps, StepPlan
from dflash_offline.train.prepare import (
    Continuation,
    Optimization,
    SegmentStart,
    compiles,
    continue_from_segment,
    prepare_feature_scale,
    prepare_split,
    restore_checkpoint,
    setup_optimization,
    validation_schedule,
    write_config,
)
from dflash_offline.train.snapshot import (
    IndexSnapshot,
    SplitSnapshots,
    save_run_split,
)
from dflash_offline.train.step import (
    DrafterSetup,
    OptimizerStep,
    StepOutcome,
    anchor_sampler,
    autocast_for,
    build_drafter_setup,
    init_weights_from,
    out_of_memory_named,
    seed_everything,
)
from dflash_offline.train.validation import ValidationSchedule

if TYPE_CHECKING:
    from tqdm import tqdm


# ─── Ctrl-C ─────────────────────────────────────────────────────────────────────────────────────────────────
# Ctrl-C during ``dflash train``: finish the step, write a checkpoint, exit 130 (as ``generate`` does).
#
# SIGINT only sets a flag (``dflash_offline.interrupt``); the loop reads it at each step boundary (all
# ranks agree through one tiny all-reduce, so every rank stops after the same step) and raises
# ``TrainInterrupted`` once the checkpoint is on disk. In one process a second Ctrl-C aborts at once;
# spawned DDP workers keep the flag idempotent, since a terminal's Ctrl-C reaches them and the parent
# forwards it again.


class TrainInterrupted(Exception):  # noqa: N818 (not an error: the user asked for it)
    """Training stopped on request after ``step`` with a checkpoint of that step on disk."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"interrupted after step {step}: checkpoint written; rerun the same command to resume"
        )


@contextlib.contextmanager
def stop_on_sigint(*, second_aborts: bool) -> Iterator[None]:
    """Turn SIGINT into a stop request at the next step boundary for the duration (main thread only)."""
    with interrupt.stop_on_sigint(
        "dflash train: stopping after this step (a checkpoint is written first)",
        second_aborts=second_aborts,
        abort_note="abort without it",
    ):
        yield


# ─── Reporting a step ───────────────────────────────────────────────────────────────────────────────────────
# Where a training step's numbers go: ``RUN/metrics.jsonl`` (and TensorBoard), the progress bar and a
# caller's ``on_step``. The step's results stay on the device until a line is due: a log step
# (``--log-every``), a validation, the last step, or every step when someone asked for ``on_step``. The
# throughput of a line is that of the steps since the previous read-back (train/metrics.py).


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
        self._log_every = config.logging.log_every
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
    if not (config.logging.progress and info.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc="train", file=sys.stderr, dynamic_ncols=True)


# ─── The loop of one rank ───────────────────────────────────────────────────────────────────────────────────
# The training loop of one data-parallel rank: planner → prefetcher → drafter → optimizer, with the
# held-out validation split evaluated every ``--val-every`` steps.
#
# The step itself (train/step.py) leaves its results on the device; the loop reads them back (a host
# sync) only where they are needed: at log steps, validations, checkpoints and the last step. Under DDP
# the ranks agree on a stop request at those steps too (one tiny all-reduce and read); a single process
# checks its flag every step at no cost. At each of those read-backs the steps since the previous one are
# checked: a non-finite loss or gradient norm stops the run there, before any checkpoint or export of the
# weights it left (train/checkpoint.py).


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    """What a finished (or stopped) run reports."""

    global_step: int
    total_steps: int
    final_loss: float | None
    export_dir: Path | None
    seconds: float
    best_validation_tau: float | None = None
    """The best validation chain τ (the export in ``export_dir``); None without validation."""
    best_validation_step: int = 0
    stopped_early: bool = False
    """``--early-stop`` ended the run (after a checkpoint)."""
    wall: WallSplit | None = None
    """Where rank 0's wall time went (None where the ranks ran in other processes and sent none)."""


def train_rank(
    config: TrainConfig,
    info: DistInfo,
    *,
    reader: RowReader | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
    started_at: float | None = None,
    segment: SegmentStart | None = None,
) -> TrainResult:
    """Train on this rank until ``max_steps`` or the end of ``epochs``; checkpoint and export on rank 0.

    ``reader`` replaces the cache reader for the features (a test feeds live target features);
    ``started_at``: ``time.time()`` when the command started, where start-up is counted from (None: now);
    ``segment``: the run is a segment of a follow run (train/prepare.py), None for an ordinary run."""
    start_time = time.perf_counter()
    clock = WallClock(started_at=time.time() if started_at is None else started_at, device=info.device)
    seed_everything(config.data.seed, deterministic=config.launch.deterministic)
    if info.is_main:
        config.out_dir.mkdir(parents=True, exist_ok=True)
    on_damaged = DamagedLog(config.out_dir, rank=info.rank) if config.launch.on_damaged == "skip" else None
    # Every sample is re-checksummed as it is read (≈ 12 GB/s a core; bench/RESULTS.md has the cost).
    cache_reader = CacheReader.open(
        config.cache_dir,
        num_threads=config.launch.loader_threads,
        check_checksums=True,
        on_damaged=on_damaged,
    )
    try:
        with stop_on_sigint(second_aborts=not info.distributed):
            split = prepare_split(config, cache_reader, info)
            config, state = checkpoint_to_resume(config, info, split.train)
            if info.is_main:  # after the resume check: a refused resume leaves the run's config as it was
                write_config(config)
                save_run_split(config.out_dir, split)  # what `dflash eval` reads (run_split.py)
            continued = Continuation.start(segment)
            setup = continued.setup or build_drafter_setup(
                config, cache_reader.fingerprint, device=info.device
            )
            if config.drafter.feature_scale != "none":
                setup.model.set_feature_scale(prepare_feature_scale(config, cache_reader, split.train, info))
            if state is None and config.drafter.init_from is not None:
                loaded = init_weights_from(setup.model, config.drafter.init_from)
                if info.is_main:
                    print(
                        f"dflash train: starting from the weights of {config.drafter.init_from} "
                        f"({loaded:,} values)",
                        file=sys.stderr,
                        flush=True,
                    )
            reader = reader or cache_reader
            return _train(config, info, setup, split, state, reader, on_step, start_time, clock, continued)
    finally:
        cache_reader.close()


def _stop_agreed(info: DistInfo) -> bool:
    """True on every rank when any rank was asked to stop (under DDP one scalar all-reduce and read:
    every rank must call it at the same steps)."""
    flag = stop_requested()
    if not info.distributed:
        return flag
    total = all_reduce_sum(torch.tensor([1.0 if flag else 0.0], device=info.device), info)
    return bool(total.item() > 0)


def _train(
    config: TrainConfig,
    info: DistInfo,
    setup: DrafterSetup,
    split: SplitSnapshots,
    state: TrainState | None,
    reader: RowReader,
    on_step: Callable[[StepMetrics], None] | None,
    start_time: float,
    clock: WallClock,
    continued: Continuation,
) -> TrainResult:
    """Set up the optimization (from ``state``, the checkpoint resumed, if any, else from what a follow
    segment continues), train until the end or an early stop, export."""
    opt = setup_optimization(config, info, setup.model, split.train, continued)
    if compiles(config, info.device) and not continued.compiled:
        opt.model.compile_training()
    if state is not None:
        restore_checkpoint(config, info, opt, state)
    elif continued.from_checkpoint is not None:
        continue_from_segment(config, info, opt, continued.from_checkpoint)
    elif config.checkpoint.export_initial and info.is_main:
        from dflash_offline.drafter.export import export_drafter

        export_drafter(opt.model, config.out_dir / "drafter-initial")
    validation = validation_schedule(config, info, split, reader, state)
    stopped_early = _stopped_before_start(info, opt, validation)
    last_loss = None
    if not stopped_early:
        reporter = StepReporter(
            config, info, opt.total_steps, opt.planner.position.global_step, on_step, clock
        )
        try:
            stopped_early = _run_steps(
                config,
                info,
                opt,
                split.train,
                reader,
                reporter,
                validation,
                tokens_seen=0 if state is None else state.tokens_seen,
            )
        finally:
            clock.steps_ended()
            reporter.close()
        last_loss = reporter.last_loss
    if last_loss is None and state is not None and info.is_main:
        # No step ran here (a finished run rerun, or stopped early): the loss the run recorded last.
        last_loss = recorded_loss(config.out_dir / "metrics.jsonl", step=opt.planner.position.global_step)
    with clock.timed("checkpoint"):
        export_dir = _export_at_end(config, info, opt, validation)
    barrier(info)
    if not stopped_early:
        continued.hand_over(
            setup, opt.optimizer, compiled=continued.compiled or compiles(config, info.device)
        )
    tracker = validation.tracker if validation is not None else None
    return TrainResult(
        global_step=opt.planner.position.global_step,
        total_steps=opt.total_steps,
        final_loss=last_loss,
        export_dir=export_dir,
        seconds=time.perf_counter() - start_time,
        best_validation_tau=None if tracker is None else tracker.best_tau,
        best_validation_step=0 if tracker is None else tracker.best_step,
        stopped_early=stopped_early,
        wall=clock.split(),
    )


def _stopped_before_start(info: DistInfo, opt: Optimization, validation: ValidationSchedule | None) -> bool:
    """True (and said once) when the resumed run had already stopped early: no step is left to run."""
    if validation is None or not validation.should_stop():
        return False
    if info.is_main:
        print(
            f"dflash train: {validation.stop_reason()} at step {opt.planner.position.global_step}; nothing "
            f"to do (raise {field_ref(ValidationConfig, 'early_stop')}, or leave it out, to train on)",
            file=sys.stderr,
            flush=True,
        )
    return True


def _export_at_end(
    config: TrainConfig, info: DistInfo, opt: Optimization, validation: ValidationSchedule | None
) -> Path | None:
    """Export the drafter (rank 0, unless ``export_at_end`` is off); the directory of the run's drafter."""
    from dflash_offline.drafter.export import export_drafter

    if not (config.checkpoint.export_at_end and info.is_main):
        return None
    if validation is None:
        return export_drafter(opt.model, config.out_dir / "drafter")
    # RUN/drafter is the best validation chain τ's export (written when it was measured).
    export_drafter(opt.model, config.out_dir / "drafter-last")
    return config.out_dir / "drafter"


def _run_steps(
    config: TrainConfig,
    info: DistInfo,
    opt: Optimization,
    snapshot: IndexSnapshot,
    reader: RowReader,
    reporter: StepReporter,
    validation: ValidationSchedule | None,
    *,
    tokens_seen: int,
) -> bool:
    """Run steps from the planner's position to ``total_steps``; True when ``--early-stop`` ended them.

    Raises ``TrainInterrupted`` (after a checkpoint) when any rank was asked to stop."""
    planned = itertools.takewhile(
        lambda plan: plan.global_step < opt.total_steps, opt.planner.iterate(config.optimizer.epochs)
    )
    steps = RankSteps(
        planned,
        rank=info.rank,
        seed=config.data.seed,
        reader_rows_N=snapshot.reader_rows_N,
        fuse=config.launch.fuse_microbatches,
    )
    per_row = opt.model.config.num_anchors * (
        config.topology.grad_accum if config.launch.fuse_microbatches else 1
    )
    step = _optimizer_step(config, info, opt)
    with Prefetcher(
        reader,
        steps.jobs(),
        device=info.device,
        prefetch=max(config.launch.prefetch, config.topology.grad_accum),
        num_threads=config.launch.loader_threads,
        anchor_fn=anchor_sampler(opt.model.config.num_anchors, per_row=per_row),
        loss_block_size=opt.model.config.block_size,
    ) as prefetcher:
        reporter.start()
        for step_plan, batches in steps.regroup(prefetcher):
            _set_lr(opt.optimizer, config.optimizer.lr * opt.lr_factor(step_plan.global_step))
            with out_of_memory_named(config, info, "a training step"):
                outcome = step([b.inputs for b in batches], [b.plan.is_padding for b in batches])
            reporter.clock.step_done()
            opt.planner.step_done(step_plan)
            tokens_seen += step_plan.num_tokens
            global_step = step_plan.global_step + 1
            reporter.step_ran(
                step_plan,
                outcome,
                lr=config.optimizer.lr * opt.lr_factor(global_step),  # the next step's
                data_wait_s=sum(b.data_wait_s for b in batches),
            )
            validated = None
            if validation is not None and validation.due(global_step, opt.total_steps):
                _stop_if_diverged(config, reporter.check_finite(), global_step)  # before a best export
                with (
                    reporter.paused("validation") as lap,
                    out_of_memory_named(config, info, f"the validation after step {global_step}"),
                ):
                    validated = validation.evaluate(opt.model, global_step)
                validated = replace(validated, seconds=lap.seconds)
                with reporter.paused("checkpoint"):
                    validation.keep_best(opt.model, validated)
            _stop_if_diverged(config, reporter.report(validation=validated), global_step)
            if _stops_after(config, info, opt, reporter, validation, global_step, tokens_seen, validated):
                return True
    return False


def _optimizer_step(config: TrainConfig, info: DistInfo, opt: Optimization) -> OptimizerStep:
    return OptimizerStep(
        model=opt.model,
        ddp_model=opt.ddp_model,
        params=opt.params,
        optimizer=opt.optimizer,
        drafter_config=opt.model.config,
        info=info,
        grad_clip=config.optimizer.grad_clip,
        attention=config.launch.attention,
        autocast=autocast_for(config, info),
    )


def _stops_after(
    config: TrainConfig,
    info: DistInfo,
    opt: Optimization,
    reporter: StepReporter,
    validation: ValidationSchedule | None,
    global_step: int,
    tokens_seen: int,
    validated: ValidationMetrics | None,
) -> bool:
    """After step ``global_step``: checkpoint when one is due; True (after a checkpoint) when
    the early stop ends the run here; raises ``TrainInterrupted`` when any rank was asked to stop."""
    early_stop = validation is not None and validated is not None and validation.should_stop()
    # Under DDP the ranks agree on a stop request where the step's results are read anyway.
    agree = (
        reporter.is_log_step(global_step)
        or validated is not None
        or _is_checkpoint_step(config, opt, global_step)
    )
    _checkpoint_or_stop(
        _CheckpointContext(
            config=config,
            info=info,
            opt=opt,
            reporter=reporter,
            validation=validation,
            global_step=global_step,
            tokens_seen=tokens_seen,
        ),
        checkpoint_now=early_stop,
        check_stop=not early_stop and (agree or not info.distributed),
    )
    if early_stop and info.is_main and validation is not None:
        note = f"{validation.stop_reason()}: stopped after step {global_step}, checkpoint written"
        print(f"dflash train: {note}", file=sys.stderr, flush=True)
    return early_stop


def _is_checkpoint_step(config: TrainConfig, opt: Optimization, global_step: int) -> bool:
    return global_step % config.checkpoint.checkpoint_every == 0 or global_step == opt.total_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class _CheckpointContext:
    """What a checkpoint after one step needs: the run's pieces it saves or checks, and the step."""

    config: TrainConfig
    info: DistInfo
    opt: Optimization
    """The drafter, optimizer and planner whose states are saved."""
    reporter: StepReporter
    """Its throughput leaves the checkpoint's time out; its unread steps are checked for non-finite values."""
    validation: ValidationSchedule | None
    """Its tracker's state is saved (None: a run without validation)."""
    global_step: int
    """Optimizer steps done: the checkpoint's step."""
    tokens_seen: int
    """Tokens trained on up to that step."""


def _checkpoint_or_stop(at: _CheckpointContext, *, checkpoint_now: bool, check_stop: bool) -> None:
    """Checkpoint every ``checkpoint_every`` steps, at the end and when ``checkpoint_now``; with
    ``check_stop``, when any rank was asked to stop, checkpoint (if this step did not) and raise
    ``TrainInterrupted``. A checkpoint's time is left out of the ``reporter``'s throughput."""
    saved = checkpoint_now or _is_checkpoint_step(at.config, at.opt, at.global_step)
    if saved:
        with at.reporter.paused("checkpoint"):
            _checkpoint(at)
    if check_stop and at.global_step < at.opt.total_steps and _stop_agreed(at.info):
        if not saved:
            _checkpoint(at)  # the run ends
        raise TrainInterrupted(at.global_step)


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of the next optimizer step (``--lr`` × the schedule's factor of that step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _stop_if_diverged(config: TrainConfig, bad: NonFiniteStep | None, global_step: int) -> None:
    """Stop the run (every rank: they read the same all-reduced values) at a non-finite step."""
    if bad is not None:
        raise diverged_error(config.out_dir, bad.describe(), step=bad.step, stopped_after=global_step)


def _checkpoint(at: _CheckpointContext) -> None:
    """Save the state after ``at.global_step`` (rank 0), never from non-finite weights: the steps since the
    last read-back are checked first, and the weights themselves."""
    config, opt, validation = at.config, at.opt, at.validation
    _stop_if_diverged(config, at.reporter.check_finite(), at.global_step)
    check_weights_finite(config.out_dir, opt.params, step=at.global_step)
    if at.info.is_main:
        save_checkpoint(
            config.out_dir,
            TrainState(
                global_step=at.global_step,
                model=opt.model.state_dict(),
                optimizer=opt.optimizer.state_dict(),
                planner=opt.planner.state_dict(),
                rng=rng_state(),
                tokens_seen=at.tokens_seen,
                world_size=at.info.world_size,
                validation={} if validation is None else validation.tracker.state_dict(),
            ),
            keep=config.checkpoint.keep_checkpoints,
        )
    barrier(at.info)
