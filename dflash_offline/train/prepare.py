"""What a rank prepares before its first step: the run's samples and their validation split (taken at the
first start and saved, reloaded on resume), its feature scale and ``RUN/config.json``; and the
optimization — the DDP wrapper, optimizer, sample planner and learning-rate schedule — built fresh,
restored from the checkpoint resumed, or continued from the previous segment of a follow run.

What one segment of a follow run (``WindowConfig.follow``) continues from (docs/follow.md, last part
below): the run's one learning rate schedule, the segment's place in the run's global steps, and the
drafter and optimizer kept alive in the process from one segment to the next.

A follow run trains its segments as one optimization: segment k starts from segment k-1's last training
state (weights, optimizer state, global step), not from an exported drafter. In one process the live
objects are handed over (``LiveTraining``), so the drafter is built, and compiled, once; a restarted
process loads the previous segment's final checkpoint instead."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_offline.cache.reader import CacheReader
from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError
from dflash_offline.placement import DistInfo, barrier
from dflash_offline.train.checkpoint import TrainState, load_latest_checkpoint, set_rng_state
from dflash_offline.train.config import DataConfig, TrainConfig
from dflash_offline.train.loader import RowReader
from dflash_offline.train.planner import LengthMixingPlanner
from dflash_offline.train.snapshot import (
    GROUPS_FILE,
    SNAPSHOT_FILE,
    IndexSnapshot,
    SplitSnapshots,
    conversation_groups,
    held_out_of_run,
    load_snapshot,
    read_groups,
    save_groups,
    save_snapshot,
    split_snapshot,
    take_snapshot,
)
from dflash_offline.train.step import DrafterSetup, autocast_for
from dflash_offline.train.validation import ValidationSchedule, Validator

# ─── The run's samples and their validation ─────────────────────────────────────────────────────────────────


# ─── The feature scale ──────────────────────────────────────────────────────────────────────────────────────
# A fixed feature scale computed once from cache statistics, against massive activations.
#
# SmolLM2-135M's captured residual streams have max |x| ≈ 24,800 in a few dimensions (507, 247, 17) at
# every position, per-layer RMS 3–47 (docs/facts.md#features-of-a-real-target): through a randomly
# initialised ``fc`` those few dimensions set the direction of every context vector, so the context starts out
# nearly the same at every position. Dividing each feature by its RMS over a sample of the cache (``dim``) or
# each captured layer by its own RMS (``layer``) puts every input of ``fc`` on the same footing. The scale is
# saved in ``RUN/feature_scale.safetensors`` (a resumed run reuses it) and folded into ``fc.weight`` at
# export, so the exported drafter keeps z-lab's layout and needs no scale at serving time.


FeatureScaleMode = Literal["none", "layer", "dim"]
FEATURE_SCALE_MODES: tuple[str, ...] = ("none", "layer", "dim")
FEATURE_SCALE_FILE = "feature_scale.safetensors"
SAMPLE_TOKENS = 65_536
"""Tokens read for the statistics (streamed: one sample's features in float32 at a time)."""
RMS_FLOOR = 1e-2
"""A dimension's RMS is floored at this fraction of its layer's median RMS, so that a dead dimension
does not get an enormous multiplier."""


def feature_rms(features: Iterable[torch.Tensor], feature_width: int) -> np.ndarray:
    """float64 [F]: root mean square of each feature over all rows of ``features`` ([T_i, F] tensors)."""
    sum_sq = torch.zeros(feature_width, dtype=torch.float64)
    count = 0
    for f in features:
        x = f.float()
        sum_sq += (x * x).sum(0).double()
        count += int(x.shape[0])
    if count == 0:
        raise ConfigError("the cache has no tokens to compute a feature scale from; generate first")
    rms: np.ndarray = np.sqrt(sum_sq.numpy() / count)
    return rms


def scale_from_rms(rms_F: np.ndarray, *, num_layers: int, mode: FeatureScaleMode) -> torch.Tensor:
    """float32 [F] multipliers: 1/RMS per dimension (``dim``) or per captured layer (``layer``)."""
    if mode not in ("layer", "dim"):
        raise ConfigError(f"feature scale mode {mode!r}: expected one of {FEATURE_SCALE_MODES}")
    by_layer = rms_F.reshape(num_layers, -1)
    if mode == "layer":
        layer_rms = np.sqrt((by_layer**2).mean(1, keepdims=True))
        out = np.broadcast_to(1.0 / np.maximum(layer_rms, 1e-12), by_layer.shape)
    else:
        floor = RMS_FLOOR * np.median(by_layer, axis=1, keepdims=True)
        out = 1.0 / np.maximum(by_layer, np.maximum(floor, 1e-12))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(-1))


