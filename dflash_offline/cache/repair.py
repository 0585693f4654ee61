"""``dflash verify --repair``: make a cache consistent again, under its writer lock.

  - A sample_id committed more than once (two writers that bypassed the lock, or a hand-made cache):
    every copy is re-read; the first commit (created_at, shard, row_start) whose bytes pass their
    crc32c is kept, the other rows are dropped from their manifest parts.
  - A committed sample whose bytes are damaged (no copy passes) is dropped too: the cache then no
    longer claims it, and rerunning the same ``dflash generate`` recomputes it.
  - Orphan bytes are removed: shard groups and shard files no committed sample points at, their
    ``manifest/shards`` rows, and stale temp files (zarr's ``*.partial``, our ``*.tmp-*``).

Manifest parts are immutable for readers and writers; repair is the one exception, and it rewrites a
part by temp file + rename, so a reader sees the old part or the new one, never half of either.
After a repair ``verify`` is clean. index.duckdb is rebuilt when there was one.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from dflash_offline.cache.codecs import raw_token_bytes
from dflash_offline.cache.layout import CacheLayout, read_fingerprint
from dflash_offline.cache.manifest import read_parts, write_part
from dflash_offline.cache.reader import CacheReader, SampleTable
from dflash_offline.cache.verify import damaged_rows, unreferenced_data
from dflash_offline.locking import hold_lock


@dataclass(frozen=True, kw_only=True, slots=True)
class RepairReport:
    """What ``repair_cache`` changed."""

    root: Path
    duplicate_rows_dropped: int
    """Extra commits of a sample_id removed from the manifest (one good copy of each kept)."""
    damaged_ids_dropped: tuple[str, ...]
    """Sample ids with no copy whose bytes verify: removed, for generate to recompute."""
    parts_rewritten: int
    files_removed: int
    """Files and shard groups removed (orphan shard data, stale temp files)."""
    bytes_freed: int

    def render(self) -> str:
        lines = [
            f"repaired {self.root}: dropped {self.duplicate_rows_dropped:,} duplicate commits, "
            f"{len(self.damaged_ids_dropped):,} damaged samples ({self.parts_rewritten} manifest parts "
            f"rewritten); removed {self.files_removed:,} orphan files or groups, freed "
            f"{self.bytes_freed:,} bytes"
        ]
        if self.damaged_ids_dropped:
            shown = ", ".join(self.damaged_ids_dropped[:20])
            lines.append(
                f"  rerun the same `dflash generate` to recompute the damaged samples: {shown}"
                + (" ..." if len(self.damaged_ids_dropped) > 20 else "")
            )
        return "\n".join(lines)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _copy_ranks(rows: pa.Table) -> np.ndarray:
    """For each row, how many earlier commits of its sample_id there are (0 = first commit)."""
    order = np.lexsort(
        (
            rows["row_start"].to_numpy(),
            rows["shard"].to_numpy(zero_copy_only=False).astype(str),
            rows["created_at"].cast(pa.timestamp("us")).to_numpy(),
            rows["sample_id"].to_numpy(zero_copy_only=False).astype(str),
        )
    )
    ids = rows["sample_id"].to_numpy(zero_copy_only=False)[order]
    rank_sorted = np.zeros(len(ids), dtype=np.int64)
    for i in range(1, len(ids)):
        if ids[i] == ids[i - 1]:
            rank_sorted[i] = rank_sorted[i - 1] + 1
    ranks = np.empty_like(rank_sorted)
    ranks[order] = rank_sorted
    return ranks


def _good_rows(root: Path, rows: pa.Table, ranks: np.ndarray, progress: bool) -> np.ndarray:
    """bool per row: its bytes read back and pass their checksum. Copies of one id are checked in
    rounds (first commits, then second commits, ...) since a reader's table holds one row per id."""
    good = np.ones(rows.num_rows, dtype=bool)
    with CacheReader.open(root) as reader:
        row_bytes = raw_token_bytes(reader.fingerprint.feature_width)
        total = int(pc.sum(rows["num_tokens"]).as_py() or 0) * row_bytes
        with tqdm(total=total, unit="B", unit_scale=True, desc="repair", disable=not progress) as bar:
            for rank in range(int(ranks.max()) + 1 if len(ranks) else 0):
                positions = np.flatnonzero(ranks == rank)
                subset = rows.take(pa.array(positions)).append_column(
                    "_position", pa.array(positions, pa.int64())
                )
                reader.samples = SampleTable.from_arrow(subset.drop_columns(["_position"]))
                # from_arrow re-sorts; map its rows back to ours through (sample_id) (unique in a round)
                back = dict(
                    zip(
                        subset["sample_id"].to_pylist(),
                        subset["_position"].to_pylist(),
                        strict=True,
                    )
                )
                for row in damaged_rows(reader, bar):
                    good[back[str(reader.samples.sample_id[row])]] = False
    return good


def repair_cache(root: str | Path, *, progress: bool = True) -> RepairReport:
    """Drop duplicate and damaged commits and remove orphan bytes (see the module docstring).
    Refused with ``LockedError`` while a writer holds the cache."""
    layout = CacheLayout.at(root)
    read_fingerprint(root)  # a clear error for a path that is not a cache
    with hold_lock(layout.root, what="cache"):
        parts = layout.parts("samples")
        tables = [read_parts("samples", [p]) for p in parts]
        part_of = np.repeat(np.arange(len(tables), dtype=np.int64), [t.num_rows for t in tables])
        rows = pa.concat_tables(tables) if tables else read_parts("samples", [])
        ranks = _copy_ranks(rows) if rows.num_rows else np.zeros(0, np.int64)
        good = _good_rows(layout.root, rows, ranks, progress) if rows.num_rows else np.zeros(0, bool)

        # Keep, per sample_id, the earliest good copy.
        keep = np.zeros(rows.num_rows, dtype=bool)
        kept_ids: set[str] = set()
        ids = rows["sample_id"].to_pylist()
        for position in np.argsort(ranks, kind="stable").tolist():
            if good[position] and ids[position] not in kept_ids:
                keep[position] = True
                kept_ids.add(ids[position])
        damaged_ids = sorted(set(ids) - kept_ids)
        duplicate_rows = int((~keep).sum()) - sum(ids.count(i) for i in damaged_ids)

        rewritten = 0
        for index, (path, table) in enumerate(zip(parts, tables, strict=True)):
            mask = keep[part_of == index]
            if mask.all():
                continue
            rewritten += 1
            if mask.any():
                write_part(path, table.filter(pa.array(mask)), fsync=True)
            else:
                path.unlink()

        files = bytes_freed = 0
        for orphan in unreferenced_data(layout.root):
            for path in orphan.files:
                size = _size(path)
                if path.is_dir():
                    shutil.rmtree(path)
                    shard = path.name.removesuffix(".zarr")
                    with contextlib.suppress(FileNotFoundError):
                        info = layout.table_dir("shards") / f"{shard}.parquet"
                        size += info.stat().st_size
                        info.unlink()
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                files += 1
                bytes_freed += size
        if layout.index_path.is_file():
            from dflash_offline.cache.index import build_index

            build_index(layout.root)
    return RepairReport(
        root=layout.root,
        duplicate_rows_dropped=duplicate_rows,
        damaged_ids_dropped=tuple(damaged_ids),
        parts_rewritten=rewritten,
        files_removed=files,
        bytes_freed=bytes_freed,
    )
