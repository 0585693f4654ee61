"""``dflash train --follow``: training segment by segment while ``dflash generate`` fills a disk
window, and the record of those segments."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_offline.cache.layout import read_fingerprint
from dflash_offline.cache.manifest import read_runs, read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import utc_now
from dflash_offline.cache.window import (
    finish_retirements,
    is_validation_store,
    read_retirements,
    read_seals,
    record_wait,
    retire_store,
)
from dflash_offline.cache.window_records import StoreRetirement, WindowWait
from dflash_offline.config_fields import GPUS, WORKERS, field_ref
from dflash_offline.drafter.export import export_drafter
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.errors import ConfigError
from dflash_offline.locking import hold_lock
from dflash_offline.placement import under_torchrun
from dflash_offline.run_split import FOLLOW_FILE, segment_dir
from dflash_offline.train.checkpoint import list_checkpoints, load_latest_checkpoint
from dflash_offline.train.config import (
    DataConfig,
    OptimizerConfig,
    TrainConfig,
    ValidationConfig,
    WindowConfig,
)
from dflash_offline.train.launch import run_training
from dflash_offline.train.prepare import (
    FEATURE_SCALE_FILE,
    FollowSchedule,
    LiveTraining,
    SegmentStart,
    length_mixing_planner,
)
from dflash_offline.train.snapshot import (
    HELD_OUT_FILE,
    SNAPSHOT_FILE,
    held_out_of_run,
    read_snapshot,
    save_held_out,
    save_snapshot,
    split_snapshot,
    subset_snapshot,
    take_snapshot,
)
from dflash_offline.train.step import build_drafter_setup

# ─── The follow record ──────────────────────────────────────────────────────────────────────────────────────
# The record of a ``dflash train --follow`` run: its segments, in ``RUN/follow.json`` (docs/follow.md).
#
# A segment is a set of sealed training stores, trained as one ordinary run of ``--passes`` epochs in
# ``RUN/segments/<k>/``, its steps numbered on in the follow run's global steps (``first_step``). The
# file is replaced whole (temp file, fsync, rename, fsync of the folder), so a kill leaves the previous
# version or the new one, never half of one.


FOLLOW_STATE_VERSION = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One segment of a follow run."""

    index: int
    stores: tuple[str, ...]
    """The training stores it trains (sealed when it began; retired once it is trained)."""
    num_samples: int
    """Training samples of those stores."""
    trained: bool
    """Its run reached its last step and wrote that step's checkpoint: its stores may be retired."""
    first_step: int
    """The follow run's global step of its first step (the steps of the segments before it)."""
    num_steps: int
    """Steps its run plans: ``passes`` epochs of its length-mixing plan (0 without samples)."""
    last: bool
    """Planned after generate had finished: no store comes after it, so the LR decays over it."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "stores": list(self.stores),
            "num_samples": self.num_samples,
            "trained": self.trained,
            "first_step": self.first_step,
            "num_steps": self.num_steps,
            "last": self.last,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(
            index=int(d["index"]),
            stores=tuple(str(s) for s in d["stores"]),
            num_samples=int(d["num_samples"]),
            trained=bool(d["trained"]),
            first_step=int(d["first_step"]),
            num_steps=int(d["num_steps"]),
            last=bool(d["last"]),
        )

    def schedule(self, warmup_steps: int) -> FollowSchedule:
        """The run's LR schedule as it stands while this segment trains (it is the newest segment then):
        warm-up from the run's start, decay over this segment if it is the last."""
        return FollowSchedule(
            warmup_steps=warmup_steps,
            decay_start=self.first_step if self.last else None,
            end_step=self.first_step + self.num_steps,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FollowState:
    """What a follow run has planned and done so far."""

    passes: int
    warmup_steps: int = 0
    """Steps of the LR warm-up at the start of the run: ``warmup_ratio`` of the steps of the first
    segment that has samples (0 until it is planned)."""
    segments: tuple[Segment, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FOLLOW_STATE_VERSION,
            "passes": self.passes,
            "warmup_steps": self.warmup_steps,
            "segments": [s.to_dict() for s in self.segments],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: Path) -> FollowState:
        if d.get("version") != FOLLOW_STATE_VERSION:
            raise ConfigError(
                f"{path} has version {d.get('version')!r}; this dflash-offline writes version "
                f"{FOLLOW_STATE_VERSION}: continue the run with the dflash-offline that started it"
            )
        return cls(
            passes=int(d["passes"]),
            warmup_steps=int(d["warmup_steps"]),
            segments=tuple(Segment.from_dict(s) for s in d["segments"]),
        )

    @property
    def num_steps(self) -> int:
        """Global steps of every segment planned."""
        return sum(segment.num_steps for segment in self.segments)

    @property
    def stores(self) -> frozenset[str]:
        """Every store some segment trains."""
        return frozenset(store for segment in self.segments for store in segment.stores)


def read_follow_state(run_dir: Path) -> FollowState | None:
    path = run_dir / FOLLOW_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return FollowState.from_dict(json.loads(text), path)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); it was not written by dflash train --follow") from e


