"""``dflash verify --repair``: make a cache consistent again, under its writer lock, by a plan first.

``plan_repair`` decides, without changing anything; ``apply_repair`` carries a plan out. Nothing is
dropped or deleted that has not been proven bad:
  - A manifest part whose bytes do not match the sha256 in its name (or do not parse) is moved aside
    to ``manifest/damaged/<table>/``, never deleted; its samples are then no longer claimed (rerunning
    the same ``dflash generate`` recomputes them), and the shard files of its shard are kept.
  - A damaged ``zarr.json`` of a shard group is rebuilt from the fingerprint and the group's
    ``manifest/shards`` row (``shard_meta.py``), and the group's samples are checked through the
    rebuilt metadata: metadata damage never turns into dropped samples. A group whose metadata cannot
    be rebuilt is left as it is, its samples unjudged.
  - A sample_id committed more than once: every copy is re-read; the first commit (created_at, shard,
    row_start) whose bytes pass their crc32c is kept, the other rows are dropped from their parts.
  - A committed sample whose bytes are damaged (no copy passes; read through trustworthy metadata) is
    dropped: the cache then no longer claims it, and rerunning ``dflash generate`` recomputes it.
  - Orphan bytes are removed: shard groups and shard files no committed sample points at (after the
    drops above), their ``manifest/shards`` rows, and stale temp files.

Manifest parts are immutable for readers and writers; repair is the one exception: it writes the
rewritten part under its new sha256 and then removes the old one, so a kill in between leaves both
(the kept rows committed twice, which the next ``--repair`` resolves), never a lost row.
After a repair ``verify`` is clean. index.duckdb is rebuilt when there was one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from dflash_offline.cache.codecs import raw_token_bytes
from dflash_offline.cache.layout import CacheLayout, read_fingerprint
from dflash_offline.cache.manifest import PartName, read_parts, write_part
from dflash_offline.cache.reader import CacheReader, SampleTable
from dflash_offline.cache.shard_meta import MetadataDamage, rebuild
from dflash_offline.cache.verify import (
    DamagedPart,
    GroupMetadata,
    ManifestCheck,
    UnreferencedData,
    check_manifest,
    check_metadata,
    committed_ends,
    damaged_rows,
    unreferenced_data,
)
from dflash_offline.cache.window import retired_in_parts
from dflash_offline.locking import hold_lock

_PART_STEM = re.compile(r"^(?P<shard>[^.]+)-\d+$")
"""A samples part's name before its first dot: ``<shard>-<n>``."""
_SHOWN = 20
"""Sample ids listed by name in a plan or report."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DroppedSample:
    """A committed sample the plan drops because its bytes fail (no good copy exists)."""

    sample_id: str
    shard: str
    num_tokens: int
    problem: str


@dataclass(frozen=True, kw_only=True, slots=True)
class PartRewrite:
    """A samples part that loses rows: ``keep`` is a bool per row (all False: the part is removed)."""

    path: Path
    table: pa.Table
    keep: np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class RepairPlan:
    """What ``apply_repair`` will do, and why (``render`` prints it)."""

    root: Path
    parts_aside: tuple[DamagedPart, ...]
    """Damaged manifest parts, moved to ``manifest/damaged/`` (kept)."""
    rebuild: tuple[MetadataDamage, ...]
    """Damaged ``zarr.json`` files, rewritten from the fingerprint and ``manifest/shards``."""
    unrebuildable: dict[str, str]
    """shard -> why its metadata cannot be rebuilt (left as it is, its samples kept unjudged)."""
    duplicate_rows: int
    """Extra commits of a sample_id dropped (one good copy of each kept)."""
    dropped: tuple[DroppedSample, ...]
    """Samples with no copy whose bytes verify."""
    dropped_raw_bytes: int
    """Raw (decoded) bytes of the dropped samples."""
    rewrites: tuple[PartRewrite, ...]
    delete: tuple[UnreferencedData, ...]
    """Orphan shard bytes and stale temp files."""
    kept_leftovers: tuple[str, ...]
    """Shards whose unreferenced files are kept because a damaged samples part may point at them."""
    samples_before: int
    samples_after: int
    """Distinct committed sample ids in the intact parts now, and after the plan."""
    rows_in_damaged_parts: int
    """Sample rows the damaged samples parts hold, as far as they still parse."""
    had_index: bool

    @property
    def delete_bytes(self) -> int:
        return sum(u.num_bytes for u in self.delete)

    @property
    def changes(self) -> bool:
        return bool(self.parts_aside or self.rebuild or self.rewrites or self.delete)

    @staticmethod
    def _kept_line(shard: str) -> str:
        return (
            f"  keep the unreferenced files of {shard}: a damaged manifest part of it (moved aside to "
            "manifest/damaged/samples/) may point at them; delete that part to let repair remove them"
        )

    def render(self) -> str:
        root = self.root
        if not self.changes:
            lines = [f"repair plan for {root}: nothing to repair ({self.samples_before:,} samples)"]
            lines += [f"  left as it is: {shard}: {why}" for shard, why in self.unrebuildable.items()]
            lines += [self._kept_line(shard) for shard in self.kept_leftovers]
            return "\n".join(lines)
        lines = [f"repair plan for {root}:"]
        if self.parts_aside:
            lines.append(
                f"  move {len(self.parts_aside)} damaged manifest parts to "
                f"{(CacheLayout.at(root).damaged_dir).relative_to(root)}/ (kept; their rows are no "
                "longer claimed, rerun the same `dflash generate` to recompute its samples):"
            )
            for part in self.parts_aside:
                rows = "rows unreadable" if part.rows is None else f"{part.rows:,} rows"
                lines.append(f"    {part.path.relative_to(root)} ({rows}): {part.problem}")
        if self.rebuild:
            lines.append(
                f"  rebuild {len(self.rebuild)} damaged zarr.json files from cache.json and "
                "manifest/shards (their groups' samples are kept, checked through the rebuilt metadata):"
            )
            lines += [f"    {d.path.relative_to(root)}: {d.problem}" for d in self.rebuild]
        for shard, why in self.unrebuildable.items():
            lines.append(f"  leave {shard} as it is (its samples are kept, unchecked): {why}")
        if self.dropped:
            lines.append(
                f"  drop {len(self.dropped):,} damaged samples ({self.dropped_raw_bytes:,} raw bytes; their "
                "bytes fail their crc32c or do not decode; rerun the same `dflash generate` to "
                "recompute them):"
            )
            lines += [f"    {d.sample_id} in {d.shard}: {d.problem}" for d in self.dropped[:_SHOWN]]
            if len(self.dropped) > _SHOWN:
                lines.append(f"    ... and {len(self.dropped) - _SHOWN:,} more")
        if self.duplicate_rows:
            lines.append(
                f"  drop {self.duplicate_rows:,} duplicate commits (the first good copy of each id is kept)"
            )
        if self.delete:
            lines.append(
                f"  delete {len(self.delete):,} unreferenced files or groups ({self.delete_bytes:,} bytes; "
                "no committed sample points at them):"
            )
            lines += [f"    {u.path}: {u.num_bytes:,} bytes, {u.reason}" for u in self.delete[:_SHOWN]]
            if len(self.delete) > _SHOWN:
                lines.append(f"    ... and {len(self.delete) - _SHOWN:,} more")
        lines += [self._kept_line(shard) for shard in self.kept_leftovers]
        damaged = f" (+ {self.rows_in_damaged_parts:,} in damaged parts)" if self.parts_aside else ""
        lines.append(
            f"  samples: {self.samples_before:,} committed now{damaged}, {self.samples_after:,} after"
        )
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True, slots=True)
class RepairReport:
    """What ``apply_repair`` changed."""

    root: Path
    duplicate_rows_dropped: int
    """Extra commits of a sample_id removed from the manifest (one good copy of each kept)."""
    damaged_ids_dropped: tuple[str, ...]
    """Sample ids with no copy whose bytes verify: removed, for generate to recompute."""
    parts_rewritten: int
    parts_moved_aside: int
    metadata_rebuilt: int
    files_removed: int
    """Files and shard groups removed (orphan shard data, stale temp files)."""
    bytes_freed: int

    def render(self) -> str:
        lines = [
            f"repaired {self.root}: dropped {self.duplicate_rows_dropped:,} duplicate commits, "
            f"{len(self.damaged_ids_dropped):,} damaged samples ({self.parts_rewritten} manifest parts "
            f"rewritten, {self.parts_moved_aside} moved aside); rebuilt {self.metadata_rebuilt} zarr.json "
            f"files; removed {self.files_removed:,} orphan files or groups, freed {self.bytes_freed:,} bytes"
        ]
        if self.damaged_ids_dropped:
            shown = ", ".join(self.damaged_ids_dropped[:_SHOWN])
            lines.append(
                f"  rerun the same `dflash generate` to recompute the damaged samples: {shown}"
                + (" ..." if len(self.damaged_ids_dropped) > _SHOWN else "")
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


def _bad_rows(
    root: Path,
    rows: pa.Table,
    ranks: np.ndarray,
    metadata: GroupMetadata,
    skip_parts: frozenset[Path],
    progress: bool,
    present: np.ndarray,
) -> dict[int, str]:
    """Row -> why, for the rows whose bytes do not read back or fail their checksum, read through the
    (rebuilt where damaged) metadata. Rows of groups whose metadata cannot be rebuilt are not judged.
    Copies of one id are checked in rounds (first commits, then second commits, ...) since a reader's
    table holds one row per id. Rows outside ``present`` (of retired stores) are not judged."""
    bad: dict[int, str] = {}
    judged = present & ~np.isin(rows["shard"].to_numpy(zero_copy_only=False), list(metadata.unusable))
    with CacheReader.open(root, skip_parts=skip_parts) as reader:
        for shard, formats in metadata.formats.items():
            reader.use_formats(shard, formats)
        row_bytes = raw_token_bytes(reader.fingerprint.feature_width)
        total = int(pc.sum(rows["num_tokens"]).as_py() or 0) * row_bytes
        with tqdm(total=total, unit="B", unit_scale=True, desc="repair", disable=not progress) as bar:
            for rank in range(int(ranks.max()) + 1 if len(ranks) else 0):
                positions = np.flatnonzero((ranks == rank) & judged)
                subset = rows.take(pa.array(positions))
                reader.samples = SampleTable.from_arrow(subset)
                # from_arrow re-sorts; map its rows back to ours through sample_id (unique in a round)
                back = dict(zip(subset["sample_id"].to_pylist(), positions.tolist(), strict=True))
                for row, problem in damaged_rows(reader, bar).items():
                    bad[back[str(reader.samples.sample_id[row])]] = problem
    return bad


@contextlib.contextmanager
def repair_session(root: str | Path, *, progress: bool = True) -> Iterator[RepairPlan]:
    """Take the cache's writer lock and plan a repair (nothing is changed); the lock is held until
    the block ends, so ``apply_repair`` inside it acts on exactly what was planned. Refused with
    ``LockedError`` while a writer holds the cache."""
    layout = CacheLayout.at(root)
    read_fingerprint(root)  # a clear error for a path that is not a cache
    with hold_lock(layout.root, what="cache"):
        yield plan_repair(layout.root, progress=progress)


@dataclass(frozen=True, kw_only=True, slots=True)
class _CommittedRows:
    """The rows of the intact samples parts, concatenated in part order."""

    parts: list[Path]
    tables: list[pa.Table]
    """One per part, as read."""
    rows: pa.Table
    """All of ``tables``, one after the other."""
    part_of: np.ndarray
    """int64 [rows]: the index in ``parts`` of each row's part."""


