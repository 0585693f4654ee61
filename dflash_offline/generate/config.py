"""The typed configuration of one ``dflash generate`` run (where its workers run: ``placement.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.cache.commit_policy import DEFAULT_FLUSH_BYTES, DEFAULT_FLUSH_SECONDS
from dflash_offline.data.schemas import DataFormat, parse_data_format
from dflash_offline.errors import ConfigError
from dflash_offline.placement import Placement


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
    """Explicit captured layers, ascending and unique (checked against the target's depth); None =
    the DFlash default for ``num_features``."""
    num_features: int | None = None
    """Features for the default rule (None = 5); not together with ``layer_ids``."""
    bucket_edges: tuple[int, ...] = (256, 512, 1024, 2048, 3072)
    tokens_per_batch: int = 16384
    max_batch_size: int = 256
    window_records: int = 8192
    seed: int = 0
    codec: str | None = None
    """Shard codec name; None = the cache library's default."""
    fsync: bool = False
    flush_seconds: float = DEFAULT_FLUSH_SECONDS
    """Each worker commits its written samples at least this often..."""
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    """...or once this many raw bytes of samples wait uncommitted (what a kill can lose)."""
    placement: Placement = Placement()  # noqa: RUF009 (frozen: a shared default is safe)
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
        if self.num_features is not None and self.num_features <= 0:
            raise ConfigError(f"--num-features {self.num_features}: must be positive")
        if self.num_features is not None and self.layer_ids is not None:
            raise ConfigError(
                f"--num-features {self.num_features} and --layer-ids "
                f"{','.join(map(str, self.layer_ids))} both given: --layer-ids already says how many "
                f"features; give one of them"
            )
        if self.tokens_per_batch < 1 or self.max_batch_size < 1 or self.window_records < 1:
            raise ConfigError("--tokens-per-batch, --max-batch-size and --window must be positive")
        if self.flush_seconds < 0 or self.flush_bytes < 1:
            raise ConfigError(
                f"--flush-seconds {self.flush_seconds} must be >= 0 and --flush-bytes {self.flush_bytes} >= 1"
            )
        if self.writer_queue_depth < 1:
            raise ConfigError("writer_queue_depth must be positive")
        parse_data_format(self.data_format)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        d["data"] = None if self.data is None else str(self.data)
        return d
