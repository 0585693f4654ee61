"""Joining the process group into a ``DistInfo`` (the record lives in ``placement.py``): the same
code runs single-process, as spawned processes (``--gpus`` / ``--workers``) and under ``torchrun``."""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_offline.placement import DistInfo


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


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """In-place sum over ranks (a no-op single-process); returns the tensor."""
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        # Objects in reference cycles (DDP's reducer and the gloo work it holds) are freed now, while the
        # interpreter is alive: freed during its finalization, gloo's threads can abort the process after a
        # finished run (seen once under torchrun on 2 CPU ranks: "terminate called without an active
        # exception", SIGABRT, after the run's last checkpoint; a mitigation, not yet shown to be the cause).
        gc.collect()
        dist.destroy_process_group()