def _read_committed(manifest: ManifestCheck) -> _CommittedRows:
    parts = manifest.good["samples"]
    tables = [read_parts("samples", [p], legacy_names=True) for p in parts]
    return _CommittedRows(
        parts=parts,
        tables=tables,
        rows=pa.concat_tables(tables) if tables else read_parts("samples", []),
        part_of=np.repeat(np.arange(len(tables), dtype=np.int64), [t.num_rows for t in tables]),
    )


def _first_good_copies(ids: list[str], ranks: np.ndarray, bad: dict[int, str]) -> np.ndarray:
    """bool per row: the earliest copy (lowest rank) of each sample_id whose bytes are not bad."""
    keep = np.zeros(len(ids), dtype=bool)
    kept_ids: set[str] = set()
    for position in np.argsort(ranks, kind="stable").tolist():
        if position not in bad and ids[position] not in kept_ids:
            keep[position] = True
            kept_ids.add(ids[position])
    return keep


def _dropped_samples(
    rows: pa.Table, ids: list[str], dropped_ids: set[str], ranks: np.ndarray, bad: dict[int, str]
) -> tuple[DroppedSample, ...]:
    """The samples no copy of which survives, by id, each described by its first commit."""
    shard_names = rows["shard"].to_numpy(zero_copy_only=False)
    num_tokens = rows["num_tokens"].to_numpy()
    first_bad = {}
    for position in np.argsort(ranks, kind="stable").tolist():
        if ids[position] in dropped_ids and ids[position] not in first_bad:
            first_bad[ids[position]] = position
    return tuple(
        DroppedSample(
            sample_id=sample_id,
            shard=str(shard_names[position]),
            num_tokens=int(num_tokens[position]),
            problem=bad[position],
        )
        for sample_id, position in sorted(first_bad.items())
    )


