"""Where the workers of a run sit, shared by generate, regenerate and train: the ``--gpus`` parser,
the spawned-worker ``Placement`` and the data-parallel ``DistInfo`` of one rank (also under
``torchrun``). Importing it does not import torch (the CLI's start-up stays fast)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_offline.config_fields import GPUS, THREADS, WORKERS, check_fields, cli_field, field_ref
from dflash_offline.errors import ConfigError

if TYPE_CHECKING:
    import torch


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (every rank is then one worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_device() -> str:
    """A torchrun rank's device: the ``LOCAL_RANK``-th GPU, or the CPU when none is visible."""
    import torch

    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where the target workers run: one process per listed GPU, or ``num_cpu_workers`` CPU processes."""

    gpus: tuple[int, ...] = ()
    """CUDA device indices, one worker each; empty on CPU."""
    num_cpu_workers: int = cli_field(1, cli=WORKERS)
    """Worker processes when ``gpus`` is empty."""
    threads_per_worker: int = cli_field(0, cli=THREADS)
    """torch intra-op threads per CPU worker; 0 = the machine's cores divided among the workers."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def num_workers(self) -> int:
        return len(self.gpus) if self.gpus else self.num_cpu_workers

    def device_of(self, worker: int) -> str:
        return f"cuda:{self.gpus[worker]}" if self.gpus else "cpu"

    def cpu_threads(self) -> int:
        if self.threads_per_worker > 0:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // self.num_workers)


def parse_gpus(text: str | None) -> tuple[int, ...]:
    """``all`` -> every visible CUDA device; ``0,1`` or ``0-3`` -> those; None or ``none`` -> ()."""
    if text is None or text.strip().lower() in ("", "none", "cpu"):
        return ()
    import torch

    available = torch.cuda.device_count()
    if text.strip().lower() == "all":
        if available == 0:
            raise ConfigError(
                f"{field_ref(GPUS)} all: no CUDA device is visible; use {field_ref(WORKERS)} N to run "
                "on the CPU"
            )
        return tuple(range(available))
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                ids.extend(range(lo, hi + 1))
            else:
                ids.append(int(part))
        except ValueError as e:
            raise ConfigError(f"{field_ref(GPUS)} {text!r}: expected 'all', '0,1,2' or '0-7'") from e
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{field_ref(GPUS)} {text!r} names a device twice")
    bad = [i for i in ids if i < 0 or i >= available]
    if bad:
        raise ConfigError(f"{field_ref(GPUS)} {text!r}: device(s) {bad} do not exist ({available} visible)")
    return tuple(ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class DistInfo:
    """Where this process sits in the data-parallel group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    """``nccl`` on CUDA, ``gloo`` on the CPU, ``none`` when single-process."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def barrier(info: DistInfo) -> None:
    """Wait until every rank of ``info``'s process group gets here (nothing in a single process)."""
    if info.distributed:
        import torch.distributed as dist

        dist.barrier()


def free_port() -> int:
    """A free TCP port on localhost for a process group started by us (not torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
