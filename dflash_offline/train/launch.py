"""Starting a training run's ranks where the config says: in this process (one rank), one spawned process per
rank (a GPU each, or CPU workers over gloo), or as ``torchrun``'s ranks; each joins the process group,
trains (train/trainer.py) and leaves it. The launcher holds ``OUT/lock`` for the run."""

from __future__ import annotations

import gc
import os
import signal
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_offline.config_fields import field_ref
from dflash_offline.locking import acquire_lock, hold_lock
from dflash_offline.placement import DistInfo, free_port, under_torchrun
from dflash_offline.train.checkpoint import check_run_out
from dflash_offline.train.config import LoggingConfig, TrainConfig
from dflash_offline.train.metrics import WallSplit
from dflash_offline.train.prepare import SegmentStart
from dflash_offline.train.trainer import TrainInterrupted, TrainResult, stop_on_sigint, train_rank
from dflash_offline.workers.device import bind_device
from dflash_offline.workers.group import GroupPolicy
from dflash_offline.workers.records import EventSink, StopFlag, WorkerFailed, WorkerSpec, user_error
from dflash_offline.workers.spawned import ChildPolicy, SpawnedWorkers, WorkerExit, forwarding_sigint
from dflash_offline.writable import check_writable_dir

# ─── Joining the process group ──────────────────────────────────────────────────────────────────────────────


def init_distributed(
    *, rank: int, world_size: int, local_rank: int, use_cuda: bool, timeout_s: float = 1800
) -> DistInfo:
    """Join the process group (when world_size > 1) and pick this rank's device.

    Expects MASTER_ADDR / MASTER_PORT in the environment (torchrun sets them; ``launch`` does too)."""
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    return DistInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend if world_size > 1 else "none",
    )


def dist_info_from_env(*, use_cuda: bool) -> DistInfo:
    """Under torchrun: rank, world size and local rank from its environment variables."""
    return init_distributed(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        use_cuda=use_cuda,
    )


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        # Objects in reference cycles (DDP's reducer and the gloo work it holds) are freed now, while the
        # interpreter is alive: freed during its finalization, gloo's threads can abort the process after a
        # finished run (seen once under torchrun on 2 CPU ranks: "terminate called without an active
        # exception", SIGABRT, after the run's last checkpoint; a mitigation, not yet shown to be the cause).
        gc.collect()
        dist.destroy_process_group()


# ─── Starting the ranks ─────────────────────────────────────────────────────────────────────────────────────
# Start training where the config says: one DDP process per GPU (spawned), ``torchrun`` ranks, or
# CPU processes over gloo. One process trains in-process (no spawn).