def _part_rewrites(committed: _CommittedRows, keep: np.ndarray) -> tuple[PartRewrite, ...]:
    """The samples parts that lose at least one row."""
    return tuple(
        PartRewrite(path=path, table=table, keep=keep[committed.part_of == index])
        for index, (path, table) in enumerate(zip(committed.parts, committed.tables, strict=True))
        if not keep[committed.part_of == index].all()
    )


def _guarded_shards(layout: CacheLayout, manifest: ManifestCheck) -> set[str]:
    """Shards named by a damaged samples part (found now or moved aside by an earlier repair): such a
    part may point at their files, so they are not deleted as orphans."""
    aside = layout.damaged_dir / "samples"
    damaged_parts = [d.path for d in manifest.damaged if d.table == "samples"]
    damaged_parts += sorted(aside.iterdir()) if aside.is_dir() else []
    return {shard for path in damaged_parts if (shard := _shard_of_part_name(path)) is not None}


def _shard_of_part_name(path: Path) -> str | None:
    """The shard a samples part is named after (``<shard>-<n>.<sha256>.parquet``, shard names hold no
    dot), or None for a name of another form (a part renamed by hand names no shard)."""
    match = _PART_STEM.match(path.name.split(".")[0])
    return match.group("shard") if match else None


def _orphan_shard(orphan: UnreferencedData) -> str | None:
    """The shard an orphan belongs to; None for a file outside ``shards/``."""
    if not orphan.path.startswith("shards/"):
        return None
    return orphan.path.split("/")[1].removesuffix(".zarr")


