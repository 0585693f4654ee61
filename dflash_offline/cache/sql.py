"""``dflash sql``: run one SQL statement (or a named query from ``manifests/queries/``) against a cache.

The statement must be a single SELECT and may read only the cache's own files (``sql_guard``).

By default (``source="auto"``) the query runs against index.duckdb when it is current and otherwise
against the live Parquet manifest loaded into memory, so it works while ``dflash generate`` writes.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import duckdb

from dflash_offline.cache.sql_guard import check_statement, confine, refusal_for
from dflash_offline.cache.sqldb import Source, open_query_database
from dflash_offline.errors import ConfigError, DflashError
from dflash_offline.sql_files import named_queries

OutputFormat = Literal["table", "csv", "json"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SqlConfig:
    """One ``dflash sql`` invocation."""

    root: Path
    """The cache directory."""
    sql: str | None
    """A SQL statement, or None when ``query_name`` is given."""
    query_name: str | None
    """Name of a file in ``manifests/queries/`` (without ``.sql``)."""
    output_format: OutputFormat = "table"
    source: Source = "auto"
    """``auto`` (index.duckdb when current, else the manifest), ``manifest`` or ``index``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SqlResult:
    """A fetched query result."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    source: str
    """``manifest`` or ``index``: what the query ran against."""

    def render(self, output_format: OutputFormat) -> str:
        if output_format == "csv":
            return _render_csv(self)
        if output_format == "json":
            return json.dumps(
                [dict(zip(self.columns, row)) for row in self.rows], default=_json_value, indent=1
            )
        return _render_table(self)


def resolve_sql(config: SqlConfig) -> str:
    """The statement to run: the given SQL or the named query's text."""
    if (config.sql is None) == (config.query_name is None):
        raise ConfigError("give either a SQL statement or --query NAME (exactly one of them)")
    if config.sql is not None:
        return config.sql
    queries = named_queries()
    if config.query_name not in queries:
        raise ConfigError(f"no named query {config.query_name!r}; known: {', '.join(sorted(queries))}")
    return queries[config.query_name]


def run_sql(config: SqlConfig) -> SqlResult:
    """Run the statement and fetch its whole result: one read-only SELECT, confined to the cache's
    files (``sql_guard``)."""
    statement = resolve_sql(config)
    check_statement(statement, root=config.root)
    database = open_query_database(config.root, config.source)
    try:
        confine(database.con, config.root)
        cursor = database.con.cursor()  # one cursor per result (a DuckDB 2.0 trap: docs/facts.md#duckdb)
        try:
            cursor.execute(statement)
            description = cursor.description or []
            rows = cursor.fetchall() if description else []  # DuckDB reads files lazily: errors come here too
        except duckdb.Error as e:
            raise (refusal_for(e, root=config.root) or DflashError(f"the query failed: {e}")) from e
        return SqlResult(columns=tuple(d[0] for d in description), rows=rows, source=database.source)
    finally:
        database.con.close()


def query_cache(config: SqlConfig) -> str:
    """Run the query and render it in the configured format (what ``dflash sql`` prints)."""
    return run_sql(config).render(config.output_format)


def _json_value(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dt.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    return str(value)


def _render_csv(result: SqlResult) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(result.columns)
    for row in result.rows:
        writer.writerow(
            ["" if v is None else _json_value(v) if not isinstance(v, str | int | float) else v for v in row]
        )
    return buffer.getvalue().rstrip("\n")


def _render_table(result: SqlResult) -> str:
    if not result.columns:
        return "(no result)"
    cells = [[_cell(v) for v in row] for row in result.rows]
    numeric = [
        all(isinstance(row[i], int | float | decimal.Decimal) or row[i] is None for row in result.rows)
        for i in range(len(result.columns))
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)
        ).rstrip()

    out = [line(list(result.columns)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(result.rows)} row{'s' if len(result.rows) != 1 else ''}, from the {result.source})")
    return "\n".join(out)
