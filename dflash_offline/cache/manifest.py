"""The Parquet manifest: one immutable part per writer flush, written to a temp name and renamed.

Readers list ``*.parquet`` only, so they never see a part being written, and a part once renamed never
changes. This is what lets ``dflash sql`` and ``CacheReader`` read a cache while writers are still
adding to it.

Integrity: a part is named ``<stem>.<sha256 of its bytes>.parquet``. The digest travels in the name,
so the one rename that commits a part commits its digest with it: a kill before the rename leaves a
temp file (waste), a kill after it a complete part whose name and bytes agree; no order of two writes
can leave them disagreeing. Every reader (``read_parts``) hashes the bytes it parses and refuses a part
whose bytes do not match its name (``ManifestDamageError``), so a flipped byte can never silently change
the index, the reader's sample table or a query. Format 1 caches named parts ``<stem>.parquet``; those
are still read, unchecked (``legacy_names``).

A run's row changes as it progresses, so runs are written as revisions,
``runs/<run_id>.<revision:06d>.<sha256>.parquet``, and the newest revision of each run counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_offline.cache.layout import CacheLayout, read_format_version, write_atomic
from dflash_offline.cache.rows import FailureRow, RunRow, SampleRow, ShardInfo
from dflash_offline.cache.window_records import StoreRetirement, StoreSeal, WindowWait
from dflash_offline.errors import CacheDamageError, CacheFormatError

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
            ("conversation_root", pa.string()),
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
            ("plan_ended_at", _TS),
        ]
    ),
    "seals": pa.schema(
        [
            ("shard", pa.string()),
            ("validation", pa.bool_()),
            ("num_samples", pa.int64()),
            ("num_tokens", pa.int64()),
            ("reason", pa.string()),
            ("sealed_at", _TS),
        ]
    ),
    "retirements": pa.schema(
        [
            ("shard", pa.string()),
            ("run_id", pa.string()),
            ("num_samples", pa.int64()),
            ("num_tokens", pa.int64()),
            ("retired_at", _TS),
        ]
    ),
    "waits": pa.schema(
        [
            ("run_id", pa.string()),
            ("side", pa.string()),
            ("started_at", _TS),
            ("seconds", pa.float64()),
        ]
    ),
}

ADDED_COLUMNS: dict[str, frozenset[str]] = {
    "samples": frozenset({"conversation_root"}),
    "runs": frozenset({"plan_ended_at"}),
}
"""Columns added to a table after its first version (format 3: ``conversation_root``; ``plan_ended_at``
of a generate run, docs/follow.md): a part written before has none, and reads back with nulls there."""

_RECORD_TYPES: dict[str, Any] = {
    "samples": SampleRow,
    "failures": FailureRow,
    "shards": ShardInfo,
    "runs": RunRow,
    "seals": StoreSeal,
    "retirements": StoreRetirement,
    "waits": WindowWait,
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


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_DIGEST_CHARS = frozenset("0123456789abcdef")


@dataclass(frozen=True, kw_only=True, slots=True)
class PartName:
    """What a part's file name says: ``<stem>.<sha256>.parquet`` (format 1: ``<stem>.parquet``)."""

    stem: str
    digest: str | None
    """The sha256 (hex) its bytes must have; None for a format-1 name."""

    @classmethod
    def parse(cls, path: Path) -> PartName:
        base = path.name.removesuffix(".parquet")
        stem, _, digest = base.rpartition(".")
        if stem and len(digest) == 64 and set(digest) <= _DIGEST_CHARS:
            return cls(stem=stem, digest=digest)
        return cls(stem=base, digest=None)


class ManifestDamageError(CacheDamageError):
    """A manifest part's bytes do not match the sha256 in its name (or it has none in a format-2 cache)."""


def part_problem(path: Path, data: bytes, *, legacy_names: bool) -> str | None:
    """Why the bytes of part ``path`` cannot be trusted, or None when they match its name."""
    name = PartName.parse(path)
    if name.digest is None:
        return None if legacy_names else "its name carries no sha256 (every part of a format-2 cache does)"
    actual = sha256_hex(data)
    if actual != name.digest:
        return f"its bytes hash to sha256 {actual[:16]}…, its name says {name.digest[:16]}…"
    return None


def cache_root_of(part: Path) -> Path:
    """The cache a part belongs to (``CACHE/manifest/<table>/<part>``)."""
    return part.parents[2]


def damaged_part_error(path: Path, problem: str) -> ManifestDamageError:
    return ManifestDamageError(
        f"manifest part {path} is damaged: {problem}; see what repair would do with "
        f"`dflash verify --repair --dry-run {cache_root_of(path)}`"
    )


def write_part(path: Path, arrow: pa.Table, *, fsync: bool = False) -> Path:
    """Write one Parquet part for ``<folder>/<stem>.parquet``: it lands as
    ``<folder>/<stem>.<sha256>.parquet`` (temp file, then one rename: atomic for readers). Returns
    the path written."""
    sink = pa.BufferOutputStream()
    pq.write_table(arrow, sink, compression="zstd")
    data = sink.getvalue().to_pybytes()
    stem = path.name.removesuffix(".parquet")
    final = path.with_name(f"{stem}.{sha256_hex(data)}.parquet")
    write_atomic(final, data, fsync=fsync)
    return final