def plan_repair(root: Path, *, progress: bool = True) -> RepairPlan:
    """What a repair would do (call under the cache's writer lock; see ``repair_session``)."""
    layout = CacheLayout.at(root)
    manifest = check_manifest(root)
    committed = _read_committed(manifest)
    rows = committed.rows
    shard_names = rows["shard"].to_numpy(zero_copy_only=False)
    ends = rows["row_start"].to_numpy() + rows["num_tokens"].to_numpy().astype(np.int64)
    # A retired store's rows stay as they are: its files are intentionally gone (docs/follow.md).
    present = ~np.isin(shard_names, list(retired_in_parts(manifest.good["retirements"])))
    metadata = check_metadata(
        root, committed_ends(shard_names[present], ends[present]), manifest.shard_infos()
    )
    ranks = _copy_ranks(rows) if rows.num_rows else np.zeros(0, np.int64)
    bad = (
        _bad_rows(root, rows, ranks, metadata, manifest.damaged_paths, progress, present)
        if rows.num_rows
        else {}
    )

    ids = rows["sample_id"].to_pylist()
    keep = _first_good_copies(ids, ranks, bad)
    kept_ids = {ids[position] for position in np.flatnonzero(keep).tolist()}
    dropped_ids = set(ids) - kept_ids
    dropped = _dropped_samples(rows, ids, dropped_ids, ranks, bad)
    copies = Counter(ids)
    duplicate_rows = int((~keep).sum()) - sum(copies[i] for i in dropped_ids)

    # Orphans as they will be once the drops are done; a damaged samples part's shard keeps its files.
    orphans = unreferenced_data(root, SampleTable.from_arrow(rows.filter(pa.array(keep))), metadata.formats)
    guarded = _guarded_shards(layout, manifest)
    row_bytes = raw_token_bytes(read_fingerprint(root).feature_width)
    return RepairPlan(
        root=layout.root,
        parts_aside=manifest.damaged,
        rebuild=tuple(d for d in metadata.damage if d.shard not in metadata.unusable),
        unrebuildable=metadata.unusable,
        duplicate_rows=duplicate_rows,
        dropped=dropped,
        dropped_raw_bytes=sum(d.num_tokens for d in dropped) * row_bytes,
        rewrites=_part_rewrites(committed, keep),
        delete=tuple(o for o in orphans if _orphan_shard(o) not in guarded),
        kept_leftovers=tuple(sorted({s for o in orphans if (s := _orphan_shard(o)) is not None} & guarded)),
        samples_before=len(set(ids)),
        rows_in_damaged_parts=sum(d.rows or 0 for d in manifest.damaged if d.table == "samples"),
        samples_after=len(kept_ids),
        had_index=layout.index_path.is_file(),
    )