def compute_feature_scale(
    reader: object,
    rows_N: np.ndarray,
    *,
    num_layers: int,
    feature_width: int,
    mode: FeatureScaleMode,
    seed: int,
    sample_tokens: int = SAMPLE_TOKENS,
) -> torch.Tensor:
    """The scale from a seeded random sample of the snapshot's rows (≈ ``sample_tokens`` tokens)."""
    order = np.random.default_rng(seed).permutation(np.asarray(rows_N, dtype=np.int64))

    def sampled() -> Iterator[torch.Tensor]:
        tokens = 0
        for start in range(0, len(order), 16):
            for sample in reader.read_rows(order[start : start + 16]):  # type: ignore[attr-defined]
                yield sample.features_TF
                tokens += int(sample.features_TF.shape[0])
            if tokens >= sample_tokens:
                return

    return scale_from_rms(feature_rms(sampled(), feature_width), num_layers=num_layers, mode=mode)


def save_feature_scale(scale_F: torch.Tensor, run_dir: Path, *, mode: str) -> Path:
    path = run_dir / FEATURE_SCALE_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"feature_scale": scale_F.contiguous()}, str(tmp), metadata={"mode": mode})
    tmp.replace(path)
    return path


def load_feature_scale(run_dir: Path) -> torch.Tensor:
    return load_file(str(run_dir / FEATURE_SCALE_FILE))["feature_scale"]


def prepare_split(config: TrainConfig, reader: CacheReader, info: DistInfo) -> SplitSnapshots:
    """The run's sample set (taken at the first start by rank 0 and saved; reloaded on resume), split
    into training and validation samples, the training ones cut to ``--train-samples`` (announced by rank
    0)."""
    snapshot = _saved_snapshot(config, reader, info)
    held_out = held_out_of_run(config.out_dir)  # a follow segment: the validation stores' samples
    holds_out = config.data.val_fraction > 0 or config.data.val_samples is not None or held_out is not None
    subsets = config.data.train_samples is not None
    grouped = held_out is None and (holds_out or subsets)
    groups = _validation_groups(config, reader, snapshot, info) if grouped else None
    split = split_snapshot(
        snapshot,
        fraction=config.data.val_fraction,
        num_samples=config.data.val_samples,
        groups=groups,
        train_samples=config.data.train_samples,
        held_out=held_out,
    )
    if not info.is_main:
        return split
    notes = []
    if holds_out:
        if split.validation is None:
            note = f"no sample of {len(snapshot)} fell into the validation split: no validation"
        else:
            v = split.validation
            note = (
                f"validation: {len(v)} of {len(snapshot)} samples ({v.total_tokens:,} tokens) held out, "
                f"never trained on; evaluated every {config.validation.val_every} steps and at the end"
            )
            if groups is not None:
                roots = {groups[s] for s in v.sample_ids}
                val_group = field_ref(DataConfig, "val_group")
                note += f"; whole conversations: {len(roots)} roots ({val_group} root-id)"
            if held_out is not None:
                note += "; the samples of the validation stores (generate routed whole conversations)"
        notes.append(note)
    if subsets:
        t = split.train
        note = (
            f"training on {len(t)} of {split.num_not_held_out} samples ({t.total_tokens:,} tokens; "
            f"{field_ref(DataConfig, 'train_samples')} {config.data.train_samples}, those of smallest hash"
        )
        if groups is not None:
            note += f", whole conversations: {len({groups[s] for s in t.sample_ids})} roots"
        notes.append(note + ")")
    if notes:
        print(f"dflash train: {'; '.join(notes)}", file=sys.stderr, flush=True)
    return split


def _validation_groups(
    config: TrainConfig, reader: CacheReader, snapshot: IndexSnapshot, info: DistInfo
) -> dict[str, str] | None:
    """``--val-group root-id``: each sample's conversation root, read from the cache's data file by rank
    0 at the first start and saved; reloaded on resume (train/snapshot.py). None for ``sample``."""
    if config.data.val_group == "sample":
        return None
    path = config.out_dir / GROUPS_FILE
    if info.is_main and not path.exists():
        groups = conversation_groups(
            config.cache_dir,
            snapshot.sample_ids,
            source=reader.fingerprint.data_source,
            progress=config.logging.progress,
        )
        save_groups(groups, path)
    barrier(info)
    return read_groups(path)


