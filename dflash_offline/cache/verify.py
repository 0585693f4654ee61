"""``verify_cache``: re-read every committed sample, re-checksum it, and account for every stored byte.

Reported as damage (``VerifyReport.ok`` is False, ``dflash verify`` exits non-zero):
  - samples whose bytes fail their crc32c, do not decode, or lie past the data written (per shard);
  - sample ids committed more than once, and committed samples whose rows overlap in one shard.
Reported as waste, not damage (what a killed writer leaves behind, by design):
  - shard files no committed sample touches, and whole groups whose writer never committed;
  - stale temp files (zarr's ``*.partial``, our ``*.tmp-*``);
  - an estimate of the unreferenced rows inside referenced shard files (flush gaps, killed tails).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm import tqdm

from dflash_offline.cache.checksum import sample_checksum
from dflash_offline.cache.layout import CacheLayout, partial_files
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader, SampleTable
from dflash_offline.cache.records import CachedSample
from dflash_offline.cache.shard_file import ShardFile
from dflash_offline.cache.zarr_format import ARRAYS, parse_array_format
from dflash_offline.errors import CacheDamageError

_BATCH_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class DamagedSample:
    """A committed sample whose stored bytes cannot be trusted."""

    sample_id: str
    shard: str
    row_start: int
    num_tokens: int
    problem: str
    """Why: checksum mismatch, decode error, missing data, overlap (the reader's message)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UnreferencedData:
    """Stored bytes that no committed sample points at."""

    path: str
    """Relative to the cache root."""
    num_bytes: int
    reason: str
    files: tuple[Path, ...] = ()
    """The files themselves (what ``dflash verify --repair`` removes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    """The outcome of ``verify_cache``."""

    root: Path
    samples_checked: int
    bytes_checked: int
    """Raw (decoded) bytes re-read and re-checksummed."""
    damaged: tuple[DamagedSample, ...]
    duplicates: tuple[str, ...]
    """Sample ids with more than one committed row."""
    unreferenced: tuple[UnreferencedData, ...]
    slack_bytes: int
    """Estimated stored bytes of unreferenced rows inside shard files that also hold committed rows."""

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.duplicates

    @property
    def unreferenced_bytes(self) -> int:
        return sum(u.num_bytes for u in self.unreferenced)

    def damaged_by_shard(self) -> dict[str, list[str]]:
        """shard -> damaged sample ids (sorted)."""
        out: dict[str, list[str]] = defaultdict(list)
        for d in self.damaged:
            out[d.shard].append(d.sample_id)
        return {shard: sorted(ids) for shard, ids in sorted(out.items())}

    def render(self) -> str:
        lines = [
            f"checked {self.samples_checked:,} samples ({self.bytes_checked / 2**20:.1f} MiB) "
            f"in {self.root}: " + ("OK" if self.ok else "DAMAGED")
        ]
        for shard, ids in self.damaged_by_shard().items():
            lines.append(f"  damaged in {shard}: {len(ids)} samples: {', '.join(ids)}")
        for d in self.damaged[:20]:
            lines.append(f"    {d.sample_id}: {d.problem}")
        if self.duplicates:
            lines.append(f"  committed more than once: {', '.join(self.duplicates)}")
        lines.append(
            f"unreferenced: {self.unreferenced_bytes:,} bytes in {len(self.unreferenced)} files or groups "
            f"(crash leftovers, harmless), ≈ {self.slack_bytes:,} bytes of slack inside shard files"
        )
        for u in self.unreferenced[:20]:
            lines.append(f"  {u.path}: {u.num_bytes:,} bytes, {u.reason}")
        if self.duplicates or self.unreferenced or self.damaged:
            lines.append(
                f"to drop duplicate and damaged commits and delete unreferenced bytes: "
                f"dflash verify --repair {self.root}"
            )
        return "\n".join(lines)


def _overlaps(table: SampleTable, order: np.ndarray) -> dict[int, str]:
    """Rows (positions) whose token rows overlap the previous sample's in the same shard."""
    found: dict[int, str] = {}
    for a, b in zip(order[:-1].tolist(), order[1:].tolist()):
        if (
            table.shard_code[a] == table.shard_code[b]
            and table.row_start[b] < table.row_start[a] + table.num_tokens[a]
        ):
            problem = f"rows overlap sample {table.sample_id[a]!r} in the same shard"
            found[b] = problem
            found.setdefault(a, f"rows overlap sample {table.sample_id[b]!r} in the same shard")
    return found


def _batches(table: SampleTable, order: np.ndarray, row_bytes: int) -> list[np.ndarray]:
    """Consecutive samples (in shard, row order), ``_BATCH_BYTES`` a batch: adjacent rows share chunks."""
    sizes = table.num_tokens[order].astype(np.int64) * row_bytes
    batch_of = (np.cumsum(sizes) - sizes) // _BATCH_BYTES  # by the byte each sample starts at
    return [b for b in np.split(order, np.flatnonzero(np.diff(batch_of)) + 1) if b.size]


def _unreferenced(layout: CacheLayout, table: SampleTable) -> tuple[list[UnreferencedData], int]:
    intervals: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for code, shard in enumerate(table.shard_names):
        mask = table.shard_code == code
        intervals[shard] = (table.row_start[mask], table.row_start[mask] + table.num_tokens[mask])
    found: list[UnreferencedData] = []
    slack = 0.0
    groups = sorted(layout.shards_dir.glob("*.zarr")) if layout.shards_dir.is_dir() else []
    for group in groups:
        shard = group.name.removesuffix(".zarr")
        files = [p for p in group.rglob("*") if p.is_file() and "/c/" in p.as_posix()]
        if shard not in intervals:
            total = sum(p.stat().st_size for p in files)
            if total:
                found.append(
                    UnreferencedData(
                        path=str(group.relative_to(layout.root)),
                        num_bytes=total,
                        reason="no committed sample (its writer stopped before its first commit)",
                        files=(group,),
                    )
                )
            continue
        starts, ends = intervals[shard]
        try:
            features = parse_array_format(group / "features", "features")
        except CacheDamageError:
            continue  # the samples of this group are already reported as damaged
        sr = features.shard_rows
        by_index: dict[int, list[Path]] = defaultdict(list)
        for p in files:
            rel = p.relative_to(group).parts  # (array, "c", index[, "0"])
            if len(rel) >= 3 and rel[0] in ARRAYS and rel[2].isdigit():
                by_index[int(rel[2])].append(p)
        for k, paths in sorted(by_index.items()):
            lo, hi = k * sr, (k + 1) * sr
            covered = int(np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).sum())
            size = sum(p.stat().st_size for p in paths)
            if covered == 0:
                found.append(
                    UnreferencedData(
                        path=f"{group.relative_to(layout.root)}/*/c/{k}",
                        num_bytes=size,
                        reason="shard file holds no committed sample (written, not committed before a stop)",
                        files=tuple(sorted(paths)),
                    )
                )
                continue
            try:
                shard_file = ShardFile(features, k)
            except CacheDamageError:
                continue
            written_rows = int((shard_file.offsets >= 0).sum()) * features.chunk_rows
            written_rows = min(written_rows, max(0, features.num_rows - lo))
            if written_rows > covered:
                slack += size * (written_rows - covered) / written_rows
    return found, int(slack)


