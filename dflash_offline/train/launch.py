"""Start training where the config says: one DDP process per GPU (spawned), ``torchrun`` ranks, or
CPU processes over gloo. One process trains in-process (no spawn)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from dflash_offline import errors as errors_module
from dflash_offline.errors import DflashError
from dflash_offline.locking import acquire_lock, hold_lock
from dflash_offline.placement import DistInfo, free_port, under_torchrun
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.dist import dist_info_from_env, init_distributed, shutdown
from dflash_offline.train.interrupt import TrainInterrupted, stop_on_sigint
from dflash_offline.train.loop import TrainResult, train_rank
from dflash_offline.workers.lifeline import die_with_parent, quiet_resource_tracker
from dflash_offline.writable import check_writable_dir


def _set_cpu_threads(config: TrainConfig) -> None:
    threads = config.threads_per_worker or max(1, (os.cpu_count() or 1) // config.world_size)
    torch.set_num_threads(threads)


ORPHAN_GRACE_SECONDS = 120.0
"""A rank whose launcher died stops at its step boundary (torch's spawn sets a SIGINT parent-death
signal, a stop request here) and checkpoints; one that has not exited this long after is ended
(a rank blocked in a collective for a dead peer would otherwise live on, holding its GPU)."""


def _spawned(local_rank: int, config: TrainConfig, port: int, errors: Any) -> None:
    die_with_parent(kill_signal=None, grace_seconds=ORPHAN_GRACE_SECONDS)
    # A terminal's Ctrl-C reaches every worker (and the parent forwards it): stop at the step boundary.
    with stop_on_sigint(second_aborts=False):
        try:
            _run_spawned_rank(local_rank, config, port)
        except TrainInterrupted as e:
            errors.put(_RankOutcome(rank=local_rank, kind="interrupted", message=str(e), step=e.step))
            raise SystemExit(130) from None
        except DflashError as e:
            # Carried to the parent as its one-line message (mp.spawn would print the traceback).
            errors.put(_RankOutcome(rank=local_rank, kind=type(e).__name__, message=str(e), step=0))
            raise SystemExit(2) from None


def _run_spawned_rank(local_rank: int, config: TrainConfig, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    use_cuda = bool(config.gpus)
    if use_cuda:
        # Rank r drives the r-th listed GPU.
        torch.cuda.set_device(config.gpus[local_rank])
    else:
        _set_cpu_threads(config)
    info = init_distributed(
        rank=local_rank,
        world_size=config.world_size,
        local_rank=config.gpus[local_rank] if use_cuda else local_rank,
        use_cuda=use_cuda,
    )
    try:
        train_rank(config, info)
    finally:
        shutdown(info)


@dataclass(frozen=True, kw_only=True, slots=True)
class _RankOutcome:
    """Why a spawned rank stopped early, sent to the parent over a queue."""

    rank: int
    kind: str
    """``interrupted`` or the name of the ``DflashError`` subclass raised."""
    message: str
    step: int
    """The step checkpointed before an interrupt (0 otherwise)."""


def _spawn(config: TrainConfig) -> None:
    """mp.spawn, but a rank's DflashError or Ctrl-C reaches the caller as itself, not as a traceback."""
    import torch.multiprocessing as mp

    quiet_resource_tracker()  # before the first queue: a killed run's semaphores are cleaned up quietly
    errors = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(
        _spawned,
        args=(config, free_port(), errors),
        nprocs=config.world_size,
        join=False,
        start_method="spawn",
    )

    def forward(signum: int, frame: FrameType | None) -> None:
        # The parent only waits: pass the request on (a kill -INT of the parent alone must stop the
        # ranks at a step boundary too; they ignore the repeat a terminal's Ctrl-C also sends them).
        for process in context.processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGINT)

    previous = (
        signal.signal(signal.SIGINT, forward)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        while not context.join():
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException):
        outcomes = []
        while not errors.empty():
            outcomes.append(errors.get())
        for outcome in outcomes:
            if outcome.kind == "interrupted":
                raise TrainInterrupted(outcome.step) from None
        for outcome in outcomes:
            cls = getattr(errors_module, outcome.kind, DflashError)
            error = cls.__new__(cls)
            DflashError.__init__(error, outcome.message)
            raise error from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def run_training(config: TrainConfig) -> TrainResult | None:
    """Train; returns the result in the main process (None in a torchrun rank other than 0).

    One run at a time per ``--out``: the launcher (under torchrun: rank 0) holds ``OUT/lock``, and a
    second run into the same directory is refused naming the holder (``LockedError``)."""
    check_writable_dir(config.out_dir, option="--out")
    if config.tensorboard_dir is not None:
        check_writable_dir(config.tensorboard_dir, option="--tensorboard")
    if under_torchrun():
        info = dist_info_from_env(use_cuda=torch.cuda.is_available())
        if info.device.type == "cpu" and config.threads_per_worker > 0:
            torch.set_num_threads(config.threads_per_worker)  # --threads, as for spawned workers
        lock = acquire_lock(config.out_dir, what="training run") if info.is_main else None
        try:
            result = train_rank(config, info)
        finally:
            shutdown(info)
            if lock is not None:
                lock.release()
        return result if info.is_main else None
    with hold_lock(config.out_dir, what="training run"):
        return _run_training_locked(config)


def _run_training_locked(config: TrainConfig) -> TrainResult | None:
    if config.world_size == 1:
        if config.gpus:
            info = init_distributed(rank=0, world_size=1, local_rank=config.gpus[0], use_cuda=True)
        else:
            _set_cpu_threads(config)
            info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
        return train_rank(config, info)
    start = time.perf_counter()
    _spawn(config)
    # The ranks ran in other processes: read what rank 0 logged.
    from dflash_offline.train.metrics import read_metrics, validation_records

    metrics_path = config.out_dir / "metrics.jsonl"
    metrics = read_metrics(metrics_path) if metrics_path.exists() else []
    last = metrics[-1] if metrics else {}
    step = int(last.get("step", 0))  # type: ignore[call-overload]
    validated = validation_records(metrics)
    best = max(validated, key=lambda r: float(r["val_simulated_tau"]), default=None)  # type: ignore[arg-type]
    return TrainResult(
        global_step=step,
        total_steps=step,
        final_loss=float(last["loss"]) if "loss" in last else None,  # type: ignore[arg-type]
        export_dir=config.out_dir / "drafter" if config.export_at_end else None,
        seconds=time.perf_counter() - start,
        best_validation_tau=None if best is None else float(best["val_simulated_tau"]),  # type: ignore[arg-type]
        best_validation_step=0 if best is None else int(best["step"]),  # type: ignore[call-overload]
    )
