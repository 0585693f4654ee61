"""Start training where the config says: one DDP process per GPU (spawned), ``torchrun`` ranks, or
CPU processes over gloo. One process trains in-process (no spawn)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from dflash_offline.config_fields import flag
from dflash_offline.locking import acquire_lock, hold_lock
from dflash_offline.placement import DistInfo, free_port, under_torchrun
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.dist import dist_info_from_env, init_distributed, shutdown
from dflash_offline.train.export_out import check_run_out
from dflash_offline.train.interrupt import TrainInterrupted, stop_on_sigint
from dflash_offline.train.loop import TrainResult, train_rank
from dflash_offline.train.wall_time import WallSplit
from dflash_offline.workers.device import bind_device
from dflash_offline.workers.group import GroupPolicy
from dflash_offline.workers.records import EventSink, StopFlag, WorkerFailed, WorkerSpec, user_error
from dflash_offline.workers.spawned import ChildPolicy, SpawnedWorkers, WorkerExit, forwarding_sigint
from dflash_offline.writable import check_writable_dir


def _cpu_threads(config: TrainConfig) -> int:
    return config.threads_per_worker or max(1, (os.cpu_count() or 1) // config.world_size)


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
    use_cuda = bool(config.gpus)
    bind_device(spec)  # rank r drives the r-th listed GPU (its spec's device), or its CPU threads
    info = init_distributed(
        rank=rank,
        world_size=config.world_size,
        local_rank=config.gpus[rank] if use_cuda else rank,
        use_cuda=use_cuda,
    )
    try:
        return train_rank(config, info, started_at=spec.task.started_at)
    finally:
        shutdown(info)


def _rank_specs(config: TrainConfig, started_at: float) -> list[WorkerSpec[RankTask]]:
    task = RankTask(config=config, port=free_port(), started_at=started_at)
    return [
        WorkerSpec(
            worker=rank,
            num_workers=config.world_size,
            device=f"cuda:{config.gpus[rank]}" if config.gpus else "cpu",
            cpu_threads=None if config.gpus else _cpu_threads(config),
            task=task,
        )
        for rank in range(config.world_size)
    ]


def _spawn(config: TrainConfig, started_at: float) -> WallSplit | None:
    """One spawned process per rank; a rank's DflashError or Ctrl-C reaches the caller as itself, a rank's
    bug or death as the error torch's ``mp.spawn`` raised (with the rank's traceback). Returns rank 0's
    wall split."""
    specs = _rank_specs(config, started_at)
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


def run_training(config: TrainConfig, *, started_at: float | None = None) -> TrainResult | None:
    """Train; returns the result in the main process (None in a torchrun rank other than 0).

    ``started_at``: ``time.time()`` when the command started, where the start-up is counted from (None:
    now; under torchrun each rank counts from its own call).

    One run at a time per ``--out``: the launcher (under torchrun: rank 0) holds ``OUT/lock``, and a
    second run into the same directory is refused naming the holder (``LockedError``)."""
    started_at = time.time() if started_at is None else started_at
    check_writable_dir(config.out_dir, option=flag(TrainConfig, "out_dir"))
    check_run_out(config.out_dir, option=flag(TrainConfig, "out_dir"))
    if config.tensorboard_dir is not None:
        check_writable_dir(config.tensorboard_dir, option=flag(TrainConfig, "tensorboard_dir"))
    if under_torchrun():
        info = dist_info_from_env(use_cuda=torch.cuda.is_available())
        if info.device.type == "cpu" and config.threads_per_worker > 0:
            torch.set_num_threads(config.threads_per_worker)  # --threads, as for spawned workers
        lock = acquire_lock(config.out_dir, what="training run") if info.is_main else None
        try:
            result = train_rank(config, info, started_at=started_at)
        finally:
            shutdown(info)
            if lock is not None:
                lock.release()
        return result if info.is_main else None
    with hold_lock(config.out_dir, what="training run"):
        return _run_training_locked(config, started_at)


def _run_training_locked(config: TrainConfig, started_at: float) -> TrainResult | None:
    if config.world_size == 1:
        if config.gpus:
            info = init_distributed(rank=0, world_size=1, local_rank=config.gpus[0], use_cuda=True)
        else:
            torch.set_num_threads(_cpu_threads(config))
            info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
        return train_rank(config, info, started_at=started_at)
    start = time.perf_counter()
    wall = _spawn(config, started_at)
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
        export_dir=config.out_dir / "drafter" if config.export_at_end else None,
        seconds=time.perf_counter() - start,
        best_validation_tau=None if best is None else recorded_number(best["val_chain_tau"]),
        best_validation_step=0 if best is None else int(best["step"]),  # type: ignore[call-overload]
        wall=wall,
    )
