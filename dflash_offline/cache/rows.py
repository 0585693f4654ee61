"""Typed, frozen records for everything that crosses the cache boundary.

Shape legend: T = tokens of one sample, F = features per token (num_layers * hidden_size),
W = stored bytes per token of an fp8 row (``fp8.Fp8Layout.row_bytes``).
Features travel as bfloat16 tensors and are stored as their uint16 bit patterns (docs/facts.md#bf16-storage),
or, for the fp8 codecs, as fp8 rows: encoded by the writer, or already where the features were (``Fp8Rows``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_offline.errors import SampleError

# torch is imported where a tensor is checked: `dflash sql`, `status` and `--help` read these records
# without it.
if TYPE_CHECKING:
    import torch

    from dflash_offline.cache.lossy import LossyLayout

# Reasons a sample can land in the failures table. Kept as plain strings in the manifest so that SQL
# users read them directly; the tuple documents the closed set.
FAILURE_REASONS = (
    "malformed_record",  # the data set row is not a valid conversation (bad JSON, missing fields, ...)
    "unknown_role",  # a turn's role is none of system/user/assistant (human/gpt/system in ShareGPT)
    "empty_conversation",
    "empty_response",  # no assistant token survives templating (nothing to learn from)
    "template_error",  # the chat template raised
    "too_long",  # longer than --max-len with --too-long skip
    "nonfinite_features",  # NaN/Inf in the captured hidden states
    "truncated_source",  # the data file ends inside a record
    "duplicate_record",  # same id and content as an earlier record of the same source
    "contaminated",  # its user text holds an MT-Bench or HumanEval question (data/decontaminate.py)
)


def record_to_dict(record: Any) -> dict[str, Any]:
    """Field name -> value of a frozen record (shallow: values stay as they are)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def record_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``d`` that are fields of ``cls`` (a missing field raises KeyError naming it)."""
    return {f.name: d[f.name] for f in fields(cls)}


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Rows:
    """A sample's features already encoded as stored fp8 rows (``fp8.encode_rows``), so that the writer
    stores them as they are: generate encodes on the device the features come from."""

    layout: LossyLayout
    """The row layout they were encoded with; the writer refuses rows of another layout than its own."""
    rows_TW: torch.Tensor
    """uint8 [T, W] on the CPU, W = ``layout.row_bytes``."""

    def check(self, where: str, num_tokens: int) -> None:
        """Raise ``SampleError`` unless the rows are uint8 [num_tokens, W] on the CPU."""
        import torch

        rows = self.rows_TW
        if rows.dtype != torch.uint8:
            raise SampleError(f"{where}: fp8 rows must be uint8, got {rows.dtype}")
        if tuple(rows.shape) != (num_tokens, self.layout.row_bytes):
            raise SampleError(
                f"{where}: fp8 rows have shape {tuple(rows.shape)}, expected [{num_tokens}, "
                f"{self.layout.row_bytes}] ({num_tokens} tokens × the layout's row bytes)"
            )
        if rows.device.type != "cpu":
            raise SampleError(f"{where}: fp8 rows must be on the CPU")


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleToWrite:
    """One captured sample handed to a ``ShardWriter``: its features either as bf16 values
    (``features_TF``) or, for a cache of an fp8 codec, already encoded (``fp8_rows``); exactly one."""

    sample_id: str
    """Stable id derived from the data source and the record's content (same across runs and world sizes)."""
    source_index: int
    """Position of the record in its data source (0-based)."""
    input_ids_T: np.ndarray
    """int32 [T]: token ids after templating (no padding)."""
    loss_mask_T: np.ndarray
    """uint8 [T]: 1 exactly on assistant-turn tokens."""
    features_TF: torch.Tensor | None = None
    """bfloat16 [T, F] on the CPU: residual stream after each captured layer, concatenated in ascending
    layer order; None when ``fp8_rows`` holds them."""
    fp8_rows: Fp8Rows | None = None
    """The same features as stored fp8 rows (an fp8 cache only); None when ``features_TF`` holds them."""
    bucket_id: int
    """Index of the first bucket edge >= T."""
    conversation_root: str | None = None
    """The conversation the record belongs to (``data/sources.py:conversation_root``: ShareGPT's ``X_11``
    belongs to ``X``), stored in the sample's row; None when the writer's caller does not know it."""

    def __post_init__(self) -> None:
        num_tokens = int(self.input_ids_T.shape[0]) if self.input_ids_T.ndim == 1 else -1
        where = f"sample {self.sample_id!r}"
        if num_tokens <= 0:
            raise SampleError(f"{where}: input_ids must be a non-empty 1-D array")
        if self.loss_mask_T.shape != (num_tokens,):
            raise SampleError(
                f"{where}: loss_mask has shape {tuple(self.loss_mask_T.shape)}, "
                f"input_ids has {num_tokens} tokens"
            )
        if (self.features_TF is None) == (self.fp8_rows is None):
            raise SampleError(f"{where}: give either features_TF or fp8_rows, not both or neither")
        if self.fp8_rows is not None:
            self.fp8_rows.check(where, num_tokens)
            return
        assert self.features_TF is not None
        import torch

        if self.features_TF.dtype != torch.bfloat16:
            raise SampleError(f"{where}: features must be bfloat16, got {self.features_TF.dtype}")
        if self.features_TF.ndim != 2 or self.features_TF.shape[0] != num_tokens:
            raise SampleError(
                f"{where}: features have shape {tuple(self.features_TF.shape)}, expected [{num_tokens}, F]"
            )
        if self.features_TF.device.type != "cpu":
            raise SampleError(f"{where}: features must be on the CPU")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask_T))


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleRow:
    """One committed sample in the manifest (one row of the ``samples`` table)."""

    sample_id: str
    source_index: int
    shard: str
    """Name of the shard group under ``shards/`` (without the ``.zarr`` suffix)."""
    row_start: int
    """First token row of the sample in the shard's arrays."""
    num_tokens: int
    num_loss_tokens: int
    bucket_id: int
    checksum: int
    """crc32c over the raw bytes: features (uint16 bits), then input_ids (int32), then loss_mask (uint8)."""
    worker: int
    session: str
    created_at: dt.datetime
    conversation_root: str | None = None
    """The record's conversation root (``SampleToWrite.conversation_root``); None in the rows of format 1
    and 2 caches, which did not store it, and where the writer was not given it."""

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SampleRow:
        return cls(**record_fields(cls, d))


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureRow:
    """One sample that could not be cached, with the reason (one row of the ``failures`` table)."""

    sample_id: str
    """Stable id when the record could be parsed, else ``"<source>#<source_index>"``."""
    source_index: int
    reason: str
    """One of ``FAILURE_REASONS``."""
    detail: str
    """Human-readable detail: the exception message, the offending length, the line number, ..."""
    worker: int
    session: str
    created_at: dt.datetime

    def __post_init__(self) -> None:
        if self.reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {self.reason!r}; known: {FAILURE_REASONS}")

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FailureRow:
        return cls(**record_fields(cls, d))


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardInfo:
    """One writer session's Zarr group (one row of the ``shards`` table)."""

    shard: str
    worker: int
    session: str
    feature_width: int
    chunk_rows: int
    """Token rows per compressed inner chunk."""
    shard_rows: int
    """Token rows per Zarr shard (file); every write covers whole shards starting on a shard boundary."""
    codec: str
    created_at: dt.datetime

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardInfo:
        return cls(**record_fields(cls, d))


