"""Confinement of ``dflash sql``: one read-only SELECT that reads the cache and nothing else.

Two layers, both DuckDB's own rather than regexes over the text:

1. DuckDB's parser (``duckdb.extract_statements``) splits the text into statements and types each;
   exactly one statement of type SELECT passes (``DESCRIBE``, ``SHOW``, ``SUMMARIZE``, ``VALUES`` and
   ``FROM``-first queries parse as SELECT). COPY, ATTACH, INSTALL/LOAD, SET, PRAGMA, CALL, EXPORT,
   CREATE, ... are refused before anything runs.
2. DuckDB's sandbox on the connection the statement runs on: ``allowed_directories`` = the cache root,
   then ``enable_external_access = false`` (no file outside it, no network, no extension install or
   load, no ATTACH) and ``lock_configuration = true`` (nothing later on the connection can undo
   that). A file function inside a SELECT
   (``read_text('/etc/shadow')``, ``read_csv('/x')``, ``glob('/*')``) then fails with DuckDB's
   permission error, which we turn into a one-line refusal.

``..`` out of the cache and a symlink inside the cache that points elsewhere are refused as well
(DuckDB resolves the path before the check; tested with DuckDB 2.0.1).

DuckDB also allows its temp directory whatever ``allowed_directories`` says: ``<db>.tmp/`` beside a
database file, ``.tmp/`` in the working directory for an in-memory one. A symlink of that name (or a
file a user left there) was readable through ``read_text``/``glob``, so ``sql_confine.confine`` turns the temp
directory off first: a query that would spill to disk fails instead of opening a door.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from dflash_offline.cache.sqldb import index_health
from dflash_offline.errors import DflashError

_AN = frozenset({"ABORT", "ALTER", "ANALYZE", "ATTACH", "END", "EXECUTE", "EXPLAIN", "EXPORT", "IMPORT",
                 "INSERT", "INSTALL", "UNLISTEN", "UNPIVOT", "UPDATE"})  # fmt: skip
"""Statement keywords read with "an" (a vowel sound: not USE, "yoos"); every other keyword takes "a"."""

_KEYWORD_OF_TYPE = {"MERGE_INTO": "MERGE", "COPY_DATABASE": "COPY FROM DATABASE", "CREATE_FUNC": "CREATE"}
"""The keyword of a statement type whose name is not one (for a statement that starts with WITH)."""

_TWO_WORD = frozenset({"FORCE"})
"""Keywords that name a statement only with the word after them (FORCE INSTALL)."""

_LEADING = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/|\()*([A-Za-z_]+)(?:\s+([A-Za-z_]+))?", re.S)


class SqlRefusedError(DflashError):
    """A ``dflash sql`` statement that would do more than read the cache."""


def statement_name(text: str, type_name: str | None) -> str:
    """``an INSTALL statement``, ``a PIVOT statement``: what the user typed, with its article.

    DuckDB's statement types are coarser than its statements (INSTALL is a LOAD, PIVOT a MULTI, USE a
    SET, TRUNCATE a DELETE), so the name is the statement's own leading keyword; a statement that
    starts with WITH is named by its type (``WITH ... INSERT`` is an INSERT)."""
    match = _LEADING.match(text)
    keyword = match.group(1).upper() if match else ""
    if keyword in _TWO_WORD and match and match.group(2):
        keyword = f"{keyword} {match.group(2).upper()}"
    if (keyword in ("", "WITH")) and type_name is not None:
        keyword = _KEYWORD_OF_TYPE.get(type_name, type_name)
    if not keyword:
        return "an empty statement"
    article = "an" if keyword.split()[0] in _AN else "a"
    return f"{article} {keyword} statement"


def check_statement(sql: str, *, root: Path) -> None:
    """Refuse anything but exactly one SELECT (DuckDB's parser decides what the text is)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise DflashError(f"the query failed: {e}") from e
    if len(statements) != 1:
        raise SqlRefusedError(
            f"dflash sql runs exactly one statement, got {len(statements)}; {full_shell_hint(root)}"
        )
    try:
        kind: str | None = statements[0].type.name
    except ValueError:  # a type this DuckDB's Python API has no name for (UPDATE EXTENSIONS): not a SELECT
        kind = None
    if kind != duckdb.StatementType.SELECT.name:
        raise SqlRefusedError(
            "dflash sql is read-only and runs only a SELECT, refused: "
            f"{statement_name(statements[0].query, kind)}; {full_shell_hint(root)}"
        )


def full_shell_hint(root: Path) -> str:
    """Where to run what ``dflash sql`` refuses; ``dflash index`` only when the index needs it."""
    shell = f"for a full SQL shell use the duckdb CLI: `duckdb {root}/index.duckdb`"
    needed = {
        "absent": f" (after `dflash index {root}`)",
        "stale": f" (after refreshing it with `dflash index {root}`)",
        "unreadable": f" (after rebuilding it with `dflash index {root}`)",
        "current": "",
    }
    return shell + needed[index_health(root).state]


def refusal_for(error: duckdb.Error, *, root: Path) -> SqlRefusedError | None:
    """The one-line refusal for DuckDB's sandbox error (None for an ordinary query error)."""
    if not isinstance(error, duckdb.PermissionException):
        return None
    first = str(error).strip().splitlines()[0]
    return SqlRefusedError(
        f"dflash sql reads only the cache's own files (under {root.resolve()}), refused: {first}; "
        + full_shell_hint(root)
    )
