"""Writing a ``dflash sql`` result while it is fetched, so that a large answer never sits in memory.

csv, json and jsonl write every row, one fetched batch (``FETCH_ROWS``) at a time; the table format,
which needs every shown row to size its columns, shows the first ``TABLE_ROWS`` and counts the rest (its
last line says how many and how to get them all). json and jsonl are strict JSON (``strict_json``:
NaN and ±inf are ``null``).
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
from collections.abc import Iterable, Iterator
from typing import Any, Literal, Protocol, TextIO

from dflash_offline import strict_json

OutputFormat = Literal["table", "csv", "json", "jsonl"]

FETCH_ROWS = 10_000
"""Rows fetched from DuckDB at a time (what one batch holds in memory)."""
TABLE_ROWS = 1_000
"""Rows the table format shows."""


class Fetcher(Protocol):
    def fetchmany(self, size: int = ...) -> list[Any]: ...


def batches(cursor: Fetcher, batch_rows: int = FETCH_ROWS) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of an executed query, ``batch_rows`` at a time (DuckDB streams them from the query)."""
    while batch := cursor.fetchmany(batch_rows):
        yield batch


def write_result(
    columns: tuple[str, ...],
    rows: Iterable[list[tuple[Any, ...]]],
    *,
    source: str,
    output_format: OutputFormat,
    out: TextIO,
) -> None:
    """Write the batches ``rows`` of a result with ``columns`` (empty: a statement without a result)."""
    if output_format == "csv":
        _write_csv(columns, rows, out)
    elif output_format in ("json", "jsonl"):
        _write_json(columns, rows, out, lines=output_format == "jsonl")
    else:
        _write_table(columns, rows, out, source=source)


def json_value(value: Any) -> Any:
    """A DuckDB value JSON has no type for, as JSON (dates ISO 8601, blobs hex)."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _write_csv(columns: tuple[str, ...], rows: Iterable[list[tuple[Any, ...]]], out: TextIO) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for batch in rows:
        writer.writerows(
            ["" if v is None else v if isinstance(v, str | int | float) else json_value(v) for v in row]
            for row in batch
        )


def _write_json(
    columns: tuple[str, ...], rows: Iterable[list[tuple[Any, ...]]], out: TextIO, *, lines: bool
) -> None:
    """jsonl: one object per line; json: one array of them (an object per line, so it streams too)."""

    def text(row: tuple[Any, ...]) -> str:
        return strict_json.dumps(dict(zip(columns, row, strict=True)), default=json_value)

    if lines:
        for batch in rows:
            out.writelines(text(row) + "\n" for row in batch)
        return
    out.write("[")
    first = True
    for batch in rows:
        for row in batch:
            out.write(("\n" if first else ",\n") + text(row))
            first = False
    out.write("]\n" if first else "\n]\n")


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dt.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    return str(value)


def _write_table(
    columns: tuple[str, ...], rows: Iterable[list[tuple[Any, ...]]], out: TextIO, *, source: str
) -> None:
    if not columns:
        out.write("(no result)\n")
        return
    shown: list[tuple[Any, ...]] = []
    total = 0
    for batch in rows:  # keep the first TABLE_ROWS, count the rest
        total += len(batch)
        shown += batch[: max(0, TABLE_ROWS - len(shown))]
    cells = [[_cell(v) for v in row] for row in shown]
    numeric = [
        all(isinstance(row[i], int | float | decimal.Decimal) or row[i] is None for row in shown)
        for i in range(len(columns))
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out.write(line(list(columns)) + "\n" + "  ".join("-" * w for w in widths) + "\n")
    out.writelines(line(r) + "\n" for r in cells)
    counted = f"{total:,} row{'s' if total != 1 else ''}, from the {source}"
    if total > len(shown):
        counted += (
            f"; the first {len(shown):,} shown, {total - len(shown):,} more rows: "
            "--format csv, json or jsonl writes every row"
        )
    out.write(f"({counted})\n")
