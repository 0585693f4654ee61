"""``dflash sql CACHE "SELECT ..."`` / ``dflash sql CACHE --query NAME``: query a cache with DuckDB."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_offline.cache.sql_output import TABLE_ROWS
from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import cache_input
from dflash_offline.sql_files import named_queries


def _query_names() -> str:
    try:
        return ", ".join(sorted(named_queries()))
    except Exception:  # pragma: no cover - only the help text depends on it
        return "(manifests/queries not found)"


@click.command(
    epilog="Tables: samples, failures, shards, runs, buckets, duplicates, parts, meta. "
    "Views: bucket_stats, shard_stats, failure_stats, progress."
)
@cache_input("cache", help="The cache directory (or give it as CACHE).", shift="statement")
@click.argument("statement", required=False)
@click.option("--query", "-q", "query_name", metavar="NAME", help=f"Run a named query: {_query_names()}.")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "csv", "json", "jsonl"]),
    default="table",
    show_default=True,
    help=f"table shows the first {TABLE_ROWS:,} rows; csv, json and jsonl stream every row.",
)
@click.option(
    "--source",
    type=click.Choice(["auto", "manifest", "index"]),
    default="auto",
    show_default=True,
    help="auto: index.duckdb when it is current, else the live Parquet manifest (works while writing).",
)
@ctrl_c_exits_130("interrupted: the query was stopped")
def sql(cache: Path, statement: str | None, query_name: str | None, output_format: str, source: str) -> None:
    """Run one SQL STATEMENT (or --query NAME) against CACHE and print the result."""
    from dflash_offline.cache.sql import SqlConfig, stream_query

    config = SqlConfig(
        root=cache,
        sql=statement,
        query_name=query_name,
        output_format=output_format,  # type: ignore[arg-type]
        source=source,  # type: ignore[arg-type]
    )
    stream_query(config, sys.stdout)