def _saved_snapshot(config: TrainConfig, reader: CacheReader, info: DistInfo) -> IndexSnapshot:
    path = config.out_dir / SNAPSHOT_FILE
    taken = None
    if info.is_main and not path.exists():
        taken = take_snapshot(reader)
        save_snapshot(taken, path)
    barrier(info)
    # The rank that just took it keeps it (bound to this reader already): re-reading, re-sorting and
    # re-binding a million ids cost seconds before the first step. Everyone else loads the saved one.
    return taken if taken is not None else load_snapshot(path, reader)


def prepare_feature_scale(
    config: TrainConfig, reader: CacheReader, snapshot: IndexSnapshot, info: DistInfo
) -> torch.Tensor:
    """The run's feature scale: computed by rank 0 at the first start and saved; reloaded on resume."""
    if info.is_main and not (config.out_dir / FEATURE_SCALE_FILE).exists():
        fp = reader.fingerprint
        scale = compute_feature_scale(
            reader,
            snapshot.reader_rows_N,
            num_layers=len(fp.layer_ids),
            feature_width=fp.feature_width,
            mode=config.drafter.feature_scale,
            seed=config.data.seed,
        )
        save_feature_scale(scale, config.out_dir, mode=config.drafter.feature_scale)
    barrier(info)
    return load_feature_scale(config.out_dir)


def write_config(config: TrainConfig) -> None:
    """Write ``RUN/config.json`` whole, by a rename: another rank may be reading the previous one for its
    resume check."""
    path = config.out_dir / "config.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config.to_dict(), indent=2))
    os.replace(tmp, path)


def validation_schedule(
    config: TrainConfig, info: DistInfo, split: SplitSnapshots, reader: RowReader, state: TrainState | None
) -> ValidationSchedule | None:
    """The run's validation (None without a split), its tracker restored from ``state``."""
    if split.validation is None:
        return None
    validator = Validator(
        split.validation,
        reader,
        info=info,
        tokens_per_microbatch=config.data.tokens_per_microbatch,
        prefetch=config.launch.prefetch,
        loader_threads=config.launch.loader_threads,
        attention=config.launch.attention,
        chain_tokens=config.validation.val_chain_tokens,
        autocast=autocast_for(config, info),
    )
    schedule = ValidationSchedule(
        validator,
        state={} if state is None else state.validation,
        val_every=config.validation.val_every,
        early_stop=config.validation.early_stop,
        best_export_dir=config.out_dir / "drafter"
        if config.checkpoint.export_at_end and info.is_main
        else None,
    )
    if schedule.tracker.restarted is not None and info.is_main:
        print(f"dflash train: {schedule.tracker.restarted}", file=sys.stderr, flush=True)
    return schedule


# ─── The optimization ───────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, kw_only=True, slots=True)
class Optimization:
    """The stateful objects an optimizer step touches, built once a run by ``setup_optimization``."""

    model: DFlashDrafter
    ddp_model: nn.Module
    """``model`` itself, or its DistributedDataParallel wrapper when the run has several ranks."""
    params: list[nn.Parameter]
    """The parameters the optimizer updates (and whose gradient norm is clipped)."""
    optimizer: torch.optim.Optimizer
    lr_factor: Callable[[int], float]
    """LR multiplier of each global step (``cosine_with_warmup`` over ``total_steps``): the learning
    rate is a pure function of the step, so a resume needs no scheduler state."""
    planner: LengthMixingPlanner
    total_steps: int
    """Steps of the whole run: the planner's over ``epochs``, capped by ``max_steps``."""


