"""DuckDB over the manifest: load the Parquet parts into the schema's tables, or open index.duckdb.

``manifests/schema.sql`` defines the tables and views once; both the index file (``dflash index``) and
the in-memory database behind ``dflash sql`` / ``dflash status`` are built by ``load_manifest``, so a
query means the same thing against a finished index and against a cache still being written.

DuckDB traps honoured here (docs/facts.md#duckdb): rows go in through ``read_parquet`` (of parts
checked against their sha256 first) and registered Arrow tables, never ``executemany``; every result is
fetched completely before the next statement runs on its connection; index.duckdb is opened read-only
(a read-write connection locks out every other process), and only through ``index_catalogue.open_index``
(sandboxed, its catalogue checked against the schema before anything stored in it is evaluated).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import duckdb
import pyarrow as pa

from dflash_offline.cache.index_catalogue import IndexHealth, IndexUnusableError, open_index
from dflash_offline.cache.layout import MANIFEST_TABLES, CacheLayout, read_fingerprint, read_format_version
from dflash_offline.cache.manifest import check_parts, current_parts, read_parts
from dflash_offline.cache.sql_confine import confine
from dflash_offline.errors import CacheFormatError
from dflash_offline.sql_files import quote_literal, read_schema, split_statements

Source = Literal["auto", "manifest", "index"]

_FIRST_COMMIT = "ORDER BY created_at, shard, row_start"
"""Which copy of a duplicated sample_id counts: the first committed (as in ``SampleTable``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestLoad:
    """What ``load_manifest`` put into the database."""

    samples: int
    duplicates: int
    """Sample rows dropped because their sample_id was committed earlier."""
    failures: int
    shards: int
    runs: int
    parts: int
    """Parquet parts read."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartStamp:
    """One manifest part as seen on disk (how ``auto`` decides whether index.duckdb is current)."""

    manifest_table: str
    file: str
    """Path relative to the cache root."""
    mtime_ns: int


def _file_list(paths: list[Path]) -> str:
    return "[" + ", ".join(quote_literal(str(p)) for p in paths) + "]"


def part_stamps(root: str | Path) -> list[PartStamp]:
    """Every manifest part on disk now, with its modification time (a part rewritten in place, by
    hand or by a tool, makes the index stale)."""
    layout = CacheLayout.at(root)
    stamps = []
    for table in MANIFEST_TABLES:
        for path in layout.parts(table):
            try:
                mtime = path.stat().st_mtime_ns
            except FileNotFoundError:  # pragma: no cover - a part moved aside by repair right now
                continue
            stamps.append(
                PartStamp(manifest_table=table, file=str(path.relative_to(layout.root)), mtime_ns=mtime)
            )
    return stamps


def _insert_arrow(con: duckdb.DuckDBPyConnection, table: str, arrow: pa.Table) -> None:
    name = f"_arrow_{table}"
    con.register(name, arrow)
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {name}")
    finally:
        con.unregister(name)


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    # Not a new cursor: a cursor does not inherit the connection's `USE idx`. Fetched at once.
    row = con.execute(sql).fetchall()[0]
    return int(row[0])


def load_manifest(con: duckdb.DuckDBPyConnection, root: str | Path) -> ManifestLoad:
    """Create the schema in ``con``'s current database and fill it from the cache's manifest.

    Every part's bytes are first checked against the sha256 in its name (``manifest.check_parts``):
    a damaged part stops the load with a ``ManifestDamageError`` naming it, never a silently changed
    table. A part DuckDB cannot read (only possible in a format 1 cache, whose parts carry no sha256)
    is named in the shared ``manifest.read_parts`` message, not DuckDB's bare one."""
    try:
        return _load_manifest(con, root)
    except duckdb.Error as e:
        _raise_unreadable_part(root)
        raise CacheFormatError(f"the manifest of {CacheLayout.at(root).root} cannot be loaded ({e})") from e


def _raise_unreadable_part(root: str | Path) -> None:
    """Find the part behind a DuckDB read error (only on failure: every part is read whole, as a
    damaged page deep inside a part fails only there, not at its footer)."""
    layout = CacheLayout.at(root)
    for table in MANIFEST_TABLES:
        for path in layout.parts(table):
            read_parts(table, [path], legacy_names=True)  # raises the shared message naming the file


def _load_manifest(con: duckdb.DuckDBPyConnection, root: str | Path) -> ManifestLoad:
    layout = CacheLayout.at(root)
    fingerprint = read_fingerprint(root)
    legacy_names = read_format_version(root) == 1
    for statement in split_statements(read_schema()):
        con.execute(statement)
    stamps = part_stamps(root)
    files = _checked_part_files(layout, stamps, legacy_names=legacy_names)
    if files["samples"]:
        _load_samples(con, files["samples"])
    for table in ("failures", "shards", "runs", "seals", "retirements", "waits"):
        if files[table]:
            # By name across parts: a run part written before ``plan_ended_at`` existed has NULL there.
            con.execute(
                f"INSERT INTO {table} BY NAME SELECT * FROM "
                f"read_parquet({_file_list(files[table])}, union_by_name = true)"
            )
    _insert_buckets(con, list(fingerprint.bucket_edges))
    _insert_parts(con, stamps)
    duplicates = _count(con, "SELECT count(*) FROM duplicates")
    meta = {
        "format_version": str(read_format_version(root)),
        "fingerprint_json": json.dumps(fingerprint.to_dict(), sort_keys=True),
        "duplicates_dropped": str(duplicates),
    }
    _insert_arrow(con, "meta", pa.table({"key": list(meta), "value": list(meta.values())}))
    return ManifestLoad(
        samples=_count(con, "SELECT count(*) FROM samples"),
        duplicates=duplicates,
        failures=_count(con, "SELECT count(*) FROM failures"),
        shards=_count(con, "SELECT count(*) FROM shards"),
        runs=_count(con, "SELECT count(*) FROM runs"),
        parts=len(stamps),
    )


def _checked_part_files(
    layout: CacheLayout, stamps: list[PartStamp], *, legacy_names: bool
) -> dict[str, list[Path]]:
    """table -> its current parts, each checked against the sha256 in its name."""
    files = {
        t: current_parts(t, [layout.root / s.file for s in stamps if s.manifest_table == t])
        for t in MANIFEST_TABLES
    }
    for table in MANIFEST_TABLES:
        # Hashing is ~1 % of the parse; DuckDB then parses the same immutable files, in parallel.
        check_parts(files[table], legacy_names=legacy_names)
    return files


def _load_samples(con: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
    """Fill ``samples`` with the first commit of each sample_id and ``duplicates`` with the later ones
    (by column name: a part of format 1 or 2 has no ``conversation_root``, NULL here)."""
    con.execute(
        "CREATE TEMP TABLE _samples AS SELECT *, "
        f"row_number() OVER (PARTITION BY sample_id {_FIRST_COMMIT}) "
        f"AS _copy FROM read_parquet({_file_list(files)}, union_by_name = true)"
    )
    con.execute("INSERT INTO samples BY NAME SELECT * EXCLUDE (_copy) FROM _samples WHERE _copy = 1")
    con.execute(
        "INSERT INTO duplicates SELECT sample_id, shard, row_start, created_at FROM _samples WHERE _copy > 1"
    )
    con.execute("DROP TABLE _samples")


def _insert_buckets(con: duckdb.DuckDBPyConnection, edges: list[int]) -> None:
    """One row per length bucket: its id and its largest length (None for the overflow bucket)."""
    buckets = {
        "bucket_id": pa.array(range(len(edges) + 1), pa.int32()),
        "max_tokens": pa.array([*edges, None], pa.int32()),
    }
    _insert_arrow(con, "buckets", pa.table(buckets))


def _insert_parts(con: duckdb.DuckDBPyConnection, stamps: list[PartStamp]) -> None:
    """The parts loaded, as ``index_is_current`` compares them with the parts on disk."""
    parts = {
        "manifest_table": [s.manifest_table for s in stamps],
        "file": [s.file for s in stamps],
        "mtime_ns": pa.array([s.mtime_ns for s in stamps], pa.int64()),
    }
    _insert_arrow(con, "parts", pa.table(parts))


def index_health(root: str | Path) -> IndexHealth:
    """Whether index.duckdb is absent, current (built from exactly the manifest parts on disk now),
    stale, or unreadable (``index_catalogue.open_index`` refuses it)."""
    layout = CacheLayout.at(root)
    if not layout.index_path.is_file():
        return IndexHealth(state="absent")
    try:
        con = open_index(root)
    except IndexUnusableError as e:
        return IndexHealth(state="unreadable", problem=e.problem)
    try:
        current = _built_from_parts_on_disk(con, root)
    except duckdb.Error as e:
        return IndexHealth(state="unreadable", problem=f"its parts table cannot be read ({e})")
    finally:
        con.close()
    return IndexHealth(state="current" if current else "stale")


def index_is_current(root: str | Path) -> bool:
    return index_health(root).state == "current"


def _built_from_parts_on_disk(con: duckdb.DuckDBPyConnection, root: str | Path) -> bool:
    """``con``: an index opened by ``open_index`` (its ``parts`` is the schema's table)."""
    rows = con.cursor().execute("SELECT manifest_table, file, mtime_ns FROM parts").fetchall()
    indexed = {PartStamp(manifest_table=t, file=f, mtime_ns=int(m)) for t, f, m in rows}
    return indexed == set(part_stamps(root))


@dataclass(frozen=True, kw_only=True, slots=True)
class QueryDatabase:
    """A DuckDB connection with the cache's tables and views, and where they came from."""

    con: duckdb.DuckDBPyConnection
    source: Literal["manifest", "index"]
    """``manifest``: loaded in memory from the Parquet parts now; ``index``: index.duckdb, read-only."""


def open_query_database(
    root: str | Path,
    source: Source = "auto",
    *,
    connected: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
) -> QueryDatabase:
    """``manifest`` loads the live Parquet manifest into memory (works while writers run); ``index``
    opens index.duckdb read-only; ``auto`` uses the index only when it is current and its catalogue is
    the schema's (else the manifest). Either connection is confined to the cache's files
    (``sql_guard.confine``) before it is returned. ``connected`` is called with each connection as soon
    as it exists (so that a long manifest load can be interrupted)."""
    layout = CacheLayout.at(root)
    read_fingerprint(root)  # a clear error for a path that is not a cache
    if source == "index" and not layout.index_path.is_file():
        raise CacheFormatError(
            f"{layout.index_path} does not exist; build it with `dflash index {layout.root}`"
        )
    if source != "manifest" and layout.index_path.is_file():
        index = _open_index_for(root, source)
        if index is not None:
            if connected is not None:
                connected(index)
            return QueryDatabase(con=index, source="index")
    con = duckdb.connect(":memory:")
    try:
        if connected is not None:
            connected(con)
        load_manifest(con, root)
        confine(con, layout.root)
    except BaseException:
        con.close()
        raise
    return QueryDatabase(con=con, source="manifest")


def _open_index_for(root: str | Path, source: Source) -> duckdb.DuckDBPyConnection | None:
    """The checked index for ``source`` ``index`` (or its one-line refusal); for ``auto`` only when it is
    usable and current (None otherwise: the manifest answers)."""
    try:
        con = open_index(root)
    except IndexUnusableError:
        if source == "index":
            raise
        return None
    try:
        if source == "index" or _built_from_parts_on_disk(con, root):
            return con
    except duckdb.Error:
        pass  # an unusable parts table: the manifest answers
    con.close()
    return None
