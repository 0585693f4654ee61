"""The index snapshot: the set of committed samples a training run trains on.

``dflash train`` trains on whatever the cache has committed when it starts, so a cache that a
generate run is still filling (or that was stopped) is usable. The snapshot freezes that set: it is
saved in the run directory, and a resume loads it instead of re-reading the index, so the plan (a pure
function of seed, epoch and snapshot) is the same even if generate has committed samples since.

Samples are kept in a canonical order (sorted by sample id), so the snapshot and every plan built on
it are independent of the order in which the cache's workers committed rows. ``reader_rows_N`` binds
the snapshot to one open ``CacheReader`` (it is never saved: rows may move when the index is rebuilt).

Shape legend: N = samples in the snapshot.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_offline.errors import CacheFormatError

SNAPSHOT_FILE = "snapshot.parquet"
"""A run's snapshot, in its ``--out`` directory."""
SNAPSHOT_FORMAT_VERSION = 1
_META_VERSION = b"dflash_snapshot_version"
_META_ID = b"dflash_snapshot_id"


class _SampleTableLike(Protocol):
    sample_id: Any
    num_tokens: Any
    bucket_id: Any


class _ReaderLike(Protocol):
    @property
    def samples(self) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexSnapshot:
    """The committed samples a run trains on, in canonical (sample id) order."""

    sample_ids: tuple[str, ...]
    """[N] sample ids, sorted ascending."""
    num_tokens_N: np.ndarray
    """int64 [N]: tokens of each sample."""
    bucket_ids_N: np.ndarray
    """int64 [N]: bucket of each sample (as stored in the cache)."""
    snapshot_id: str
    """sha256 hex of (sample_id, num_tokens, bucket_id) for every sample: names the set in planner state."""
    reader_rows_N: np.ndarray
    """int64 [N]: row of each sample in the bound reader's SampleTable; -1 when not bound to a reader."""

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens_N.sum())


def compute_snapshot_id(
    sample_ids: tuple[str, ...] | pa.Array, num_tokens_N: np.ndarray, bucket_ids_N: np.ndarray
) -> str:
    """sha256 of the header, then ``f"{sample_id}\t{num_tokens}\t{bucket_id}\n"`` for every sample:
    the lines are built by Arrow in one pass (a Python loop took ≈ 1 s per million samples)."""
    digest = hashlib.sha256()
    digest.update(f"dflash-snapshot-v{SNAPSHOT_FORMAT_VERSION}\n".encode())
    ids = sample_ids if isinstance(sample_ids, pa.Array) else pa.array(list(sample_ids), pa.string())
    if len(ids) != len(num_tokens_N) or len(ids) != len(bucket_ids_N):
        raise CacheFormatError("snapshot columns differ in length")
    if len(ids):
        as_text = [
            ids.cast(pa.large_string()),
            pa.array(np.asarray(num_tokens_N, dtype=np.int64)).cast(pa.large_string()),
            pa.array(np.asarray(bucket_ids_N, dtype=np.int64)).cast(pa.large_string()),
        ]
        lines = pc.binary_join_element_wise(*as_text, pa.scalar("\t", pa.large_string()))
        lines = pc.binary_join_element_wise(
            lines, pa.scalar("", pa.large_string()), pa.scalar("\n", pa.large_string())
        )
        offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)
        start, end = int(offsets[lines.offset]), int(offsets[lines.offset + len(lines)])
        digest.update(memoryview(lines.buffers()[2])[start:end])
    return digest.hexdigest()


