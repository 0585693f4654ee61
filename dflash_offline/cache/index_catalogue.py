"""Opening ``CACHE/index.duckdb`` without trusting it: sandbox first, catalogue checked, then queries.

index.duckdb is a file in the cache that anyone who can write there can replace, and DuckDB evaluates
what a database stores: a view named ``parts`` that calls ``read_text('/elsewhere')`` runs with the
rights of whoever queries ``parts``. So every reader of the index (``dflash sql``, ``dflash status``,
the staleness check behind ``--source auto``) goes through ``open_index``:

1. the connection starts with extension autoload/autoinstall off and no temp directory, and is
   confined (``sql_guard.confine``: only the cache's own files, no network, settings locked) before
   any statement runs;
2. its catalogue (tables, columns, views and their SQL, macros, sequences, indexes, types, schemas,
   constraints; read from DuckDB's ``duckdb_*()`` listings, which evaluate nothing stored) must equal
   the catalogue that ``manifests/schema.sql`` creates in an empty in-memory database; anything else
   (a view where a table should be, an extra macro or table, a changed column) makes the index
   unusable: ``IndexUnusableError``, with what differs and how to rebuild it.

Only then is a query run on it. Nothing else in the package opens index.duckdb (``build_index`` writes a
new file under a temp name and renames it over the old one, never reading the old one).
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import duckdb

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.sql_confine import confine
from dflash_offline.errors import CacheFormatError
from dflash_offline.sql_files import quote_literal, read_schema, split_statements

# One row per catalogue object of the current database: (kind, name, definition). The definition holds
# what DuckDB would evaluate or enforce (a view's SQL, a macro's body, a column's type, default and
# nullability), so two catalogues are equal only when nothing stored in them differs.
_CATALOGUE_SQL = """
SELECT 'table', schema_name || '.' || table_name, '' FROM duckdb_tables()
 WHERE database_name = current_database()
UNION ALL SELECT 'view', schema_name || '.' || view_name, coalesce(sql, '') FROM duckdb_views()
 WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'column', schema_name || '.' || table_name || '.' || column_name,
 column_index || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '')
 FROM duckdb_columns() WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT function_type, schema_name || '.' || function_name, coalesce(macro_definition, '')
 FROM duckdb_functions() WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'sequence', schema_name || '.' || sequence_name, '' FROM duckdb_sequences()
 WHERE database_name = current_database()
UNION ALL SELECT 'index', schema_name || '.' || index_name, coalesce(sql, '') FROM duckdb_indexes()
 WHERE database_name = current_database()
UNION ALL SELECT 'type', schema_name || '.' || type_name, coalesce(logical_type, '') FROM duckdb_types()
 WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'schema', schema_name, '' FROM duckdb_schemas()
 WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'constraint', schema_name || '.' || table_name,
 constraint_type || ' ' || coalesce(constraint_text, '') FROM duckdb_constraints()
 WHERE database_name = current_database()
"""

_ARTICLE_KIND = {
    "table": "a table",
    "view": "a view",
    "column": "a column",
    "macro": "a macro",
    "table_macro": "a table macro",
    "sequence": "a sequence",
    "index": "an index",
    "type": "a type",
    "schema": "a schema",
    "constraint": "a constraint on",
}
"""How a message names a catalogue object's kind (a kind not listed: "an object of kind ...")."""

_NAMED = 3
"""Differences a message names before it says how many more there are."""

STORAGE_VERSION = "v1.0.0"
"""DuckDB storage format of index.duckdb: header version 64, readable by DuckDB >= 1.0 (and 0.10)."""