def setup_optimization(
    config: TrainConfig,
    info: DistInfo,
    model: DFlashDrafter,
    snapshot: IndexSnapshot,
    continued: Continuation,
) -> Optimization:
    """DDP wrapper, optimizer, planner and LR schedule of a fresh run (``restore_checkpoint`` loads a
    checkpoint); a follow segment keeps the optimizer handed over and steps on the follow run's schedule."""
    ddp_model: nn.Module = model
    if info.distributed:
        ddp_model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
            broadcast_buffers=False,  # the frozen head is a (large) buffer: never re-broadcast it
        )
    params = model.trainable_parameters()
    optimizer: torch.optim.Optimizer
    if continued.live is not None:
        optimizer = continued.live.optimizer
    elif config.optimizer.algorithm == "sgd":
        optimizer = torch.optim.SGD(
            params, lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(
            params, lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay
        )
    planner = length_mixing_planner(config, snapshot, world_size=info.world_size)
    total_steps = planner.total_steps(config.optimizer.epochs)
    if config.optimizer.max_steps is not None:
        total_steps = min(total_steps, config.optimizer.max_steps)
    lr_factor = cosine_with_warmup(total_steps, config.optimizer.warmup_ratio)
    if continued.segment is not None:
        if total_steps != continued.segment.num_steps:
            raise ConfigError(
                f"this follow segment plans {total_steps} steps where the run planned "
                f"{continued.segment.num_steps}: continue the run with the options that started it"
            )
        lr_factor = continued.segment.lr_factor
    return Optimization(
        model=model,
        ddp_model=ddp_model,
        params=params,
        optimizer=optimizer,
        lr_factor=lr_factor,
        planner=planner,
        total_steps=total_steps,
    )


def _load_weights_and_optimizer(config: TrainConfig, opt: Optimization, state: TrainState) -> None:
    """The drafter's weights and the optimizer's state of a checkpoint, with this invocation's weight
    decay (an APPLIED option: the command line's, not the checkpoint's)."""
    opt.model.load_state_dict(state.model)
    opt.optimizer.load_state_dict(state.optimizer)
    for group in opt.optimizer.param_groups:
        group["weight_decay"] = config.optimizer.weight_decay


def length_mixing_planner(
    config: TrainConfig, train: IndexSnapshot, *, world_size: int
) -> LengthMixingPlanner:
    """The sample plan of a run over its training samples ``train`` (a follow run counts a segment's steps
    with it before the segment's run plans them)."""
    return LengthMixingPlanner(
        train,
        seed=config.data.seed,
        tokens_per_microbatch=config.data.tokens_per_microbatch,
        grad_accum=config.topology.grad_accum,
        world_size=world_size,
    )


def restore_checkpoint(config: TrainConfig, info: DistInfo, opt: Optimization, state: TrainState) -> None:
    """Load the resumed checkpoint ``state`` (admitted by ``checkpoint_to_resume``) into ``opt``."""
    _load_weights_and_optimizer(config, opt, state)
    opt.planner.load_state_dict(state.planner)
    set_rng_state(state.rng)
    if info.is_main:
        left = opt.total_steps - state.global_step
        print(
            f"dflash train: resumed from the checkpoint of step {state.global_step} of {opt.total_steps}"
            + (f" ({left} steps to go)" if left > 0 else " (nothing left to train)"),
            file=sys.stderr,
            flush=True,
        )


def continue_from_segment(config: TrainConfig, info: DistInfo, opt: Optimization, previous_run: Path) -> None:
    """A follow segment's first start in a fresh process: the weights and optimizer state of the previous
    segment's final checkpoint (its planner and RNG stay this segment's own, as a live handover leaves
    them)."""
    state = load_latest_checkpoint(previous_run, is_main=info.is_main)
    if state is None:
        raise ConfigError(f"{previous_run} has no checkpoint to continue from: its segment was never trained")
    _load_weights_and_optimizer(config, opt, state)
    if info.is_main:
        print(
            f"dflash train: continuing from the last checkpoint of {previous_run} (step {state.global_step})",
            file=sys.stderr,
            flush=True,
        )


def compiles(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run compiles the drafter's layers: ``--compile on``, or ``auto`` on CUDA without
    ``--deterministic`` (whose loss curve stays the eager one; see ``LaunchConfig.compile``)."""
    if config.launch.compile == "auto":
        return device.type == "cuda" and not config.launch.deterministic
    return config.launch.compile == "on"


# ─── The learning-rate schedules ────────────────────────────────────────────────────────────────────────────


def cosine_with_warmup(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warm-up over ``warmup_ratio`` of the steps, then cosine decay to 0."""
    warmup = max(1, round(warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def wsd_lr_factor(global_step: int, *, warmup_steps: int, decay_start: int | None, end_step: int) -> float:
    """LR multiplier of a follow run's ``global_step``: warm-up, stable, decay (WSD).

    - warm-up: ``(step + 1) / warmup_steps`` over the run's first ``warmup_steps`` steps, once;
    - stable: 1 from there on: a segment's end is no end of the schedule, since more data is coming;
    - decay: from ``D = max(decay_start, warmup_steps)`` to ``end_step``, a half cosine from 1 to 0,
      ``0.5 · (1 + cos(π · (step − D) / (end_step − D)))``. ``decay_start`` is the first step of the
      final segment (the one planned after generate finished; None while no segment is final) and
      ``end_step`` the step after its last.

    A run whose one segment is final (generate had finished before it started) gets exactly
    ``cosine_with_warmup``'s schedule. WSD suits a stream: the total number of steps is not known
    until generate finishes, and a constant LR neither wastes the data that comes later on a small LR
    nor spends a decay on every segment (where each restart costs loss); the decay over the final
    segment gives the end of the run the low-LR anneal a cosine run gets."""
    if global_step < warmup_steps:
        return (global_step + 1) / warmup_steps
    if decay_start is None:
        return 1.0
    start = max(decay_start, warmup_steps)
    if global_step < start:
        return 1.0
    progress = min(1.0, (global_step - start) / max(1, end_step - start))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True, slots=True)
class FollowSchedule:
    """The arguments of ``wsd_lr_factor`` for a follow run, read from its ``RUN/follow.json``."""

    warmup_steps: int
    """Steps of the linear warm-up at the start of the run (``warmup_ratio`` of the first segment's)."""
    decay_start: int | None
    """The global step where the final segment starts; None while no segment is final."""
    end_step: int
    """The global step after the last planned step."""

    def factor(self, global_step: int) -> float:
        return wsd_lr_factor(
            global_step, warmup_steps=self.warmup_steps, decay_start=self.decay_start, end_step=self.end_step
        )


# ─── Handing a segment over ─────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveDrafter:
    """A drafter and its optimizer, alive after a segment ended (its final checkpoint holds the same)."""

    setup: DrafterSetup
    optimizer: torch.optim.Optimizer
    compiled: bool
    """Its training forward runs compiled layer steps (``DFlashDrafter.compile_training`` was called)."""


class LiveTraining:
    """Hands the live drafter and optimizer of one segment to the next in the same process."""

    def __init__(self) -> None:
        self._kept: LiveDrafter | None = None

    def keep(self, live: LiveDrafter) -> None:
        """What the segment that just ended leaves to the next."""
        self._kept = live

    def take(self) -> LiveDrafter | None:
        """What the previous segment left (None at the start of a process); the holder is then empty,
        so a segment that fails leaves nothing for a later one to take by mistake."""
        live, self._kept = self._kept, None
        return live


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentStart:
    """How the ordinary run of one follow segment starts and where its steps sit in the follow run."""

    first_step: int
    """The follow run's global step of the segment's first step: its local step s is global step
    ``first_step + s`` (its checkpoints and ``metrics.jsonl`` count local steps)."""
    num_steps: int
    """Steps the segment plans (its ``passes`` epochs over its training samples)."""
    schedule: FollowSchedule
    previous_run: Path | None
    """The folder of the previous segment that trained samples, whose final checkpoint this segment
    continues from where no live drafter is handed over (None: the first such segment)."""
    live: LiveTraining | None
    """The in-process handover (None where the segment's ranks run in processes of their own)."""

    def lr_factor(self, local_step: int) -> float:
        return self.schedule.factor(self.first_step + local_step)


@dataclass(frozen=True, kw_only=True, slots=True)
class Continuation:
    """What a follow segment's run continues (both None for an ordinary run)."""

    segment: SegmentStart | None
    live: LiveDrafter | None
    """The previous segment's drafter and optimizer, handed over in this process."""

    @classmethod
    def start(cls, segment: SegmentStart | None) -> Continuation:
        """Take what the previous segment handed over in this process, if anything."""
        live = segment.live.take() if segment is not None and segment.live is not None else None
        return cls(segment=segment, live=live)

    @property
    def setup(self) -> DrafterSetup | None:
        return None if self.live is None else self.live.setup

    @property
    def compiled(self) -> bool:
        return self.live is not None and self.live.compiled

    @property
    def from_checkpoint(self) -> Path | None:
        """The previous segment's run, whose final checkpoint a segment started without a handover
        continues (None: an ordinary run, the first segment, or a handover)."""
        return None if self.live is not None or self.segment is None else self.segment.previous_run

    def hand_over(self, setup: DrafterSetup, optimizer: torch.optim.Optimizer, *, compiled: bool) -> None:
        """Leave the drafter and optimizer to the next segment in this process."""
        if self.segment is not None and self.segment.live is not None:
            self.segment.live.keep(LiveDrafter(setup=setup, optimizer=optimizer, compiled=compiled))
