"""DuckDB's sandbox on one connection: it reads files under the cache root and nothing else.

Its own module because every connection to a cache's data takes it: ``dflash sql``'s (``sql_guard.py``
says why each setting), the index's (``index_catalogue.py``) and the manifest's (``sqldb.py``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import duckdb

from dflash_offline.sql_files import quote_literal


def confine(con: duckdb.DuckDBPyConnection, root: Path) -> None:
    """Restrict ``con`` to reading files under ``root``; the settings cannot be changed afterwards.

    Order matters: ``allowed_directories`` cannot be set once external access is off, and the temp
    directory (always allowed by DuckDB) must be gone before the lock."""
    allowed = str(root.resolve()).rstrip("/") + "/"
    con.execute("SET temp_directory = ''")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    # A DuckDB without allowed_directories (< 1.1) puts every file off limits, the cache's own included
    # (the manifest is already in memory, index.duckdb already open): stricter, and queries still work.
    with contextlib.suppress(duckdb.CatalogException):
        con.execute(f"SET allowed_directories = [{quote_literal(allowed)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