def read_part_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise CacheFormatError(f"manifest part {path} cannot be read ({e}); check the disk and rerun") from e


def parse_part(table: str, path: Path, data: bytes, columns: Sequence[str] | None = None) -> pa.Table:
    """Parse bytes already checked by ``part_problem`` (cast to the table's schema)."""
    schema = SCHEMAS[table]
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    try:
        # ParquetFile.read: about half the cost of read_table, which sets up a dataset per call.
        piece = pq.ParquetFile(pa.BufferReader(data)).read(columns=list(schema.names))
    except (OSError, pa.ArrowInvalid) as e:
        raise damaged_part_error(path, f"it does not parse as Parquet ({e})") from e
    missing = [name for name in schema.names if name not in piece.schema.names]
    added = ADDED_COLUMNS.get(table, frozenset())
    for name in [m for m in missing if m in added]:  # a part of an older format: null there
        piece = piece.append_column(schema.field(name), pa.nulls(piece.num_rows, schema.field(name).type))
    missing = [name for name in missing if name not in added]
    if missing:  # ParquetFile.read skips requested columns it does not have
        raise damaged_part_error(path, f"it lacks the columns {missing}")
    return piece.select(schema.names).cast(schema)


def read_parts(
    table: str,
    paths: Iterable[Path],
    columns: Sequence[str] | None = None,
    *,
    legacy_names: bool = False,
) -> pa.Table:
    """Concatenate manifest parts of one table (an empty table with the schema when there are none).
    Each part's bytes are checked against the sha256 in its name first (``ManifestDamageError``);
    ``legacy_names`` accepts format-1 names, which carry none."""
    schema = SCHEMAS[table]
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    pieces = []
    for path in paths:
        data = read_part_bytes(path)
        problem = part_problem(path, data, legacy_names=legacy_names)
        if problem is not None:
            raise damaged_part_error(path, problem)
        pieces.append(parse_part(table, path, data, columns))
    if not pieces:
        return schema.empty_table()
    return pa.concat_tables(pieces)


def check_parts(paths: Iterable[Path], *, legacy_names: bool = False) -> None:
    """Check each part's bytes against the sha256 in its name (``ManifestDamageError`` naming the first
    that fails), for a caller that parses the parts itself (DuckDB's ``read_parquet``)."""
    for path in paths:
        problem = part_problem(path, read_part_bytes(path), legacy_names=legacy_names)
        if problem is not None:
            raise damaged_part_error(path, problem)


def current_parts(table: str, paths: Iterable[Path]) -> list[Path]:
    """The parts that count: all of them, except that of a run only its newest revision does."""
    paths = list(paths)
    if table != "runs":
        return paths
    newest: dict[str, tuple[int, Path]] = {}
    for path in paths:
        run_id, revision = run_revision(path)
        if run_id not in newest or revision >= newest[run_id][0]:
            newest[run_id] = (revision, path)
    return sorted(path for _, path in newest.values())


def run_revision(path: Path) -> tuple[str, int]:
    """(run_id, revision) of a runs part; a format-1 ``<run_id>.parquet`` is revision 0."""
    stem = PartName.parse(path).stem
    run_id, _, revision = stem.rpartition(".")
    if run_id and revision.isdigit():
        return run_id, int(revision)
    return stem, 0


def committed_parts(root: str | Path, table: str) -> list[Path]:
    """The parts of a table that readers load (see ``current_parts``)."""
    return current_parts(table, CacheLayout.at(root).parts(table))


def read_table(root: str | Path, table: str, columns: Sequence[str] | None = None) -> pa.Table:
    """Every committed row of one manifest table (each part checked against its sha256)."""
    return read_parts(
        table, committed_parts(root, table), columns, legacy_names=read_format_version(root) == 1
    )


def committed_sample_ids(root: str | Path) -> set[str]:
    """Ids of every committed sample, from the Parquet manifest (works while writers are active)."""
    return set(read_table(root, "samples", ["sample_id"]).column("sample_id").to_pylist())


def failed_sample_ids(root: str | Path) -> set[str]:
    """Ids of every sample with a failure row."""
    return set(read_table(root, "failures", ["sample_id"]).column("sample_id").to_pylist())


def record_run(root: str | Path, run: RunRow) -> None:
    """Write the next revision of ``run`` (``runs/<run_id>.<revision>.<sha256>.parquet``); readers
    take the newest. Earlier revisions stay: removing them would race a reader that listed them."""
    layout = CacheLayout.at(root)
    folder = layout.table_dir("runs")
    folder.mkdir(parents=True, exist_ok=True)
    revisions = [rev for run_id, rev in map(run_revision, layout.parts("runs")) if run_id == run.run_id]
    revision = max(revisions, default=0) + 1
    write_part(folder / f"{run.run_id}.{revision:06d}.parquet", records_to_table("runs", [run]))


def read_runs(root: str | Path) -> list[RunRow]:
    """Every run recorded in the cache, oldest first."""
    runs: list[RunRow] = table_to_records("runs", read_table(root, "runs"))
    return sorted(runs, key=lambda r: (r.started_at, r.run_id))