RUN_STATUSES = ("running", "finished", "interrupted", "failed")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRow:
    """One invocation of a command that writes the cache (one row of the ``runs`` table).

    Rewritten in place (temp file + rename) as the run progresses: ``finished_at`` is None and
    ``status`` is ``running`` until it ends; a run killed without a chance to say so stays ``running``."""

    run_id: str
    """Unique id of the invocation (its revisions are ``manifest/runs/<run_id>.<rev>.<sha256>.parquet``)."""
    command: str
    """``generate``, ``regenerate``, ...: what wrote to the cache."""
    started_at: dt.datetime
    finished_at: dt.datetime | None
    status: str
    """One of ``RUN_STATUSES``."""
    num_workers: int
    samples_committed: int
    """Samples this run committed (not the cache total)."""
    tokens_committed: int
    bytes_written: int
    """Stored (compressed) shard bytes this run wrote."""
    failures: int
    fingerprint_json: str
    """``CacheFingerprint.to_dict()`` as JSON."""
    host: str
    config_json: str = "{}"
    """The command's typed config as JSON (for reproduction)."""
    error: str = ""
    """The error message when ``status`` is ``failed``."""
    plan_ended_at: dt.datetime | None = None
    """When generate's planner was about to hand out the last job of its plan that holds a training
    sample (or found none left to hand out): from then on the run never waits for the disk window, and
    every training sample it commits later lands in a store sealed later (a follow run keeps those
    stores for its final segment, docs/follow.md). None before that, and in runs of older caches."""

    def __post_init__(self) -> None:
        if self.status not in RUN_STATUSES:
            raise ValueError(f"unknown run status {self.status!r}; known: {RUN_STATUSES}")
        if "/" in self.run_id or not self.run_id:
            raise ValueError(f"run_id {self.run_id!r} must be a non-empty file name (no '/')")

    def to_dict(self) -> dict[str, Any]:
        return record_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRow:
        return cls(**record_fields(cls, d))


@dataclass(frozen=True, kw_only=True, slots=True)
class WriterStats:
    """What one ``ShardWriter`` session has committed so far."""

    shard: str
    samples: int
    """Samples committed (their manifest rows are on disk)."""
    tokens: int
    loss_tokens: int
    raw_bytes: int
    """Uncompressed bytes of the committed features, input_ids and loss_mask."""
    stored_bytes: int
    """Bytes of the shard files this session wrote (compressed; includes gaps' padding and indexes)."""
    failures: int
    """Failure rows committed."""
    flushes: int
    """Manifest parts written."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CachedSample:
    """One sample read back from the cache."""

    sample_id: str
    input_ids_T: torch.Tensor
    """int32 [T]."""
    loss_mask_T: torch.Tensor
    """uint8 [T]."""
    features_TF: torch.Tensor
    """bfloat16 [T, F]; empty [T, 0] when read with ``stored_out`` from a lossy (fp8) cache."""
    bucket_id: int
    stored_TW: torch.Tensor | None = None
    """uint8 [T, W]: the stored fp8 rows, only when read with ``stored_out`` (decoded on the device)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])
