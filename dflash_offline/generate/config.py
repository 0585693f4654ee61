"""The typed configuration of one ``dflash generate`` run, and where its workers run."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.data.schemas import DataFormat, parse_data_format
from dflash_offline.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where the target workers run: one process per listed GPU, or ``num_cpu_workers`` CPU processes."""

    gpus: tuple[int, ...] = ()
    """CUDA device indices, one worker each; empty on CPU."""
    num_cpu_workers: int = 1
    """Worker processes when ``gpus`` is empty."""
    threads_per_worker: int = 0
    """torch intra-op threads per CPU worker; 0 = the machine's cores divided among the workers."""

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
            raise ConfigError("--gpus all: no CUDA device is visible; use --workers N to run on the CPU")
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
            raise ConfigError(f"--gpus {text!r}: expected 'all', '0,1,2' or '0-7'") from e
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus {text!r} names a device twice")
    bad = [i for i in ids if i < 0 or i >= available]
    if bad:
        raise ConfigError(f"--gpus {text!r}: device(s) {bad} do not exist ({available} visible)")
    return tuple(ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig:
    """Everything ``dflash generate`` needs; the CLI builds it, ``run_generate`` consumes it."""

    cache_dir: Path
    target: str
    """``default``, an HF directory, a ``.gguf`` file or ``random:<preset>``."""
    data: Path | None
    """Chat data set (any container of ``data/containers.py``); None = the embedded ShareGPT file."""
    data_format: DataFormat = "auto"
    """Record schema (``data/schemas.py``); ``auto`` picks one per record."""
    skip: int = 0
    limit: int | None = None
    max_length: int = 3072
    too_long: Literal["truncate", "skip"] = "skip"
    layer_ids: tuple[int, ...] | None = None
    """Explicit captured layers; None = the DFlash default for ``num_features``."""
    num_features: int = 5
    bucket_edges: tuple[int, ...] = (256, 512, 1024, 2048, 3072)
    tokens_per_batch: int = 16384
    max_batch_size: int = 256
    window_records: int = 8192
    seed: int = 0
    codec: str | None = None
    """Shard codec name; None = the cache library's default."""
    fsync: bool = False
    flush_seconds: float = 30.0
    placement: Placement = Placement()
    dtype: str | None = None
    """``float32`` / ``bfloat16``; None = float32 on CPU, bfloat16 on CUDA."""
    progress: bool = True
    build_index: bool = True
    """Merge the manifest into index.duckdb at the end."""
    writer_queue_depth: int = 3
    """Captured batches in flight between a worker's forward loop and its writer thread."""

    def __post_init__(self) -> None:
        if self.max_length <= 1:
            raise ConfigError(f"--max-len {self.max_length}: must be at least 2")
        if self.too_long not in ("truncate", "skip"):
            raise ConfigError(f"--too-long {self.too_long!r}: expected truncate or skip")
        if self.skip < 0 or (self.limit is not None and self.limit < 0):
            raise ConfigError("--skip and --limit must be non-negative")
        if self.num_features <= 0:
            raise ConfigError(f"--num-features {self.num_features}: must be positive")
        if self.tokens_per_batch < 1 or self.max_batch_size < 1 or self.window_records < 1:
            raise ConfigError("--tokens-per-batch, --max-batch-size and --window must be positive")
        if self.writer_queue_depth < 1:
            raise ConfigError("writer_queue_depth must be positive")
        parse_data_format(self.data_format)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        d["data"] = None if self.data is None else str(self.data)
        return d