def damaged_rows(reader: CacheReader, bar: Any = None) -> dict[int, str]:
    """Positions in ``reader.samples`` whose bytes cannot be read or fail their crc32c -> why.
    Reads in (shard, row) order, ``_BATCH_BYTES`` at a time; ``bar`` (tqdm) counts stored bytes."""
    table = reader.samples
    storage = reader.storage
    row_bytes = storage.token_bytes
    lossy = storage.fp8 is not None

    def read(rows: np.ndarray) -> list[CachedSample]:
        # A lossy cache's checksum covers its stored (encoded) bytes: read those, undecoded.
        if not lossy:
            return reader.read_rows(rows)
        needed = int(table.num_tokens[rows].astype(np.int64).sum())
        return reader.read_rows(rows, stored_out=np.empty((needed, storage.width), storage.dtype))

    order = np.lexsort((table.row_start, table.shard_code)) if len(table) else np.zeros(0, np.int64)
    damaged: dict[int, str] = {}
    for batch in _batches(table, order, row_bytes):
        try:
            pairs = list(zip(batch.tolist(), read(batch)))
        except CacheDamageError:
            pairs = []
            for row in batch.tolist():  # find out which samples the damage hurts
                try:
                    pairs.append((row, read(np.array([row]))[0]))
                except CacheDamageError as e:
                    damaged.setdefault(row, str(e))
        for row, sample in pairs:
            stored = sample.features_TF.view(torch.uint16) if sample.stored_TW is None else sample.stored_TW
            crc = sample_checksum(stored.numpy(), sample.input_ids_T.numpy(), sample.loss_mask_T.numpy())
            if crc != int(table.checksum[row]):
                damaged.setdefault(
                    row, f"checksum mismatch (stored {int(table.checksum[row]):#010x}, read {crc:#010x})"
                )
        if bar is not None:
            bar.update(int(table.num_tokens[batch].astype(np.int64).sum()) * row_bytes)
    return damaged