def write_follow_state(run_dir: Path, state: FollowState) -> None:
    """Replace ``RUN/follow.json`` durably."""
    path = run_dir / FOLLOW_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(state.to_dict(), indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ─── Following a generate run ───────────────────────────────────────────────────────────────────────────────
# ``dflash train --follow``: train on a disk window while ``dflash generate --window-limit`` fills it,
# and retire what was trained (docs/follow.md).
#
# The run is a sequence of segments (``FollowState``, above). A segment is every sealed training store that
# was present, not retired and in no earlier segment when it began, with the validation stores present
# then. It is trained as an ordinary run of ``--passes`` epochs in ``RUN/segments/<k>/``: its own
# snapshot (written here before the segment is recorded), length-mixing plan, checkpoints and resume, so
# a kill anywhere inside it resumes exactly as any run does. The segments are one optimization: each
# continues the previous one's drafter, optimizer state and global step (handed over alive in this
# process, else read from the previous segment's final checkpoint) on one LR schedule
# (``segments.wsd_lr_factor``). Once the segment's run has written the checkpoint of its last step, the
# segment is recorded as trained (``RUN/follow.json``), and only then are its stores retired: no resume
# can need them.
# The run ends when the newest generate run of the cache has finished and every sealed store was trained.


POLL_SECONDS = 1.0
"""How often a follow run waiting for sealed stores re-reads the manifest."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FollowResult:
    """What a follow run did."""

    segments: int
    samples_trained: int
    stores_retired: int
    waited_seconds: float
    last_drafter: Path | None

    def render(self) -> str:
        return (
            f"followed the cache: {self.segments} segments, {self.samples_trained} samples trained and "
            f"{self.stores_retired} stores retired; waited {self.waited_seconds:.1f} s for sealed stores\n"
            f"drafter (z-lab DFlash layout): {self.last_drafter}"
        )


def run_follow(config: TrainConfig, *, poll_seconds: float = POLL_SECONDS) -> FollowResult:
    """Follow the cache until its generate run finished and every sealed store was trained and retired."""
    check_follow_config(config)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    with hold_lock(config.out_dir, what="training run"):
        if list_checkpoints(config.out_dir):
            raise ConfigError(
                f"{field_ref(TrainConfig, 'out_dir')} {config.out_dir} holds a training run without "
                f"{field_ref(WindowConfig, 'follow')}: give a new directory"
            )
        state = read_follow_state(config.out_dir) or FollowState(
            passes=config.window.passes, warmup_steps=0, segments=()
        )
        if state.passes != config.window.passes:
            raise ConfigError(
                f"{field_ref(WindowConfig, 'passes')} {config.window.passes}, but this run planned "
                f"{state.passes} passes for the stores it trained so far; continue it with the same value"
            )
        _wait_for_cache(config.cache_dir, poll_seconds)
        finish_retirements(config.cache_dir)  # files of stores retired by a run killed while deleting them
        run_id = f"train-follow:{config.out_dir.resolve()}"
        waited = 0.0
        live = LiveTraining()  # the drafter and optimizer, from one segment to the next
        while True:
            retire_trained(config.cache_dir, state, run_id=run_id)
            pending = next((s for s in state.segments if not s.trained), None)
            if pending is not None:
                train_segment(config, state, pending, live)
                state = _mark_trained(config.out_dir, state, pending)
                continue
            check_routing(config)  # again each time: a generate run may have started meanwhile
            plannable = plannable_stores(config.cache_dir, state)
            if plannable.stores:
                segment = new_segment(config, state, stores=plannable.stores, last=plannable.last)
                assert segment is not None
                warmup = state.warmup_steps or warmup_steps(config, segment)
                state = dataclasses.replace(state, warmup_steps=warmup, segments=(*state.segments, segment))
                write_follow_state(config.out_dir, state)  # after its snapshot: the segment is planned
                continue
            if plannable.last:
                break
            started_at, started = utc_now(), time.perf_counter()
            while not worth_planning(config.cache_dir, state):
                time.sleep(poll_seconds)
            seconds = time.perf_counter() - started
            waited += seconds
            wait = WindowWait(run_id=run_id, side="train", started_at=started_at, seconds=seconds)
            record_wait(config.cache_dir, wait, number=_next_wait_number(config.cache_dir, run_id))
        _export_last(config, state, live)
    return _result(config, state, waited)


def _wait_for_cache(cache_dir: Path, poll_seconds: float) -> None:
    """Training may start first: wait for generate to create the cache."""
    if (cache_dir / "cache.json").exists():
        return
    print(
        f"dflash train --follow: waiting for `dflash generate` to create the cache {cache_dir}",
        file=sys.stderr,
        flush=True,
    )
    while not (cache_dir / "cache.json").exists():
        time.sleep(poll_seconds)


def check_follow_config(config: TrainConfig) -> None:
    """Options that do not go with ``--follow`` (each segment is a whole run of ``--passes`` epochs)."""
    follow = field_ref(WindowConfig, "follow")
    if under_torchrun():
        raise ConfigError(
            f"{follow} runs as one command: give it {field_ref(WORKERS)} or {field_ref(GPUS)} "
            "instead of torchrun"
        )
    refused = {
        field_ref(OptimizerConfig, "max_steps"): config.optimizer.max_steps,
        field_ref(ValidationConfig, "early_stop"): config.validation.early_stop,
        field_ref(DataConfig, "train_samples"): config.data.train_samples,
        field_ref(DataConfig, "val_samples"): config.data.val_samples,
    }
    for option, value in refused.items():
        if value is not None:
            raise ConfigError(
                f"{option} does not go with {follow}: each segment of stores is trained "
                f"{field_ref(WindowConfig, 'passes')} epochs, then retired"
            )


def check_routing(config: TrainConfig) -> None:
    """The cache's generate runs routed validation samples by the same split as this run's."""
    for run in read_runs(config.cache_dir):
        if run.command != "generate":
            continue
        generate = json.loads(run.config_json or "{}")
        if generate.get("window_limit") is None:
            continue
        routed = float(generate.get("val_fraction", 0.0))
        if routed != config.data.val_fraction:
            raise ConfigError(
                f"{field_ref(DataConfig, 'val_fraction')} {config.data.val_fraction}, but generate run "
                f"{run.run_id} routed a validation share of {routed} into stores never retired: give "
                f"{routed} (else "
                "samples this run validates on would be retired, or samples it trains on never)"
            )


def new_stores(cache_dir: Path, state: FollowState) -> tuple[str, ...]:
    """Sealed training stores, not retired, in no segment yet."""
    retired = read_retirements(cache_dir)
    return tuple(
        sorted(
            shard
            for shard, seal in read_seals(cache_dir).items()
            if not seal.validation and shard not in retired and shard not in state.stores
        )
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateProgress:
    """How far the newest generate run of the cache has got, from its run row."""

    finished: bool
    """It finished: every store it wrote was sealed before its run row said so (a killed run still
    says ``running`` until the next run on the cache takes over: rerun it to go on)."""
    plan_ended: bool
    """Its planner is past its plan's last job holding a training sample (``RunRow.plan_ended_at``):
    every training sample it commits from then on lands in a store sealed later."""


def generate_progress(cache_dir: Path) -> GenerateProgress:
    runs = [r for r in read_runs(cache_dir) if r.command == "generate"]
    if not runs:
        return GenerateProgress(finished=False, plan_ended=False)
    newest = runs[-1]
    return GenerateProgress(finished=newest.status == "finished", plan_ended=newest.plan_ended_at is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plannable:
    """The stores the next segment may take now (none: wait, or the run is over)."""

    stores: tuple[str, ...]
    last: bool
    """Generate has finished: no store comes after these (the segment is final; with no stores, the
    follow run is over)."""


def plannable_stores(cache_dir: Path, state: FollowState) -> Plannable:
    """The rule of the final segment (docs/follow.md): stores are planned while the newest generate run
    still hands out jobs holding training samples; once its plan has ended, nothing is planned until it
    has finished, and then every store left forms the final segment, over which the LR decays. So the
    final segment holds the samples of the plan's last jobs, whatever the two sides' speeds: a store
    sealed after the plan's end is never trained on the stable LR as if more were to come.

    Holding stores back then is safe for the window: after its plan's end generate never waits for room
    (``feed.Planner``). The order of the reads matters: the run row says ``finished`` only after every
    store was sealed, so the stores are read after it; a seal may come after the plan's end, so the run
    row is read again after the stores."""
    progress = generate_progress(cache_dir)
    if progress.finished:
        return Plannable(stores=new_stores(cache_dir, state), last=True)
    if progress.plan_ended:
        return Plannable(stores=(), last=False)
    stores = new_stores(cache_dir, state)
    if generate_progress(cache_dir) != progress:  # the plan ended (or the run finished) meanwhile
        return Plannable(stores=(), last=False)
    return Plannable(stores=stores, last=False)


def worth_planning(cache_dir: Path, state: FollowState) -> bool:
    """A waiting follow run looks again: generate finished, or new stores it may plan now."""
    progress = generate_progress(cache_dir)
    return progress.finished or (not progress.plan_ended and new_stores(cache_dir, state) != ())


def new_segment(
    config: TrainConfig, state: FollowState, *, stores: tuple[str, ...] | None = None, last: bool = False
) -> Segment | None:
    """Plan the next segment over ``stores`` (by default every new sealed store; None when there are
    none): its snapshot (its training stores and the validation stores present) is written first, in a
    fresh segment folder, then its steps are counted from it as its run will plan them. ``last``:
    generate had finished before (``plannable_stores``)."""
    stores = new_stores(config.cache_dir, state) if stores is None else stores
    if not stores:
        return None
    index = len(state.segments)
    folder = segment_dir(config.out_dir, index)
    shutil.rmtree(folder, ignore_errors=True)  # planned before a kill, never recorded: plan it again
    folder.mkdir(parents=True)
    with CacheReader.open(config.cache_dir) as reader:
        snapshot = take_snapshot(reader)
        shard_N = reader.samples.shard[snapshot.reader_rows_N]
    wanted = set(stores)
    train_N = np.fromiter((s in wanted for s in shard_N), dtype=bool, count=len(shard_N))
    val_N = np.fromiter((is_validation_store(s) for s in shard_N), dtype=bool, count=len(shard_N))
    num_samples = int(train_N.sum())
    first_step = state.num_steps
    if num_samples == 0:  # stores that hold only failures: nothing to train, retire them as they are
        return Segment(
            index=index,
            stores=stores,
            num_samples=0,
            trained=True,
            first_step=first_step,
            num_steps=0,
            last=last,
        )
    # The stores decide the split: the segment's run holds out its samples of validation stores.
    val_ids = [s for s, v in zip(snapshot.sample_ids, val_N, strict=True) if v]
    save_held_out(val_ids, folder / HELD_OUT_FILE)
    save_snapshot(subset_snapshot(snapshot, train_N | val_N), folder / SNAPSHOT_FILE)
    return Segment(
        index=index,
        stores=stores,
        num_samples=num_samples,
        trained=False,
        first_step=first_step,
        num_steps=planned_steps(config, folder, passes=state.passes),
        last=last,
    )


def warmup_steps(config: TrainConfig, first: Segment) -> int:
    """The run's warm-up: ``warmup_ratio`` of the steps of its first segment with samples, as an ordinary
    run of those steps would warm up (0 while that segment is not planned)."""
    return max(1, round(config.optimizer.warmup_ratio * first.num_steps)) if first.num_steps else 0


def planned_steps(config: TrainConfig, folder: Path, *, passes: int) -> int:
    """Steps of the run of the segment in ``folder``: ``passes`` epochs of the length-mixing plan over
    the training samples of its snapshot, split as its run splits them."""
    train = split_snapshot(
        read_snapshot(folder / SNAPSHOT_FILE),
        fraction=config.data.val_fraction,
        num_samples=None,
        held_out=held_out_of_run(folder),
    ).train
    return length_mixing_planner(config, train, world_size=config.launch.world_size).total_steps(passes)


def previous_run(run_dir: Path, state: FollowState, segment: Segment) -> Path | None:
    """The folder of the last segment before ``segment`` that trained samples (None: there is none)."""
    earlier = [s for s in state.segments if s.index < segment.index and s.num_samples]
    return segment_dir(run_dir, earlier[-1].index) if earlier else None


def segment_config(config: TrainConfig, state: FollowState, segment: Segment) -> TrainConfig:
    """The ordinary run that trains one segment: ``passes`` epochs (from ``init_from`` for the first
    segment that trains; the later ones continue it). Only the last segment exports its drafter."""
    first = previous_run(config.out_dir, state, segment) is None
    return dataclasses.replace(
        config,
        out_dir=segment_dir(config.out_dir, segment.index),
        optimizer=dataclasses.replace(config.optimizer, epochs=config.window.passes),
        drafter=dataclasses.replace(config.drafter, init_from=config.drafter.init_from if first else None),
        checkpoint=dataclasses.replace(
            config.checkpoint,
            export_at_end=config.checkpoint.export_at_end and segment.last,
            export_initial=config.checkpoint.export_initial and first,
        ),
        window=dataclasses.replace(config.window, follow=False),
        logging=dataclasses.replace(
            config.logging,
            tensorboard_dir=None
            if config.logging.tensorboard_dir is None
            else config.logging.tensorboard_dir / f"{segment.index:04d}",
        ),
    )


def segment_start(run_dir: Path, state: FollowState, segment: Segment, live: LiveTraining) -> SegmentStart:
    return SegmentStart(
        first_step=segment.first_step,
        num_steps=segment.num_steps,
        schedule=segment.schedule(state.warmup_steps),
        previous_run=previous_run(run_dir, state, segment),
        live=live,
    )


def train_segment(config: TrainConfig, state: FollowState, segment: Segment, live: LiveTraining) -> None:
    """Train (or resume) one segment to its last step; its last checkpoint is then on disk."""
    print(
        f"dflash train --follow: segment {segment.index}: {segment.num_samples} samples of "
        f"{len(segment.stores)} stores, {state.passes} passes, steps {segment.first_step} to "
        f"{segment.first_step + segment.num_steps}" + (" (the last: the LR decays)" if segment.last else ""),
        file=sys.stderr,
        flush=True,
    )
    start = segment_start(config.out_dir, state, segment, live)
    _share_feature_scale(config, start.previous_run, segment_dir(config.out_dir, segment.index))
    result = run_training(segment_config(config, state, segment), segment=start)
    if result is not None and (result.stopped_early or result.global_step < result.total_steps):
        raise AssertionError(
            f"segment {segment.index} ended at step {result.global_step} of {result.total_steps}"
        )


def _share_feature_scale(config: TrainConfig, previous: Path | None, folder: Path) -> None:
    """One drafter, one feature scale: a segment that continues another uses its scale (computed by the
    first segment from its samples), written before its run starts (temp file, rename)."""
    if previous is None or config.drafter.feature_scale == "none" or (folder / FEATURE_SCALE_FILE).exists():
        return
    tmp = folder / f".{FEATURE_SCALE_FILE}.tmp"
    shutil.copyfile(previous / FEATURE_SCALE_FILE, tmp)
    os.replace(tmp, folder / FEATURE_SCALE_FILE)


def _export_last(config: TrainConfig, state: FollowState, live: LiveTraining) -> None:
    """The run's drafter: the last trained segment's export, written at its end when it was planned as
    the last. Where it was not (generate's run said it had finished only after that segment was
    planned), it is exported here from the drafter handed over alive, or from the segment's final
    checkpoint: its stores are retired by now, so its run cannot be run again."""
    trained = [s for s in state.segments if s.num_samples]
    if (
        not trained
        or not config.checkpoint.export_at_end
        or _drafter_of(config.out_dir, trained[-1]) is not None
    ):
        return
    folder = segment_dir(config.out_dir, trained[-1].index)
    kept = live.take()
    model = kept.setup.model if kept is not None else _checkpoint_drafter(folder)
    export_drafter(model, folder / "drafter-last")


def _checkpoint_drafter(folder: Path) -> DFlashDrafter:
    """The drafter of the final checkpoint of the segment run in ``folder`` (on the CPU)."""
    segment_config = TrainConfig.from_dict(json.loads((folder / "config.json").read_text()))
    state = load_latest_checkpoint(folder)
    assert state is not None, f"{folder}: a trained segment without a checkpoint"
    setup = build_drafter_setup(
        segment_config, read_fingerprint(segment_config.cache_dir), device=torch.device("cpu")
    )
    if "feature_scale_F" in state.model:
        setup.model.set_feature_scale(state.model["feature_scale_F"])
    setup.model.load_state_dict(state.model)
    return setup.model


def checkpointed_run(run_dir: Path) -> Path:
    """The run whose checkpoints ``dflash export RUN`` reads: ``run_dir`` itself, or for a follow run
    the folder of its last segment that has a checkpoint (that segment's newest checkpoint is the
    follow run's newest training state: every segment continues the one before)."""
    state = read_follow_state(run_dir)
    if state is None:
        return run_dir
    for segment in reversed(state.segments):
        if list_checkpoints(segment_dir(run_dir, segment.index)):
            return segment_dir(run_dir, segment.index)
    return run_dir


def _drafter_of(run_dir: Path, segment: Segment) -> Path | None:
    folder = segment_dir(run_dir, segment.index)
    for name in ("drafter-last", "drafter"):
        if (folder / name).is_dir():
            return folder / name
    return None


def _mark_trained(run_dir: Path, state: FollowState, segment: Segment) -> FollowState:
    segments = tuple(
        dataclasses.replace(s, trained=True) if s.index == segment.index else s for s in state.segments
    )
    state = dataclasses.replace(state, segments=segments)
    write_follow_state(run_dir, state)
    return state


def retire_trained(cache_dir: Path, state: FollowState, *, run_id: str) -> int:
    """Retire every store of a trained segment not retired yet (the record first, then its files)."""
    retired = read_retirements(cache_dir)
    samples = read_table(cache_dir, "samples", ["shard", "num_tokens"]).to_pydict()
    done = 0
    for segment in state.segments:
        if not segment.trained:
            continue
        for shard in segment.stores:
            if shard in retired:
                continue
            tokens = [n for s, n in zip(samples["shard"], samples["num_tokens"], strict=True) if s == shard]
            record = StoreRetirement(
                shard=shard,
                run_id=run_id,
                num_samples=len(tokens),
                num_tokens=sum(tokens),
                retired_at=utc_now(),
            )
            retire_store(cache_dir, record)
            done += 1
    return done


def _next_wait_number(cache_dir: Path, run_id: str) -> int:
    waits = read_table(cache_dir, "waits", ["run_id"]).column("run_id").to_pylist()
    return waits.count(run_id) + 1


def _result(config: TrainConfig, state: FollowState, waited: float) -> FollowResult:
    trained = [s for s in state.segments if s.num_samples]
    last = _drafter_of(config.out_dir, trained[-1]) if trained else None
    return FollowResult(
        segments=len(state.segments),
        samples_trained=sum(s.num_samples for s in state.segments),
        stores_retired=len(state.stores),
        waited_seconds=waited,
        last_drafter=last,
    )