def _cpu_threads(config: TrainConfig) -> int:
    return config.launch.threads_per_worker or max(1, (os.cpu_count() or 1) // config.launch.world_size)


ORPHAN_GRACE_SECONDS = 120.0
"""A rank whose launcher died stops at its step boundary (its parent-death signal is SIGINT, a stop
request here) and checkpoints; one that has not exited this long after is ended (a rank blocked in a
collective for a dead peer would otherwise live on, holding its GPU)."""

RANK_PROCESS = ChildPolicy(
    parent_death_signal=signal.SIGINT, orphan_grace_seconds=ORPHAN_GRACE_SECONDS, ignore_sigint=False
)
"""A spawned rank handles Ctrl-C itself: it stops at its step boundary with a checkpoint."""
RANK_GROUP = GroupPolicy(
    label="rank", resumable="the run", process_name="dflash-train-rank", drain_seconds=30.0
)
"""When a rank failed, the others are ended (SIGTERM, SIGKILL ``drain_seconds`` later if still alive)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTask:
    """What a spawned rank trains (``WorkerSpec.task``, pickled at spawn)."""

    config: TrainConfig
    port: int
    """The rendezvous port on 127.0.0.1 (``MASTER_PORT``)."""
    started_at: float
    """``time.time()`` when the command started: where the ranks count their start-up from."""
    segment: SegmentStart | None = None
    """The follow segment the run trains (without a live handover: each rank is a process of its own)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInterrupted:
    """A spawned rank stopped on request after ``step``, with a checkpoint of that step on disk."""

    worker: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFinished:
    """Rank 0 finished training: where its wall time went (the launcher's summary reports it)."""

    worker: int
    wall: WallSplit | None


def _rank_main(spec: WorkerSpec[RankTask], events: EventSink, stop: StopFlag) -> None:
    """Entry point of a spawned rank (``workers.spawned``: it dies with its launcher, and any exception
    reaches the launcher as ``WorkerFailed``)."""
    # A terminal's Ctrl-C reaches every rank (and the launcher forwards it): stop at the step boundary.
    with stop_on_sigint(second_aborts=False):
        try:
            result = _run_spawned_rank(spec)
            if spec.worker == 0:
                events.put(RankFinished(worker=spec.worker, wall=result.wall))
        except TrainInterrupted as e:
            events.put(RankInterrupted(worker=spec.worker, step=e.step))


def _run_spawned_rank(spec: WorkerSpec[RankTask]) -> TrainResult:
    config, rank = spec.task.config, spec.worker
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(spec.task.port)
    use_cuda = bool(config.launch.gpus)
    bind_device(spec)  # rank r drives the r-th listed GPU (its spec's device), or its CPU threads
    info = init_distributed(
        rank=rank,
        world_size=config.launch.world_size,
        local_rank=config.launch.gpus[rank] if use_cuda else rank,
        use_cuda=use_cuda,
    )
    try:
        return train_rank(config, info, started_at=spec.task.started_at, segment=spec.task.segment)
    finally:
        shutdown(info)


def _rank_specs(
    config: TrainConfig, started_at: float, segment: SegmentStart | None
) -> list[WorkerSpec[RankTask]]:
    if segment is not None:
        segment = replace(segment, live=None)  # live objects stay in this process
    task = RankTask(config=config, port=free_port(), started_at=started_at, segment=segment)
    return [
        WorkerSpec(
            worker=rank,
            num_workers=config.launch.world_size,
            device=f"cuda:{config.launch.gpus[rank]}" if config.launch.gpus else "cpu",
            cpu_threads=None if config.launch.gpus else _cpu_threads(config),
            task=task,
        )
        for rank in range(config.launch.world_size)
    ]


def _spawn(config: TrainConfig, started_at: float, segment: SegmentStart | None) -> WallSplit | None:
    """One spawned process per rank; a rank's DflashError or Ctrl-C reaches the caller as itself, a rank's
    bug or death as the error torch's ``mp.spawn`` raised (with the rank's traceback). Returns rank 0's
    wall split."""
    specs = _rank_specs(config, started_at, segment)
    group = SpawnedWorkers(_rank_main, specs, policy=RANK_GROUP, child=RANK_PROCESS)
    events: list[object] = []
    group.start()
    # The launcher only waits: it passes a Ctrl-C on (a kill -INT of the launcher alone must stop the
    # ranks at a step boundary too; they ignore the repeat a terminal's Ctrl-C also sends them).
    with forwarding_sigint(group):
        exited = group.wait_for_exit(events.append)
        if exited is not None:
            group.terminate()  # the other ranks would wait for the failed one in their next collective
        group.drain_and_join(events.append)
    for event in events:
        if isinstance(event, RankInterrupted):
            raise TrainInterrupted(event.step)
    failures = {event.worker: event for event in events if isinstance(event, WorkerFailed)}
    for failed in failures.values():
        error = user_error(failed)
        if error is not None:
            raise error  # one line at the CLI
    if exited is not None:
        raise _spawn_error(exited, failures.get(exited.worker))
    return next((e.wall for e in events if isinstance(e, RankFinished)), None)


def _spawn_error(exited: WorkerExit, failed: WorkerFailed | None) -> Exception:
    """What torch's ``mp.spawn`` raised for a rank that ended with ``exited`` (its traceback: ``failed``)."""
    import torch.multiprocessing as mp

    if failed is not None:
        message = f"\n\n-- Process {exited.worker:d} terminated with the following error:\n{failed.traceback}"
        return mp.ProcessRaisedException(message, exited.worker, exited.pid)
    if exited.exit_code >= 0:
        return mp.ProcessExitedException(
            f"process {exited.worker:d} terminated with exit code {exited.exit_code:d}",
            error_index=exited.worker,
            error_pid=exited.pid,
            exit_code=exited.exit_code,
        )
    try:
        name = signal.Signals(-exited.exit_code).name
    except ValueError:
        name = f"<Unknown signal {-exited.exit_code}>"
    return mp.ProcessExitedException(
        f"process {exited.worker:d} terminated with signal {name}",
        error_index=exited.worker,
        error_pid=exited.pid,
        exit_code=exited.exit_code,
        signal_name=name,
    )


def run_training(
    config: TrainConfig, *, started_at: float | None = None, segment: SegmentStart | None = None
) -> TrainResult | None:
    """Train; returns the result in the main process (None in a torchrun rank other than 0).

    ``started_at``: ``time.time()`` when the command started, where the start-up is counted from (None:
    now; under torchrun each rank counts from its own call). ``segment``: the run trains one segment of a
    follow run (train/follow.py; never under torchrun), None for an ordinary run.

    One run at a time per ``--out``: the launcher (under torchrun: rank 0) holds ``OUT/lock``, and a
    second run into the same directory is refused naming the holder (``LockedError``)."""
    started_at = time.time() if started_at is None else started_at
    check_writable_dir(config.out_dir, option=field_ref(TrainConfig, "out_dir"))
    check_run_out(config.out_dir, option=field_ref(TrainConfig, "out_dir"))
    if config.logging.tensorboard_dir is not None:
        check_writable_dir(config.logging.tensorboard_dir, option=field_ref(LoggingConfig, "tensorboard_dir"))
    if under_torchrun():
        info = dist_info_from_env(use_cuda=torch.cuda.is_available())
        if info.device.type == "cpu" and config.launch.threads_per_worker > 0:
            torch.set_num_threads(config.launch.threads_per_worker)  # --threads, as for spawned workers
        lock = acquire_lock(config.out_dir, what="training run") if info.is_main else None
        try:
            result = train_rank(config, info, started_at=started_at)
        finally:
            shutdown(info)
            if lock is not None:
                lock.release()
        return result if info.is_main else None
    with hold_lock(config.out_dir, what="training run"):
        return _run_training_locked(config, started_at, segment)


def _run_training_locked(
    config: TrainConfig, started_at: float, segment: SegmentStart | None
) -> TrainResult | None:
    if config.launch.world_size == 1:
        if config.launch.gpus:
            info = init_distributed(rank=0, world_size=1, local_rank=config.launch.gpus[0], use_cuda=True)
        else:
            torch.set_num_threads(_cpu_threads(config))
            info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
        return train_rank(config, info, started_at=started_at, segment=segment)
    start = time.perf_counter()
    wall = _spawn(config, started_at, segment)
    # The ranks ran in other processes: read what rank 0 logged.
    from dflash_offline.train.metrics import read_metrics, recorded_number, validation_records

    metrics_path = config.out_dir / "metrics.jsonl"
    metrics = read_metrics(metrics_path) if metrics_path.exists() else []
    last = metrics[-1] if metrics else {}
    step = int(last.get("step", 0))  # type: ignore[call-overload]
    # The tracker's criterion; lines of a run resumed from before chain τ do not carry it.
    validated = [r for r in validation_records(metrics) if "val_chain_tau" in r]
    best = max(validated, key=lambda r: recorded_number(r["val_chain_tau"]), default=None)
    return TrainResult(
        global_step=step,
        total_steps=step,
        final_loss=recorded_number(last["loss"]) if "loss" in last else None,
        export_dir=config.out_dir / "drafter" if config.checkpoint.export_at_end else None,
        seconds=time.perf_counter() - start,
        best_validation_tau=None if best is None else recorded_number(best["val_chain_tau"]),
        best_validation_step=0 if best is None else int(best["step"]),  # type: ignore[call-overload]
        wall=wall,
    )
