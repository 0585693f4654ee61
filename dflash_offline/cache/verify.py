"""``verify_cache``: re-read every committed sample, re-checksum it, and account for every stored byte.

Reported as damage (``VerifyReport.ok`` is False, ``dflash verify`` exits non-zero):
  - manifest parts whose bytes do not match the sha256 in their name, or cannot be parsed (their rows
    are left out of everything else verify checks);
  - ``zarr.json`` files of shard groups that differ from what their writer wrote (``shard_meta.py``);
    the group's samples are then checked through the rebuilt metadata, as repair would leave it;
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
from dflash_offline.cache.layout import (
    MANIFEST_TABLES,
    CacheLayout,
    partial_files,
    read_fingerprint,
    read_format_version,
)
from dflash_offline.cache.manifest import (
    parse_part,
    part_problem,
    read_parts,
    table_to_records,
)
from dflash_offline.cache.reader import CacheReader, SampleTable
from dflash_offline.cache.rows import CachedSample, ShardInfo
from dflash_offline.cache.shard_file import ShardFile
from dflash_offline.cache.shard_meta import MetadataDamage, check_group_meta, rebuilt_formats
from dflash_offline.cache.zarr_format import ARRAYS, ArrayFormat, parse_array_format
from dflash_offline.errors import CacheDamageError, CacheFormatError

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
class DamagedPart:
    """A manifest part that cannot be trusted: its rows are left out of what verify checks."""

    path: Path
    table: str
    """samples, failures, shards or runs."""
    problem: str
    rows: int | None
    """Rows in it, as far as its bytes still parse (None: they do not)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestCheck:
    """Every manifest part on disk, checked against the sha256 in its name and parsed."""

    good: dict[str, list[Path]]
    """table -> the parts that passed (every revision of a run)."""
    damaged: tuple[DamagedPart, ...]

    @property
    def damaged_paths(self) -> frozenset[Path]:
        return frozenset(d.path for d in self.damaged)

    def shard_infos(self) -> dict[str, ShardInfo]:
        """shard -> its ``manifest/shards`` row, from the intact parts."""
        rows: list[ShardInfo] = table_to_records(
            "shards", read_parts("shards", self.good["shards"], legacy_names=True)
        )
        return {info.shard: info for info in rows}


def check_manifest(root: str | Path) -> ManifestCheck:
    """Hash and parse every manifest part (what every reader does, without stopping at the first)."""
    layout = CacheLayout.at(root)
    legacy_names = read_format_version(root) == 1
    good: dict[str, list[Path]] = {}
    damaged: list[DamagedPart] = []
    for table in MANIFEST_TABLES:
        good[table] = []
        for path in layout.parts(table):
            rows: int | None = None
            try:
                data = path.read_bytes()
                problem = part_problem(path, data, legacy_names=legacy_names)
                rows = parse_part(table, path, data).num_rows
            except (OSError, CacheFormatError) as e:
                problem = problem or f"cannot be read ({e.__cause__ or e})"
            if problem is None:
                good[table].append(path)
            else:
                damaged.append(DamagedPart(path=path, table=table, problem=problem, rows=rows))
    return ManifestCheck(good=good, damaged=tuple(damaged))


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupMetadata:
    """The shard groups of committed samples whose ``zarr.json`` files are damaged."""

    damage: tuple[MetadataDamage, ...]
    formats: dict[str, dict[str, ArrayFormat]]
    """shard -> the formats its arrays will have once the damage is rebuilt (rebuildable groups)."""
    unusable: dict[str, str]
    """shard -> why its metadata cannot be rebuilt: its samples cannot be checked."""


def committed_ends(shards: np.ndarray, ends: np.ndarray) -> dict[str, int]:
    """shard -> the end of its last committed row (from parallel arrays of shard names and row ends)."""
    out: dict[str, int] = {}
    for shard, end in zip(shards.tolist(), ends.tolist(), strict=True):
        out[str(shard)] = max(out.get(str(shard), 0), int(end))
    return out