def snapshot_from_columns(
    sample_ids: Any,
    num_tokens: Any,
    bucket_ids: Any,
    reader_rows: Any | None = None,
    *,
    ids_are_str_objects: bool = False,
) -> IndexSnapshot:
    """Build a snapshot from parallel columns in any order (sorted here); ``reader_rows`` binds it.
    ``ids_are_str_objects``: ``sample_ids`` is a 1-D object ndarray of ``str`` (a reader's
    SampleTable), whose objects the snapshot then shares."""
    ids_arrow = _string_array(sample_ids)
    tokens = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    buckets = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)
    rows = (
        np.full(len(ids_arrow), -1, dtype=np.int64)
        if reader_rows is None
        else np.asarray(reader_rows, dtype=np.int64).reshape(-1)
    )
    if not len(ids_arrow) == len(tokens) == len(buckets) == len(rows):
        raise CacheFormatError(
            f"snapshot columns differ in length: {len(ids_arrow)} ids, {len(tokens)} token counts, "
            f"{len(buckets)} bucket ids, {len(rows)} rows"
        )
    # Arrow sorts UTF-8 bytes, which is code point order, i.e. Python's str order; stable like the
    # numpy argsort it replaces (which compared Python objects: seconds per million ids).
    order = pc.sort_indices(ids_arrow).to_numpy()
    sorted_arrow = ids_arrow.take(pa.array(order))
    if len(sorted_arrow) > 1:
        same = pc.equal(sorted_arrow[1:], sorted_arrow[:-1]).to_numpy(zero_copy_only=False)
        if same.any():
            dup = sorted_arrow[int(np.argmax(same))].as_py()
            raise CacheFormatError(
                f"sample id {dup!r} appears more than once in the index; run `dflash verify`"
            )
    if ids_are_str_objects:
        # Share the caller's str objects: making a million new ones from Arrow took as long as the sort.
        ids_sorted = tuple(sample_ids[order].tolist())
    else:
        ids_sorted = tuple(sorted_arrow.to_numpy(zero_copy_only=False).tolist())
    tokens, buckets, rows = tokens[order], buckets[order], rows[order]
    return IndexSnapshot(
        sample_ids=ids_sorted,
        num_tokens_N=tokens,
        bucket_ids_N=buckets,
        snapshot_id=compute_snapshot_id(sorted_arrow, tokens, buckets),
        reader_rows_N=rows,
    )


def subset_snapshot(snapshot: IndexSnapshot, keep_N: np.ndarray) -> IndexSnapshot:
    """The samples where ``keep_N`` (bool [N]) is True, in the same (canonical) order, with their own
    snapshot id and the same reader binding."""
    positions = np.flatnonzero(keep_N)
    ids = tuple(snapshot.sample_ids[i] for i in positions.tolist())
    tokens, buckets = snapshot.num_tokens_N[positions], snapshot.bucket_ids_N[positions]
    return IndexSnapshot(
        sample_ids=ids,
        num_tokens_N=tokens,
        bucket_ids_N=buckets,
        snapshot_id=compute_snapshot_id(ids, tokens, buckets),
        reader_rows_N=snapshot.reader_rows_N[positions],
    )