def _move_aside(layout: CacheLayout, part: DamagedPart) -> None:
    folder = layout.damaged_dir / part.table
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / part.path.name
    n = 0
    while target.exists():
        n += 1
        target = folder / f"{part.path.name}.{n}"
    os.replace(part.path, target)


def apply_repair(plan: RepairPlan) -> RepairReport:
    """Carry out a plan made by ``repair_session`` (inside its block: under the lock)."""
    layout = CacheLayout.at(plan.root)
    for part in plan.parts_aside:
        _move_aside(layout, part)
    for damage in plan.rebuild:
        rebuild(damage)
    for rewrite in plan.rewrites:
        if rewrite.keep.any():
            written = write_part(rewrite.path, rewrite.table.filter(pa.array(rewrite.keep)), fsync=True)
            if written != rewrite.path:
                rewrite.path.unlink()
        else:
            rewrite.path.unlink()
    files = bytes_freed = 0
    for orphan in plan.delete:
        for path in orphan.files:
            size = _size(path)
            if path.is_dir():
                shutil.rmtree(path)
                shard = path.name.removesuffix(".zarr")
                for info in layout.parts("shards"):
                    if PartName.parse(info).stem == shard:
                        size += info.stat().st_size
                        info.unlink()
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            files += 1
            bytes_freed += size
    if plan.had_index:
        from dflash_offline.cache.index import build_index

        build_index(layout.root)
    return RepairReport(
        root=layout.root,
        duplicate_rows_dropped=plan.duplicate_rows,
        damaged_ids_dropped=tuple(d.sample_id for d in plan.dropped),
        parts_rewritten=len(plan.rewrites),
        parts_moved_aside=len(plan.parts_aside),
        metadata_rebuilt=len(plan.rebuild),
        files_removed=files,
        bytes_freed=bytes_freed,
    )


def repair_cache(root: str | Path, *, progress: bool = True) -> RepairReport:
    """Plan and apply a repair at once (see the module docstring); the CLI shows the plan first."""
    with repair_session(root, progress=progress) as plan:
        return apply_repair(plan)
