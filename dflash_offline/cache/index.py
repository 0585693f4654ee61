"""``build_index``: merge the Parquet manifest into ``CACHE/index.duckdb``.

The file is built under a temp name and renamed, so readers see the old index or the new one, never a
half-built one; it is written with an old DuckDB storage version (``STORAGE_VERSION``) so that DuckDB
CLIs from 1.0 on can open it (DuckDB 2.0's default format cannot be read by 1.x). Only one process
should build it at a time; readers open it read-only and are never locked out for long.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from dflash_offline.cache.index_catalogue import STORAGE_VERSION
from dflash_offline.cache.layout import CacheLayout, read_fingerprint, temp_path
from dflash_offline.cache.sqldb import load_manifest
from dflash_offline.errors import NoSpaceError, find_no_space
from dflash_offline.sql_files import quote_literal


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexStats:
    """What ``build_index`` wrote."""

    path: Path
    samples: int
    duplicates: int
    """Sample rows dropped because their sample_id had been committed earlier (first commit kept)."""
    duplicate_ids: tuple[str, ...]
    """Up to 20 of the duplicated sample ids, for the report."""
    failures: int
    shards: int
    runs: int
    parts: int
    """Manifest parts merged."""
    storage_version: str
    seconds: float

    def render(self) -> str:
        lines = [
            f"wrote {self.path} (DuckDB storage {self.storage_version}) in {self.seconds:.2f} s: "
            f"{self.samples} samples, {self.failures} failures, {self.shards} shards, {self.runs} runs "
            f"from {self.parts} manifest parts"
        ]
        if self.duplicates:
            lines.append(
                f"dropped {self.duplicates} duplicate sample rows (kept the first commit of each id): "
                + ", ".join(self.duplicate_ids)
                + (" ..." if self.duplicates > len(self.duplicate_ids) else "")
            )
        return "\n".join(lines)


def build_index(root: str | Path) -> IndexStats:
    """Merge every manifest part into index.duckdb (atomically replaced); see ``IndexStats``."""
    started = time.perf_counter()
    layout = CacheLayout.at(root)
    read_fingerprint(root)  # refuses a path that is not a cache, or an unknown format version
    tmp = temp_path(layout.index_path)
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"ATTACH {quote_literal(str(tmp))} AS idx (STORAGE_VERSION '{STORAGE_VERSION}')")
        con.execute("USE idx")
        load = load_manifest(con, root)
        duplicate_ids = tuple(
            str(r[0])
            for r in con.execute(
                "SELECT DISTINCT sample_id FROM duplicates ORDER BY sample_id LIMIT 20"
            ).fetchall()
        )
        con.execute("USE memory")
        con.execute("DETACH idx")
        con.close()
        os.replace(tmp, layout.index_path)
    except (duckdb.Error, OSError) as e:
        if find_no_space(e) is not None:
            raise NoSpaceError(layout.root) from e
        raise
    finally:
        con.close()
        for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    return IndexStats(
        path=layout.index_path,
        samples=load.samples,
        duplicates=load.duplicates,
        duplicate_ids=duplicate_ids,
        failures=load.failures,
        shards=load.shards,
        runs=load.runs,
        parts=load.parts,
        storage_version=STORAGE_VERSION,
        seconds=time.perf_counter() - started,
    )