IndexState = Literal["absent", "current", "stale", "unreadable"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogueEntry:
    """One object of a DuckDB catalogue."""

    kind: str
    """``table``, ``view``, ``column``, ``macro``, ``table_macro``, ``sequence``, ``index``, ``type``,
    ``schema`` or ``constraint``."""
    name: str
    """``schema.object`` (``schema.table.column`` for a column)."""
    definition: str
    """What the object does or holds: a view's SQL, a macro's body, a column's position, type,
    nullability and default; "" where the name says it all."""


class IndexUnusableError(CacheFormatError):
    """index.duckdb cannot be opened, or holds something other than what ``manifests/schema.sql``
    creates; the manifest is intact and the index can be rebuilt from it."""

    def __init__(self, layout: CacheLayout, problem: str) -> None:
        super().__init__(
            f"{layout.index_path}: {problem}; rebuild it with `dflash index {layout.root}` "
            "or query the manifest (--source manifest)"
        )
        self.problem = problem


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexHealth:
    """What ``dflash status`` says about index.duckdb."""

    state: IndexState
    """``absent``; ``current`` (built from exactly the manifest parts on disk); ``stale`` (built from
    other parts); ``unreadable`` (cannot be opened, or its catalogue is not the schema's)."""
    problem: str = ""
    """Why it is unreadable ("" otherwise)."""

    def render(self, root: Path) -> str:
        if self.state == "unreadable":
            return f"unreadable: {self.problem}; rebuild it with `dflash index {root}`"
        if self.state == "stale":
            return f"stale (refresh it with `dflash index {root}`)"
        return self.state


def read_catalogue(con: duckdb.DuckDBPyConnection) -> frozenset[CatalogueEntry]:
    """Every object of ``con``'s current database (evaluates nothing stored in it)."""
    rows = con.execute(_CATALOGUE_SQL).fetchall()  # not a cursor: it would not inherit a `USE`
    return frozenset(CatalogueEntry(kind=k, name=n, definition=d) for k, n, d in rows)


@functools.cache
def schema_catalogue() -> frozenset[CatalogueEntry]:
    """The catalogue ``manifests/schema.sql`` creates, as read back from a file written like the index
    (DuckDB stores a view's SQL re-serialised: the text read back from a file differs from the text of
    the same view in memory)."""
    with tempfile.TemporaryDirectory(prefix="dflash-schema-") as folder:
        path = quote_literal(str(Path(folder) / "schema.duckdb"))
        con = duckdb.connect(":memory:")
        try:
            con.execute(f"ATTACH {path} AS ref (STORAGE_VERSION '{STORAGE_VERSION}')")
            con.execute("USE ref")
            for statement in split_statements(read_schema()):
                con.execute(statement)
            con.execute("USE memory")
            con.execute("DETACH ref")
            con.execute(f"ATTACH {path} AS ref (READ_ONLY)")
            con.execute("USE ref")
            return read_catalogue(con)
        finally:
            con.close()


def catalogue_difference(found: frozenset[CatalogueEntry]) -> str | None:
    """One phrase saying how ``found`` differs from the schema's catalogue (None: it does not)."""
    expected = schema_catalogue()
    extra, missing = found - expected, expected - found
    if not extra and not missing:
        return None
    missing_kinds = {e.name: e.kind for e in missing if not _order(e)[0]}
    extra_names = {(e.kind, e.name) for e in extra}
    phrases: list[tuple[tuple[bool, str], str]] = []
    for e in extra:
        if (e.kind, e.name) in {(m.kind, m.name) for m in missing}:
            phrases.append((_order(e), f"{_named(e)} changed"))
        elif e.name in missing_kinds:
            schema_kind = _ARTICLE_KIND.get(missing_kinds[e.name], missing_kinds[e.name])
            phrases.append((_order(e), f"{_named(e)} where the schema has {schema_kind}"))
        else:
            phrases.append((_order(e), f"{_named(e)} not in the schema"))
    found_names = {e.name for e in extra}
    for m in missing:
        if m.name not in found_names and (m.kind, m.name) not in extra_names:
            phrases.append((_order(m), f"{_named(m)} missing"))
    ordered = [phrase for _, phrase in sorted(phrases)]
    shown = "; ".join(ordered[:_NAMED])
    more = f"; and {len(ordered) - _NAMED} more" if len(ordered) > _NAMED else ""
    return f"its tables and views are not the ones manifests/schema.sql creates ({shown}{more})"


def _order(entry: CatalogueEntry) -> tuple[bool, str]:
    # Whole objects before their columns and constraints: "a view parts" says more than its columns.
    return (entry.kind in ("column", "constraint"), entry.name)


def _named(entry: CatalogueEntry) -> str:
    kind = _ARTICLE_KIND.get(entry.kind, f"an object of kind {entry.kind}")
    return f"{kind} {entry.name.removeprefix('main.')}"


def open_index(root: str | Path) -> duckdb.DuckDBPyConnection:
    """index.duckdb, read-only, confined to the cache's files, its catalogue checked against the schema
    (``IndexUnusableError`` otherwise; a missing file is the caller's case)."""
    layout = CacheLayout.at(root)
    # Set before the file is opened: loading its catalogue must not fetch or load an extension.
    config: dict[str, str | bool | int | float | list[str]] = {
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "temp_directory": "",
    }
    try:
        con = duckdb.connect(str(layout.index_path), read_only=True, config=config)
    except duckdb.Error as e:
        raise IndexUnusableError(layout, f"it cannot be opened ({_first_line(e)})") from e
    try:
        confine(con, layout.root)
        difference = catalogue_difference(read_catalogue(con))
    except duckdb.Error as e:
        con.close()
        raise IndexUnusableError(layout, f"its catalogue cannot be read ({_first_line(e)})") from e
    if difference is not None:
        con.close()
        raise IndexUnusableError(layout, difference)
    return con


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