def _string_array(values: Any) -> pa.Array:
    """The ids as an Arrow string array (anything else is converted with ``str`` first)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array) and pa.types.is_string(values.type):
        return values
    try:
        return pa.array(values if isinstance(values, np.ndarray) else list(values), pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([str(v) for v in values], pa.string())


def take_snapshot(reader: _ReaderLike) -> IndexSnapshot:
    """The samples the reader's index has committed now, bound to that reader's rows."""
    table: _SampleTableLike = reader.samples
    num_rows = len(np.asarray(table.num_tokens))
    return snapshot_from_columns(
        table.sample_id,
        table.num_tokens,
        table.bucket_id,
        np.arange(num_rows),
        ids_are_str_objects=isinstance(table.sample_id, np.ndarray) and table.sample_id.dtype == object,
    )


def save_snapshot(snapshot: IndexSnapshot, path: str | os.PathLike[str]) -> None:
    """Write the snapshot as Parquet (temp file, then rename: a crash never leaves half a snapshot)."""
    path = Path(path)
    table = pa.table(
        {
            "sample_id": pa.array(list(snapshot.sample_ids), type=pa.string()),
            "num_tokens": pa.array(snapshot.num_tokens_N, type=pa.int64()),
            "bucket_id": pa.array(snapshot.bucket_ids_N, type=pa.int64()),
        }
    ).replace_schema_metadata(
        {_META_VERSION: str(SNAPSHOT_FORMAT_VERSION).encode(), _META_ID: snapshot.snapshot_id.encode()}
    )
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_snapshot(path: str | os.PathLike[str]) -> IndexSnapshot:
    """Read a saved snapshot, unbound (``reader_rows_N`` = -1); checks its version and its id."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CacheFormatError(f"cannot read the index snapshot {str(path)!r}: {exc}") from exc
    meta = table.schema.metadata or {}
    version = meta.get(_META_VERSION, b"?").decode()
    if version != str(SNAPSHOT_FORMAT_VERSION):
        raise CacheFormatError(
            f"index snapshot {str(path)!r} has format version {version!r}; this dflash reads "
            f"version {SNAPSHOT_FORMAT_VERSION}: resume with the dflash version that started the run"
        )
    snap = snapshot_from_columns(
        table.column("sample_id"),
        table.column("num_tokens").to_numpy(),
        table.column("bucket_id").to_numpy(),
    )
    stored_id = meta.get(_META_ID, b"").decode()
    if stored_id != snap.snapshot_id:
        raise CacheFormatError(
            f"index snapshot {str(path)!r} is damaged: its content hashes to {snap.snapshot_id[:12]}…, "
            f"its header says {stored_id[:12]}…"
        )
    return snap


def bind_snapshot(snapshot: IndexSnapshot, reader: _ReaderLike) -> IndexSnapshot:
    """The same snapshot with ``reader_rows_N`` pointing into ``reader``'s SampleTable.

    Raises ``CacheFormatError`` when the cache no longer holds a snapshot sample, or holds it with a
    different length or bucket (the cache was rebuilt under the run).
    """
    table: _SampleTableLike = reader.samples
    found = pc.index_in(_string_array(snapshot.sample_ids), value_set=_string_array(table.sample_id))
    rows = found.fill_null(-1).to_numpy().astype(np.int64)
    missing = [snapshot.sample_ids[i] for i in np.flatnonzero(rows < 0)[:1].tolist()]
    num_missing = int((rows < 0).sum())
    if missing:
        raise CacheFormatError(
            f"the cache no longer holds {num_missing} of the run's {len(snapshot)} samples "
            f"(first: {missing[0]!r}); resume against the cache the run started on"
        )
    cache_tokens = np.asarray(table.num_tokens, dtype=np.int64)[rows]
    cache_buckets = np.asarray(table.bucket_id, dtype=np.int64)[rows]
    bad = np.flatnonzero((cache_tokens != snapshot.num_tokens_N) | (cache_buckets != snapshot.bucket_ids_N))
    if bad.size:
        i = int(bad[0])
        raise CacheFormatError(
            f"sample {snapshot.sample_ids[i]!r} has {int(cache_tokens[i])} tokens in bucket "
            f"{int(cache_buckets[i])} in the cache but {int(snapshot.num_tokens_N[i])} tokens in bucket "
            f"{int(snapshot.bucket_ids_N[i])} in the run's snapshot; the cache was rebuilt under the run"
        )
    return IndexSnapshot(
        sample_ids=snapshot.sample_ids,
        num_tokens_N=snapshot.num_tokens_N,
        bucket_ids_N=snapshot.bucket_ids_N,
        snapshot_id=snapshot.snapshot_id,
        reader_rows_N=rows,
    )


def load_snapshot(path: str | os.PathLike[str], reader: _ReaderLike) -> IndexSnapshot:
    """Read the run's saved snapshot and bind it to ``reader`` (see ``bind_snapshot``)."""
    return bind_snapshot(read_snapshot(path), reader)
