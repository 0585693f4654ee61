"""Start training where the config says: one DDP process per GPU (spawned), ``torchrun`` ranks, or
CPU processes over gloo. One process trains in-process (no spawn)."""

from __future__ import annotations

import os
import time

import torch

from dflash_offline.lifeline import die_with_parent
from dflash_offline.locking import acquire_lock, hold_lock
from dflash_offline.torchrun import under_torchrun
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.dist import (
    DistInfo,
    dist_info_from_env,
    free_port,
    init_distributed,
    shutdown,
)
from dflash_offline.train.loop import TrainResult, train_rank


def _set_cpu_threads(config: TrainConfig) -> None:
    threads = config.threads_per_worker or max(1, (os.cpu_count() or 1) // config.world_size)
    torch.set_num_threads(threads)


def _spawned(local_rank: int, config: TrainConfig, port: int) -> None:
    die_with_parent()  # a killed launcher must not leave DDP ranks (and their GPU memory) behind
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


def run_training(config: TrainConfig) -> TrainResult | None:
    """Train; returns the result in the main process (None in a torchrun rank other than 0).

    One run at a time per ``--out``: the launcher (under torchrun: rank 0) holds ``OUT/lock``, and a
    second run into the same directory is refused naming the holder (``LockedError``)."""
    if under_torchrun():
        info = dist_info_from_env(use_cuda=torch.cuda.is_available())
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
    import torch.multiprocessing as mp

    start = time.perf_counter()
    mp.spawn(_spawned, args=(config, free_port()), nprocs=config.world_size, join=True)
    # The ranks ran in other processes: read what rank 0 logged.
    from dflash_offline.train.metrics import read_metrics

    metrics_path = config.out_dir / "metrics.jsonl"
    metrics = read_metrics(metrics_path) if metrics_path.exists() else []
    last = metrics[-1] if metrics else {}
    step = int(last.get("step", 0))  # type: ignore[call-overload]
    return TrainResult(
        global_step=step,
        total_steps=step,
        final_loss=float(last["loss"]) if "loss" in last else None,  # type: ignore[arg-type]
        export_dir=config.out_dir / "drafter" if config.export_at_end else None,
        seconds=time.perf_counter() - start,
    )
