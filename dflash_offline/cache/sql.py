"""``dflash sql``: run one SQL statement (or a named query from ``manifests/queries/``) against a cache.

The statement must be a single SELECT and may read only the cache's own files (``sql_guard``).

By default (``source="auto"``) the query runs against index.duckdb when it is current and otherwise
against the live Parquet manifest loaded into memory, so it works while ``dflash generate`` writes.

``stream_query`` (the command) writes the result while DuckDB produces it (``sql_output``) and runs the
query on a thread, the main thread only waiting: a Ctrl-C or ``kill -INT`` interrupts the query at once
(``interrupt.wait_interruptibly`` calls DuckDB's ``interrupt()``), however long it would have run.
"""

from __future__ import annotations

import contextlib
import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import duckdb

from dflash_offline.cache.sql_guard import check_statement, refusal_for
from dflash_offline.cache.sql_output import OutputFormat, batches, write_result
from dflash_offline.cache.sqldb import Source, open_query_database
from dflash_offline.errors import ConfigError, DflashError
from dflash_offline.interrupt import wait_interruptibly
from dflash_offline.sql_files import named_queries


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
    """A fetched query result (``run_sql``: every row in memory; for small results and tests)."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    source: str
    """``manifest`` or ``index``: what the query ran against."""


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
    collected: list[SqlResult] = []

    def collect(columns: tuple[str, ...], rows: Any, source: str) -> None:
        collected.append(SqlResult(columns=columns, rows=[r for batch in rows for r in batch], source=source))

    _run(config, collect, _Connections())
    return collected[0]


def stream_query(config: SqlConfig, out: TextIO) -> None:
    """Run the statement and write its result to ``out`` in the configured format as it is fetched;
    SIGINT interrupts the query (KeyboardInterrupt, within a fraction of a second)."""
    connections = _Connections()

    def write(columns: tuple[str, ...], rows: Any, source: str) -> None:
        write_result(columns, rows, source=source, output_format=config.output_format, out=out)

    wait_interruptibly(lambda: _run(config, write, connections), interrupt=connections.interrupt, name="sql")


def query_cache(config: SqlConfig) -> str:
    """The result rendered in the configured format, as one string (what ``dflash sql`` prints)."""
    buffer = io.StringIO()
    stream_query(config, buffer)
    return buffer.getvalue().rstrip("\n")


class _Connections:
    """The DuckDB connections of one query, for the main thread to interrupt (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[duckdb.DuckDBPyConnection] = []
        self._interrupted = False

    def add(self, con: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            self._open.append(con)
            if self._interrupted:  # an interrupt before this connection existed
                raise KeyboardInterrupt

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            for con in self._open:
                with contextlib.suppress(duckdb.Error):  # one the query already closed
                    con.interrupt()


def _run(config: SqlConfig, consume: Any, connections: _Connections) -> None:
    """Check the statement, open the database, run it and hand (columns, batches, source) to
    ``consume``, which reads the batches while the cursor is open."""
    statement = resolve_sql(config)
    check_statement(statement, root=config.root)
    database = open_query_database(config.root, config.source, connected=connections.add)
    try:
        cursor = database.con.cursor()  # one cursor per result (a DuckDB 2.0 trap: docs/facts.md#duckdb)
        try:
            connections.add(cursor)
            cursor.execute(statement)
            columns = tuple(d[0] for d in cursor.description or [])
            # DuckDB reads files lazily: errors come while the batches are fetched, inside consume.
            consume(columns, batches(cursor) if columns else iter(()), database.source)
        except duckdb.Error as e:
            raise (refusal_for(e, root=config.root) or DflashError(f"the query failed: {e}")) from e
        finally:
            cursor.close()  # here, not at interpreter exit (an interrupted result torn down then aborts)
    finally:
        database.con.close()
