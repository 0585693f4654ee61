"""The training loop of one data-parallel rank: planner → prefetcher → drafter → optimizer.

Loss normalisation: a step's loss is Σ w·CE / Σ w over every microbatch of every rank. The weight
sum of each microbatch is known before its forward (it depends only on anchors and labels), so the
step's total is all-reduced first and each microbatch backpropagates ``Σ w·CE / total × world``
(DDP averages over ranks). One process with grad_accum = 2 and two processes with grad_accum = 1
therefore compute the same gradient up to float summation order.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_offline.cache.reader import CacheReader
from dflash_offline.drafter.anchors import sample_anchors
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.loss import block_labels, decay_weights
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.train.batch import AnchorRequest, PackedMicrobatch, StepPlan, schedule_for_rank
from dflash_offline.train.checkpoint import (
    TrainState,
    list_checkpoints,
    load_latest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash_offline.train.config import TrainConfig, check_resume
from dflash_offline.train.damaged import DamagedLog
from dflash_offline.train.dist import DistInfo, all_reduce_sum, barrier
from dflash_offline.train.interrupt import TrainInterrupted, stop_on_sigint, stop_requested
from dflash_offline.train.metrics import MetricsLog, StepAccumulator, StepMetrics
from dflash_offline.train.model_setup import DrafterSetup, build_drafter_setup
from dflash_offline.train.planner import LengthMixingPlanner
from dflash_offline.train.prefetch import Prefetcher, RowReader
from dflash_offline.train.snapshot import load_snapshot, save_snapshot, take_snapshot


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    """What a finished (or stopped) run reports."""

    global_step: int
    total_steps: int
    final_loss: float | None
    export_dir: Path | None
    seconds: float


def seed_everything(seed: int, *, deterministic: bool) -> None:
    """The one determinism switch: seeds and deterministic kernels (a refactor must not change the
    loss curve under it)."""
    import os
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def cosine_with_warmup(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warm-up over ``warmup_ratio`` of the steps, then cosine decay to 0."""
    warmup = max(1, round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def to_drafter_inputs(batch: PackedMicrobatch) -> DrafterInputs:
    return DrafterInputs(
        input_ids_T=batch.input_ids_T,
        features_TF=batch.features_TF,
        loss_mask_T=batch.loss_mask_T,
        doc_ids_T=batch.doc_ids_T,
        positions_T=batch.positions_T,
        anchors_A=batch.anchors_A,
    )


def loss_weight(inputs: DrafterInputs, config: DrafterConfig) -> torch.Tensor:
    """Σ w_k·m of one microbatch (float64 scalar on its device), computed before the forward."""
    if inputs.num_anchors == 0:
        return torch.zeros((), dtype=torch.float64, device=inputs.anchors_A.device)
    labels = block_labels(
        inputs.input_ids_T, inputs.loss_mask_T, inputs.doc_ids_T, inputs.anchors_A, config.block_size
    )
    w_B = decay_weights(config.block_size, config.gamma, device=inputs.anchors_A.device)
    return (labels.valid_AB.to(torch.float64) * w_B.double()[None, :]).sum()


class _StepTracker:
    """Wraps the planner's step stream so the loop can find each step's plan (for ``step_done`` and
    the bucket mix) when its microbatches come out of the prefetcher."""

    def __init__(self, steps: Iterator[StepPlan], limit: int) -> None:
        self._steps = steps
        self._limit = limit
        self.by_global_step: dict[int, StepPlan] = {}

    def __iter__(self) -> Iterator[StepPlan]:
        for step in self._steps:
            if step.global_step >= self._limit:
                return
            self.by_global_step[step.global_step] = step
            yield step


def _steps_of(prefetcher: Prefetcher) -> Iterator[list[PackedMicrobatch]]:
    """Group the prefetcher's microbatches into this rank's steps."""
    current: list[PackedMicrobatch] = []
    for batch in prefetcher:
        current.append(batch)
        if batch.step.is_last_in_step:
            yield current
            current = []
    assert not current, "the prefetcher ended inside a step"


def _prepare_snapshot(config: TrainConfig, reader: CacheReader, info: DistInfo) -> Any:
    """The run's sample set: taken at the first start by rank 0 and saved; reloaded on resume."""
    path = config.out_dir / "snapshot.parquet"
    taken = None
    if info.is_main and not path.exists():
        taken = take_snapshot(reader)
        save_snapshot(taken, path)
    barrier(info)
    # The rank that just took it keeps it (bound to this reader already): re-reading, re-sorting and
    # re-binding a million ids cost seconds before the first step. Everyone else loads the saved one.
    return taken if taken is not None else load_snapshot(path, reader)


def _feature_scale(config: TrainConfig, reader: CacheReader, snapshot: Any, info: DistInfo) -> torch.Tensor:
    """The run's feature scale: computed by rank 0 at the first start and saved; reloaded on resume."""
    from dflash_offline.train.feature_scale import (
        FEATURE_SCALE_FILE,
        compute_feature_scale,
        load_feature_scale,
        save_feature_scale,
    )

    if info.is_main and not (config.out_dir / FEATURE_SCALE_FILE).exists():
        fp = reader.fingerprint
        scale = compute_feature_scale(
            reader,
            snapshot.reader_rows_N,
            num_layers=len(fp.layer_ids),
            feature_width=fp.feature_width,
            mode=config.feature_scale,
            seed=config.seed,
        )
        save_feature_scale(scale, config.out_dir, mode=config.feature_scale)
    barrier(info)
    return load_feature_scale(config.out_dir)


def train_rank(
    config: TrainConfig,
    info: DistInfo,
    *,
    reader: RowReader | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> TrainResult:
    """Train on this rank until ``max_steps`` or the end of ``epochs``; checkpoint and export on rank 0.

    ``reader`` replaces the cache reader for the features (a test feeds live target features)."""
    start_time = time.perf_counter()
    seed_everything(config.seed, deterministic=config.deterministic)
    resume_notes = _check_resume(config)
    if info.is_main:
        for note in resume_notes:
            print(f"dflash train: {note}", file=sys.stderr, flush=True)
        config.out_dir.mkdir(parents=True, exist_ok=True)
        (config.out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    on_damaged = DamagedLog(config.out_dir, rank=info.rank) if config.on_damaged == "skip" else None
    # Every sample is re-checksummed as it is read (≈ 12 GB/s a core; bench/RESULTS.md has the cost).
    cache_reader = CacheReader.open(
        config.cache_dir, num_threads=config.loader_threads, check_checksums=True, on_damaged=on_damaged
    )
    try:
        with stop_on_sigint(second_aborts=not info.distributed):
            snapshot = _prepare_snapshot(config, cache_reader, info)
            setup = build_drafter_setup(config, cache_reader.fingerprint, device=info.device)
            if config.feature_scale != "none":
                setup.model.set_feature_scale(_feature_scale(config, cache_reader, snapshot, info))
            return _train(config, info, setup, snapshot, reader or cache_reader, on_step, start_time)
    finally:
        cache_reader.close()


def _check_resume(config: TrainConfig) -> list[str]:
    """Against the previous run's config.json (when there is a checkpoint to resume): refuse a changed
    shape option, announce applied ones."""
    previous_path = config.out_dir / "config.json"
    if config.resume != "auto" or not list_checkpoints(config.out_dir) or not previous_path.is_file():
        return []
    try:
        previous = json.loads(previous_path.read_text())
    except (OSError, json.JSONDecodeError):
        return []  # written by rank 0 right now, or damaged: the checkpoint's own checks still apply
    return check_resume(previous, config)


def _stop_agreed(info: DistInfo) -> bool:
    """True on every rank when any rank was asked to stop (one scalar all-reduce a step)."""
    flag = stop_requested()
    if not info.distributed:
        return flag
    total = all_reduce_sum(torch.tensor([1.0 if flag else 0.0], device=info.device), info)
    return bool(total.item() > 0)


def _train(
    config: TrainConfig,
    info: DistInfo,
    setup: DrafterSetup,
    snapshot: Any,
    reader: RowReader,
    on_step: Callable[[StepMetrics], None] | None,
    start_time: float,
) -> TrainResult:
    model: DFlashDrafter = setup.model
    drafter_config = model.config
    ddp_model: nn.Module = model
    if info.distributed:
        ddp_model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
            broadcast_buffers=False,  # the frozen head is a (large) buffer: never re-broadcast it
        )
    params = model.trainable_parameters()
    optimizer: torch.optim.Optimizer
    if config.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    planner = LengthMixingPlanner(
        snapshot,
        seed=config.seed,
        tokens_per_microbatch=config.tokens_per_microbatch,
        grad_accum=config.grad_accum,
        world_size=info.world_size,
    )
    total_steps = planner.total_steps(config.epochs)
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(total_steps, config.warmup_ratio)
    )

    state = load_latest_checkpoint(config.out_dir, is_main=info.is_main) if config.resume == "auto" else None
    tokens_seen = 0
    if state is not None:
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        # Unconditionally (bit-identical when nothing changed), so that every rank decides alike.
        _apply_optimizer_options(config, optimizer, scheduler, total_steps)
        planner.load_state_dict(state.planner, allow_topology_change=config.allow_topology_change)
        set_rng_state(state.rng)
        tokens_seen = state.tokens_seen
    global_step = planner.position[2]
    if state is None and config.export_initial and info.is_main:
        from dflash_offline.drafter.export import export_drafter

        export_drafter(model, config.out_dir / "drafter-initial")
    metrics_log = (
        MetricsLog(
            config.out_dir / "metrics.jsonl",
            resume_from_step=global_step,
            tensorboard_dir=config.resolved_tensorboard_dir(),
        )
        if info.is_main
        else None
    )
    tracker = _StepTracker(planner.iterate(config.epochs), total_steps)
    jobs = schedule_for_rank(tracker, rank=info.rank, seed=config.seed, reader_rows_N=snapshot.reader_rows_N)
    num_anchors = drafter_config.num_anchors

    def anchor_fn(request: AnchorRequest) -> torch.Tensor:
        return sample_anchors(
            request.loss_mask_T,
            request.doc_ids_T,
            num_anchors=num_anchors,
            generator=request.generator,
            max_total=num_anchors,
        )

    progress = _progress_bar(config, info, total_steps, global_step)
    use_bf16 = config.autocast == "bf16" or (config.autocast == "auto" and info.device.type == "cuda")
    autocast = (
        torch.autocast(info.device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    )
    last_loss: float | None = None
    try:
        with Prefetcher(
            reader,
            jobs,
            device=info.device,
            prefetch=max(config.prefetch, config.grad_accum),
            num_threads=config.loader_threads,
            anchor_fn=anchor_fn,
        ) as prefetcher:
            step_start = time.perf_counter()
            for batches in _steps_of(prefetcher):
                step_plan = tracker.by_global_step.pop(batches[0].step.global_step)
                inputs = [to_drafter_inputs(b) for b in batches]
                weights = [
                    loss_weight(x, drafter_config) * (0.0 if b.plan.is_padding else 1.0)
                    for x, b in zip(inputs, batches, strict=True)
                ]
                total_weight = all_reduce_sum(torch.stack(weights).sum(), info)
                scale = torch.where(total_weight > 0, info.world_size / total_weight.clamp_min(1e-30), 0.0)
                accumulator = StepAccumulator(drafter_config.block_size, info.device)
                for i, (x, batch) in enumerate(zip(inputs, batches, strict=True)):
                    sync = i == len(inputs) - 1 or not info.distributed
                    no_sync = contextlib.nullcontext() if sync else ddp_model.no_sync()  # type: ignore[operator]
                    with no_sync, autocast:
                        out = ddp_model(x, attention=config.attention)
                    factor = scale.float() * (0.0 if batch.plan.is_padding else 1.0)
                    (out.weighted_ce_sum * factor).backward()
                    if not batch.plan.is_padding:
                        accumulator.add(out)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                planner.step_done(step_plan)
                global_step = step_plan.global_step + 1
                tokens_seen += step_plan.num_tokens
                loss, acc_K, tau, blocks = accumulator.reduce(info)
                last_loss = loss
                step_seconds = time.perf_counter() - step_start
                wait = sum(b.data_wait_s for b in batches)
                metrics = StepMetrics(
                    step=global_step,
                    epoch=step_plan.epoch,
                    loss=loss,
                    lr=float(scheduler.get_last_lr()[0]),
                    grad_norm=float(grad_norm),
                    acc_by_position=acc_K,
                    simulated_tau=tau,
                    tokens=step_plan.num_tokens,
                    tokens_per_s=step_plan.num_tokens / step_seconds,
                    step_seconds=step_seconds,
                    data_wait_fraction=wait / step_seconds,
                    buckets=sorted({b for mb in step_plan.microbatches for b in mb.bucket_ids}),
                    num_blocks=blocks,
                )
                if info.is_main:
                    assert metrics_log is not None
                    if global_step % config.log_every == 0 or global_step == total_steps:
                        metrics_log.write(metrics)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(
                            loss=f"{loss:.3f}",
                            acc1=f"{acc_K[0]:.2f}",
                            tau=f"{tau:.2f}",
                            tok_s=f"{metrics.tokens_per_s:,.0f}",
                            wait=f"{metrics.data_wait_fraction:.1%}",
                            refresh=False,
                        )
                if on_step is not None:
                    on_step(metrics)
                saved = global_step % config.checkpoint_every == 0 or global_step == total_steps
                if saved:
                    _checkpoint(config, info, model, optimizer, scheduler, planner, global_step, tokens_seen)
                if global_step < total_steps and _stop_agreed(info):
                    if not saved:
                        _checkpoint(
                            config, info, model, optimizer, scheduler, planner, global_step, tokens_seen
                        )
                    raise TrainInterrupted(global_step)
                step_start = time.perf_counter()
    finally:
        if progress is not None:
            progress.close()
        if metrics_log is not None:
            metrics_log.close()

    export_dir = None
    if config.export_at_end and info.is_main:
        from dflash_offline.drafter.export import export_drafter

        export_dir = export_drafter(model, config.out_dir / "drafter")
    barrier(info)
    return TrainResult(
        global_step=global_step,
        total_steps=total_steps,
        final_loss=last_loss,
        export_dir=export_dir,
        seconds=time.perf_counter() - start_time,
    )


def _apply_optimizer_options(config: TrainConfig, optimizer: Any, scheduler: Any, total_steps: int) -> None:
    """The command line's --lr / --weight-decay / run length over the resumed optimizer and scheduler
    state (which would keep the old values: LambdaLR restores its base_lrs). The same products the
    scheduler computes, so an unchanged resume stays bit-identical."""
    factor = cosine_with_warmup(total_steps, config.warmup_ratio)(scheduler.last_epoch)
    scheduler.base_lrs = [config.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr
        group["lr"] = config.lr * factor
        group["weight_decay"] = config.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _checkpoint(
    config: TrainConfig,
    info: DistInfo,
    model: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    planner: LengthMixingPlanner,
    global_step: int,
    tokens_seen: int,
) -> None:
    if info.is_main:
        save_checkpoint(
            config.out_dir,
            TrainState(
                global_step=global_step,
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                planner=planner.state_dict(),
                rng=rng_state(),
                tokens_seen=tokens_seen,
                world_size=info.world_size,
            ),
            keep=config.keep_checkpoints,
        )
    barrier(info)


def _progress_bar(config: TrainConfig, info: DistInfo, total: int, initial: int) -> Any:
    if not (config.progress and info.is_main):
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc="train", file=sys.stderr, dynamic_ncols=True)