def unreferenced_data(root: str | Path) -> list[UnreferencedData]:
    """Shard groups and shard files no committed sample points at, and stale temp files (no bytes
    are re-read: what ``verify_cache`` reports as waste, computed from the manifest alone)."""
    layout = CacheLayout.at(root)
    with CacheReader.open(root) as reader:
        found, _slack = _unreferenced(layout, reader.samples)
    return found + [
        UnreferencedData(
            path=str(p.relative_to(layout.root)),
            num_bytes=p.stat().st_size,
            reason="stale temp file",
            files=(p,),
        )
        for p in partial_files(root)
    ]


def verify_cache(root: str | Path, *, progress: bool = True, num_threads: int = 4) -> VerifyReport:
    """Re-read and re-checksum every committed sample; see the module docstring for what is reported."""
    layout = CacheLayout.at(root)
    raw_ids = read_table(root, "samples", ["sample_id"])["sample_id"]
    counts = pc.value_counts(raw_ids)
    duplicates = sorted(str(v["values"]) for v in counts.to_pylist() if v["counts"] > 1)
    damaged: dict[int, str] = {}
    with CacheReader.open(root, num_threads=num_threads) as reader:
        table = reader.samples
        row_bytes = reader.storage.token_bytes
        order = np.lexsort((table.row_start, table.shard_code)) if len(table) else np.zeros(0, np.int64)
        damaged.update(_overlaps(table, order))
        bar = tqdm(
            total=int(table.num_tokens.astype(np.int64).sum()) * row_bytes,
            unit="B",
            unit_scale=True,
            desc="verify",
            disable=not progress,
        )
        for row, problem in damaged_rows(reader, bar).items():
            damaged.setdefault(row, problem)
        checked = len(table)
        checked_bytes = int(table.num_tokens.astype(np.int64).sum()) * row_bytes
        bar.close()
        unreferenced, slack = _unreferenced(layout, table)
    for path in partial_files(root):
        unreferenced.append(
            UnreferencedData(
                path=str(path.relative_to(layout.root)),
                num_bytes=path.stat().st_size,
                reason="stale temp file",
                files=(path,),
            )
        )
    return VerifyReport(
        root=layout.root,
        samples_checked=checked,
        bytes_checked=checked_bytes,
        damaged=tuple(
            DamagedSample(
                sample_id=str(table.sample_id[row]),
                shard=str(table.shard[row]),
                row_start=int(table.row_start[row]),
                num_tokens=int(table.num_tokens[row]),
                problem=problem,
            )
            for row, problem in sorted(
                damaged.items(), key=lambda kv: (str(table.shard[kv[0]]), int(table.row_start[kv[0]]))
            )
        ),
        duplicates=tuple(duplicates),
        unreferenced=tuple(unreferenced),
        slack_bytes=slack,
    )
