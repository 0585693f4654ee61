"""The Parquet manifest: one immutable part per writer flush, written to a temp name and renamed.

Readers list ``*.parquet`` only, so they never see a part being written, and a part once renamed never
changes (runs are the exception: ``manifest/runs/<run_id>.parquet`` is replaced whole, atomically).
This is what lets ``dflash sql`` and ``CacheReader`` read a cache while writers are still adding to it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_offline.cache.layout import CacheLayout, fsync_dir, temp_path
from dflash_offline.cache.records import FailureRow, RunRow, SampleRow, ShardInfo
from dflash_offline.errors import CacheFormatError

_TS = pa.timestamp("us", tz="UTC")

SCHEMAS: dict[str, pa.Schema] = {
    "samples": pa.schema(
        [
            ("sample_id", pa.string()),
            ("source_index", pa.int64()),
            ("shard", pa.string()),
            ("row_start", pa.int64()),
            ("num_tokens", pa.int32()),
            ("num_loss_tokens", pa.int32()),
            ("bucket_id", pa.int32()),
            ("checksum", pa.uint32()),
            ("worker", pa.int32()),
            ("session", pa.string()),
            ("created_at", _TS),
        ]
    ),
    "failures": pa.schema(
        [
            ("sample_id", pa.string()),
            ("source_index", pa.int64()),
            ("reason", pa.string()),
            ("detail", pa.string()),
            ("worker", pa.int32()),
            ("session", pa.string()),
            ("created_at", _TS),
        ]
    ),
    "shards": pa.schema(
        [
            ("shard", pa.string()),
            ("worker", pa.int32()),
            ("session", pa.string()),
            ("feature_width", pa.int32()),
            ("chunk_rows", pa.int32()),
            ("shard_rows", pa.int32()),
            ("codec", pa.string()),
            ("created_at", _TS),
        ]
    ),
    "runs": pa.schema(
        [
            ("run_id", pa.string()),
            ("command", pa.string()),
            ("started_at", _TS),
            ("finished_at", _TS),
            ("status", pa.string()),
            ("num_workers", pa.int32()),
            ("samples_committed", pa.int64()),
            ("tokens_committed", pa.int64()),
            ("bytes_written", pa.int64()),
            ("failures", pa.int64()),
            ("fingerprint_json", pa.string()),
            ("host", pa.string()),
            ("config_json", pa.string()),
            ("error", pa.string()),
        ]
    ),
}

_RECORD_TYPES: dict[str, Any] = {
    "samples": SampleRow,
    "failures": FailureRow,
    "shards": ShardInfo,
    "runs": RunRow,
}


def records_to_table(table: str, records: Sequence[Any]) -> pa.Table:
    """Arrow table of manifest records (``SampleRow``, ``FailureRow``, ``ShardInfo`` or ``RunRow``)."""
    schema = SCHEMAS[table]
    record_type = _RECORD_TYPES[table]
    assert all(isinstance(r, record_type) for r in records), f"{table} expects {record_type.__name__}"
    columns = {name: [getattr(r, name) for r in records] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)


def table_to_records(table: str, arrow: pa.Table) -> list[Any]:
    """The inverse of ``records_to_table``: one record per row (timestamps come back as aware datetimes)."""
    record_type = _RECORD_TYPES[table]
    return [record_type.from_dict(row) for row in arrow.to_pylist()]


def write_part(path: Path, arrow: pa.Table, *, fsync: bool = False) -> None:
    """Write one Parquet part under a temp name, then rename it into place (atomic for readers)."""
    tmp = temp_path(path)
    try:
        pq.write_table(arrow, tmp, compression="zstd")
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    if fsync:
        fsync_dir(path.parent)


def read_parts(table: str, paths: Iterable[Path], columns: Sequence[str] | None = None) -> pa.Table:
    """Concatenate manifest parts of one table (an empty table with the schema when there are none)."""
    schema = SCHEMAS[table]
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    pieces = []
    for path in paths:
        try:
            piece = pq.read_table(path, columns=list(schema.names))
        except (OSError, pa.ArrowInvalid) as e:
            raise CacheFormatError(
                f"manifest part {path} cannot be read ({e}); move it aside and rerun"
            ) from e
        pieces.append(piece.cast(schema))
    if not pieces:
        return schema.empty_table()
    return pa.concat_tables(pieces)


def read_table(root: str | Path, table: str, columns: Sequence[str] | None = None) -> pa.Table:
    """Every committed row of one manifest table."""
    return read_parts(table, CacheLayout.at(root).parts(table), columns)


def committed_sample_ids(root: str | Path) -> set[str]:
    """Ids of every committed sample, from the Parquet manifest (works while writers are active)."""
    return set(read_table(root, "samples", ["sample_id"]).column("sample_id").to_pylist())


def failed_sample_ids(root: str | Path) -> set[str]:
    """Ids of every sample with a failure row."""
    return set(read_table(root, "failures", ["sample_id"]).column("sample_id").to_pylist())


def record_run(root: str | Path, run: RunRow) -> None:
    """Write or overwrite ``manifest/runs/<run_id>.parquet`` (temp file + rename)."""
    layout = CacheLayout.at(root)
    folder = layout.table_dir("runs")
    folder.mkdir(parents=True, exist_ok=True)
    write_part(folder / f"{run.run_id}.parquet", records_to_table("runs", [run]))


def read_runs(root: str | Path) -> list[RunRow]:
    """Every run recorded in the cache, oldest first."""
    runs: list[RunRow] = table_to_records("runs", read_table(root, "runs"))
    return sorted(runs, key=lambda r: (r.started_at, r.run_id))