def check_metadata(root: str | Path, ends: dict[str, int], infos: dict[str, ShardInfo]) -> GroupMetadata:
    """``shard_meta.check_group_meta`` for every group that holds committed rows (shard -> row end)."""
    layout = CacheLayout.at(root)
    fingerprint = read_fingerprint(root)
    damage: list[MetadataDamage] = []
    formats: dict[str, dict[str, ArrayFormat]] = {}
    unusable: dict[str, str] = {}
    for shard, committed_rows in sorted(ends.items()):
        group = layout.shard_group(shard)
        found = check_group_meta(
            group, shard=shard, fingerprint=fingerprint, info=infos.get(shard), committed_rows=committed_rows
        )
        if not found:
            continue
        damage += found
        if any(d.rebuilt is None for d in found):
            unusable[shard] = "; ".join(d.problem for d in found) + (
                ", and its manifest/shards row is missing or damaged, so it cannot be rebuilt"
            )
        else:
            formats[shard] = rebuilt_formats(group, found)
    return GroupMetadata(damage=tuple(damage), formats=formats, unusable=unusable)


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
    format_version: int
    samples_checked: int
    bytes_checked: int
    """Raw (decoded) bytes re-read and re-checksummed."""
    damaged_parts: tuple[DamagedPart, ...]
    metadata: tuple[MetadataDamage, ...]
    """Damaged ``zarr.json`` files of shard groups (``rebuilt`` None: cannot be rebuilt)."""
    damaged: tuple[DamagedSample, ...]
    duplicates: tuple[str, ...]
    """Sample ids with more than one committed row."""
    unreferenced: tuple[UnreferencedData, ...]
    slack_bytes: int
    """Estimated stored bytes of unreferenced rows inside shard files that also hold committed rows."""

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.duplicates and not self.damaged_parts and not self.metadata

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
        if self.format_version == 1:
            lines.append(
                "  format 1 cache: its manifest parts carry no sha256, so damage to them is not detected"
            )
        for part in self.damaged_parts:
            lines.append(
                f"  damaged manifest part {part.path.relative_to(self.root)}: {part.problem} "
                f"(its rows are left out of this check)"
            )
        for meta in self.metadata:
            fix = "rebuildable" if meta.rebuilt is not None else "cannot be rebuilt"
            lines.append(f"  damaged metadata {meta.path.relative_to(self.root)}: {meta.problem} ({fix})")
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
        if not self.ok or self.unreferenced:
            lines.append(
                f"to see what a repair would change (nothing is changed): "
                f"dflash verify --repair --dry-run {self.root}"
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


def _unreferenced(
    layout: CacheLayout, table: SampleTable, formats: dict[str, dict[str, ArrayFormat]] | None = None
) -> tuple[list[UnreferencedData], int]:
    """The shard groups and shard files no sample of ``table`` touches, and an estimate of the bytes of
    unreferenced rows inside the shard files it does touch."""
    intervals = _committed_intervals(table)
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
            features = (formats or {}).get(shard, {}).get("features") or parse_array_format(
                group / "features", "features"
            )
        except CacheFormatError:
            continue  # damaged metadata: reported, and its samples with it
        sr = features.shard_rows
        for k, paths in _files_by_shard_index(group, files):
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
            slack += _slack_bytes(features, k, covered_rows=covered, size=size)
    return found, int(slack)


def _committed_intervals(table: SampleTable) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """shard -> (first row, end row) of each of its committed samples."""
    intervals: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for code, shard in enumerate(table.shard_names):
        mask = table.shard_code == code
        intervals[shard] = (table.row_start[mask], table.row_start[mask] + table.num_tokens[mask])
    return intervals


def _files_by_shard_index(group: Path, files: list[Path]) -> list[tuple[int, list[Path]]]:
    """(shard index, the files of every array for it) of a group's shard files, by index."""
    by_index: dict[int, list[Path]] = defaultdict(list)
    for p in files:
        rel = p.relative_to(group).parts  # (array, "c", index[, "0"])
        if len(rel) >= 3 and rel[0] in ARRAYS and rel[2].isdigit():
            by_index[int(rel[2])].append(p)
    return sorted(by_index.items())


def _slack_bytes(features: ArrayFormat, k: int, *, covered_rows: int, size: int) -> float:
    """Estimated bytes of shard file ``k`` (``size`` bytes over its arrays) that hold no committed row:
    its written rows (whole inner chunks, up to the array's length) less ``covered_rows``, pro rata."""
    try:
        shard_file = ShardFile(features, k)
    except CacheFormatError:
        return 0.0
    written_rows = int((shard_file.offsets >= 0).sum()) * features.chunk_rows
    written_rows = min(written_rows, max(0, features.num_rows - k * features.shard_rows))
    return size * (written_rows - covered_rows) / written_rows if written_rows > covered_rows else 0.0


def damaged_rows(
    reader: CacheReader, bar: Any = None, *, unusable: dict[str, str] | None = None
) -> dict[int, str]:
    """Positions in ``reader.samples`` whose bytes cannot be read or fail their crc32c -> why.
    Reads in (shard, row) order, ``_BATCH_BYTES`` at a time; ``bar`` (tqdm) counts stored bytes.
    The samples of the ``unusable`` shards (shard -> why) are not read: they are reported with why."""
    table = reader.samples
    storage = reader.storage
    row_bytes = storage.token_bytes
    lossy = storage.lossy is not None

    def read(rows: np.ndarray) -> list[CachedSample]:
        # A lossy cache's checksum covers its stored (encoded) bytes: read those, undecoded.
        if not lossy:
            return reader.read_rows(rows)
        needed = int(table.num_tokens[rows].astype(np.int64).sum())
        return reader.read_rows(rows, stored_out=np.empty((needed, storage.width), storage.dtype))

    order = np.lexsort((table.row_start, table.shard_code)) if len(table) else np.zeros(0, np.int64)
    damaged: dict[int, str] = {}
    for shard, why in (unusable or {}).items():
        if shard in table.shard_names:
            hit = table.shard_code[order] == table.shard_names.index(shard)
            damaged.update((int(row), f"metadata: {why}") for row in order[hit].tolist())
            order = order[~hit]
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


def verify_cache(root: str | Path, *, progress: bool = True, num_threads: int = 4) -> VerifyReport:
    """Re-read and re-checksum every committed sample; see the module docstring for what is reported."""
    layout = CacheLayout.at(root)
    manifest = check_manifest(root)
    raw_ids = read_parts("samples", manifest.good["samples"], ["sample_id"], legacy_names=True)["sample_id"]
    counts = pc.value_counts(raw_ids)
    duplicates = sorted(str(v["values"]) for v in counts.to_pylist() if v["counts"] > 1)
    damaged: dict[int, str] = {}
    with CacheReader.open(root, num_threads=num_threads, skip_parts=manifest.damaged_paths) as reader:
        table = reader.samples
        ends = committed_ends(table.shard, table.row_start + table.num_tokens)
        metadata = check_metadata(root, ends, manifest.shard_infos())
        for shard, formats in metadata.formats.items():
            reader.use_formats(shard, formats)
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
        for row, problem in damaged_rows(reader, bar, unusable=metadata.unusable).items():
            damaged.setdefault(row, problem)
        checked = len(table)
        checked_bytes = int(table.num_tokens.astype(np.int64).sum()) * row_bytes
        bar.close()
        unreferenced, slack = _unreferenced(layout, table, metadata.formats)
    unreferenced += stale_temp_files(root)
    return VerifyReport(
        root=layout.root,
        format_version=read_format_version(root),
        samples_checked=checked,
        bytes_checked=checked_bytes,
        damaged_parts=manifest.damaged,
        metadata=metadata.damage,
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


def stale_temp_files(root: str | Path) -> list[UnreferencedData]:
    layout = CacheLayout.at(root)
    return [
        UnreferencedData(
            path=str(path.relative_to(layout.root)),
            num_bytes=path.stat().st_size,
            reason="stale temp file",
            files=(path,),
        )
        for path in partial_files(root)
    ]


def unreferenced_data(
    root: str | Path, table: SampleTable, formats: dict[str, dict[str, ArrayFormat]] | None = None
) -> list[UnreferencedData]:
    """Shard groups and shard files that no sample of ``table`` points at, and stale temp files (no bytes
    are re-read: what ``verify_cache`` reports as waste, computed from a sample table alone)."""
    found, _slack = _unreferenced(CacheLayout.at(root), table, formats)
    return found + stale_temp_files(root)
