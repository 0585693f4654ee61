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
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_offline.errors import CacheFormatError

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

    def bucket_token_shares(self) -> dict[int, float]:
        """Fraction of the snapshot's tokens in each bucket."""
        total = max(self.total_tokens, 1)
        return {
            int(b): float(self.num_tokens_N[self.bucket_ids_N == b].sum()) / total
            for b in np.unique(self.bucket_ids_N)
        }


def compute_snapshot_id(
    sample_ids: tuple[str, ...], num_tokens_N: np.ndarray, bucket_ids_N: np.ndarray
) -> str:
    digest = hashlib.sha256()
    digest.update(f"dflash-snapshot-v{SNAPSHOT_FORMAT_VERSION}\n".encode())
    for sid, n, b in zip(sample_ids, num_tokens_N.tolist(), bucket_ids_N.tolist(), strict=True):
        digest.update(f"{sid}\t{n}\t{b}\n".encode())
    return digest.hexdigest()


def snapshot_from_columns(
    sample_ids: Any, num_tokens: Any, bucket_ids: Any, reader_rows: Any | None = None
) -> IndexSnapshot:
    """Build a snapshot from parallel columns in any order (sorted here); ``reader_rows`` binds it."""
    ids = np.asarray([str(s) for s in sample_ids], dtype=object)
    tokens = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    buckets = np.asarray(bucket_ids, dtype=np.int64).reshape(-1)
    rows = (
        np.full(len(ids), -1, dtype=np.int64)
        if reader_rows is None
        else np.asarray(reader_rows, dtype=np.int64).reshape(-1)
    )
    if not len(ids) == len(tokens) == len(buckets) == len(rows):
        raise CacheFormatError(
            f"snapshot columns differ in length: {len(ids)} ids, {len(tokens)} token counts, "
            f"{len(buckets)} bucket ids, {len(rows)} rows"
        )
    order = np.argsort(ids, kind="stable")
    ids_sorted = tuple(ids[order].tolist())
    if len(set(ids_sorted)) != len(ids_sorted):
        dup = next(a for a, b in itertools.pairwise(ids_sorted) if a == b)
        raise CacheFormatError(f"sample id {dup!r} appears more than once in the index; run `dflash verify`")
    tokens, buckets, rows = tokens[order], buckets[order], rows[order]
    return IndexSnapshot(
        sample_ids=ids_sorted,
        num_tokens_N=tokens,
        bucket_ids_N=buckets,
        snapshot_id=compute_snapshot_id(ids_sorted, tokens, buckets),
        reader_rows_N=rows,
    )


def take_snapshot(reader: _ReaderLike) -> IndexSnapshot:
    """The samples the reader's index has committed now, bound to that reader's rows."""
    table: _SampleTableLike = reader.samples
    num_rows = len(np.asarray(table.num_tokens))
    return snapshot_from_columns(table.sample_id, table.num_tokens, table.bucket_id, np.arange(num_rows))


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
        table.column("sample_id").to_pylist(),
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
    ids = [str(s) for s in np.asarray(table.sample_id).tolist()]
    row_of = {sid: i for i, sid in enumerate(ids)}
    rows = np.asarray([row_of.get(sid, -1) for sid in snapshot.sample_ids], dtype=np.int64)
    missing = [sid for sid, r in zip(snapshot.sample_ids, rows.tolist()) if r < 0]
    if missing:
        raise CacheFormatError(
            f"the cache no longer holds {len(missing)} of the run's {len(snapshot)} samples "
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
