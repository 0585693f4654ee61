"""Where everything of one cache lives, and ``cache.json`` (format version + run fingerprint).

```
CACHE/cache.json
CACHE/shards/<shard>.zarr/                    one Zarr v3 group per writer session
CACHE/manifest/samples/<shard>-<part>.<sha256>.parquet committed sample rows, temp file + rename
CACHE/manifest/failures/<shard>-<part>.<sha256>.parquet
CACHE/manifest/shards/<shard>.<sha256>.parquet       one ShardInfo row, written when the session opens
CACHE/manifest/runs/<run_id>.<rev>.<sha256>.parquet  one RunRow revision per update of the run
CACHE/manifest/seals/<shard>.<sha256>.parquet        a store that gets no more rows (docs/follow.md)
CACHE/manifest/retirements/<shard>.<sha256>.parquet  a store whose files training deleted
CACHE/manifest/waits/<run_id>-<n>.<sha256>.parquet   a span one side of the window waited for the other
CACHE/manifest/damaged/<table>/                      parts ``dflash verify --repair`` moved aside
CACHE/index.duckdb                            merged index (``dflash index``), may be stale or absent
```
The Parquet manifest is the truth; ``index.duckdb`` is a convenience built from it. The sha256 in a
part's name is that of its bytes (``manifest.py``); format-1 caches name parts without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.cache.fingerprint import (
    CACHE_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    CacheFingerprint,
)
from dflash_offline.errors import CacheFormatError
from dflash_offline.locking import LOCK_NAME

MANIFEST_TABLES = ("samples", "failures", "shards", "runs", "seals", "retirements", "waits")
"""``seals``, ``retirements`` and ``waits``: the disk window's records (docs/follow.md)."""
PARTIAL_SUFFIX = ".partial"
"""zarr-python's LocalStore writes ``<key>.<uuid>.partial`` and renames it; a crash leaves them behind."""
TEMP_MARKER = ".tmp-"
"""Our own temp files (manifest parts, cache.json, index.duckdb) are ``<name>.tmp-<pid>-<n>``."""
_OWN_TEMP_NAME = re.compile(re.escape(TEMP_MARKER) + r"\d+-\d+(\.wal)?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheLayout:
    """Paths of one cache directory (nothing is created by building it)."""

    root: Path
    """The cache directory."""
    cache_json: Path
    """Format version and run fingerprint."""
    shards_dir: Path
    """Holds one ``<shard>.zarr`` group per writer session."""
    manifest_dir: Path
    """Holds one folder of Parquet parts per manifest table."""
    index_path: Path
    """The merged DuckDB index."""

    @classmethod
    def at(cls, root: str | Path) -> CacheLayout:
        root = Path(root)
        return cls(
            root=root,
            cache_json=root / "cache.json",
            shards_dir=root / "shards",
            manifest_dir=root / "manifest",
            index_path=root / "index.duckdb",
        )

    def table_dir(self, table: str) -> Path:
        """Folder of the Parquet parts of one manifest table (samples, failures, shards, runs)."""
        assert table in MANIFEST_TABLES, table
        return self.manifest_dir / table

    def shard_group(self, shard: str) -> Path:
        return self.shards_dir / f"{shard}.zarr"

    @property
    def damaged_dir(self) -> Path:
        """Where ``dflash verify --repair`` moves damaged manifest parts (no reader lists it)."""
        return self.manifest_dir / "damaged"

    def part_path(self, table: str, shard: str, part: int) -> Path:
        """The name a part is written for; ``manifest.write_part`` adds its sha256 to it."""
        return self.table_dir(table) / f"{shard}-{part:06d}.parquet"

    def parts(self, table: str) -> list[Path]:
        """The committed Parquet parts of a table, sorted by name (temp files are not listed)."""
        folder = self.table_dir(table)
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.glob("*.parquet") if p.is_file())


def write_atomic(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and a rename."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if fsync:
        fsync_dir(path.parent)


_temp_counter = 0


def temp_path(path: Path) -> Path:
    """A temp name next to ``path`` that no glob for ``*.parquet`` / ``*.json`` matches."""
    global _temp_counter
    _temp_counter += 1
    return path.with_name(f"{path.name}{TEMP_MARKER}{os.getpid()}-{_temp_counter}")


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise CacheFormatError(
            f"cache path {root} is a file, not a directory; pass a directory (new or existing)"
        )


def _cache_json_text(fingerprint: CacheFingerprint, version: int = CACHE_FORMAT_VERSION) -> bytes:
    doc = {"format_version": version, "fingerprint": fingerprint.to_dict()}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _format_version(doc: Any, path: Path) -> int:
    if not isinstance(doc, dict) or "format_version" not in doc or "fingerprint" not in doc:
        raise CacheFormatError(f"{path} is not a dflash cache.json (needs format_version and fingerprint)")
    version = doc["format_version"]
    if version not in READABLE_FORMAT_VERSIONS:
        *first, last = (str(v) for v in READABLE_FORMAT_VERSIONS)
        readable = f"{', '.join(first)} and {last}" if first else last
        raise CacheFormatError(
            f"{path} has format_version {version!r}; this dflash-offline reads formats {readable}: "
            f"use the dflash-offline version that wrote it, or regenerate the cache"
        )
    return int(version)


def parse_cache_json(doc: Any, path: Path) -> CacheFingerprint:
    """Parse the content of ``cache.json``; refuses unknown format versions."""
    _format_version(doc, path)
    try:
        return CacheFingerprint.from_dict(doc["fingerprint"])
    except (CacheFormatError, TypeError, ValueError, AttributeError) as e:
        raise CacheFormatError(
            f"{path}: {e}; this dflash-offline did not write it: regenerate the cache into a new directory"
        ) from None


def read_format_version(root: str | Path) -> int:
    """The format version in an existing cache's cache.json (``READABLE_FORMAT_VERSIONS``; others are
    refused)."""
    layout = CacheLayout.at(root)
    read_fingerprint(root)  # the shared messages for a missing or unreadable cache.json
    return _format_version(json.loads(layout.cache_json.read_text()), layout.cache_json)


def read_fingerprint(root: str | Path) -> CacheFingerprint:
    """The fingerprint of an existing cache; refuses a missing cache.json and unknown format versions."""
    layout = CacheLayout.at(root)
    _check_root(layout.root)
    try:
        text = layout.cache_json.read_text()
    except FileNotFoundError:
        if _has_foreign_files(layout.root):
            # generate refuses such a directory too: do not advise it (a lost cache.json, or a typo).
            raise CacheFormatError(
                f"{layout.root} is not a dflash cache: it has files but no {layout.cache_json.name} "
                f"(pass the directory `dflash generate` wrote, or restore its {layout.cache_json.name})"
            ) from None
        raise CacheFormatError(
            f"{layout.root} is not a dflash cache: {layout.cache_json.name} is missing "
            f"(create it with `dflash generate --cache {layout.root}`)"
        ) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CacheFormatError(
            f"{layout.cache_json} is not valid JSON ({e}); restore it or regenerate the cache"
        ) from e
    return parse_cache_json(doc, layout.cache_json)


def _has_foreign_files(root: Path) -> bool:
    """True for a directory holding anything but our temp files and the writer lock."""
    return root.is_dir() and any(TEMP_MARKER not in p.name and p.name != LOCK_NAME for p in root.iterdir())


def create_or_open_cache(root: str | Path, fingerprint: CacheFingerprint) -> CacheLayout:
    """Create a cache (directories + cache.json) or check that an existing one has the same fingerprint.

    Raises ``CacheFormatError`` for a root that is a file or an unknown format version, and
    ``FingerprintMismatchError`` naming the first differing field. Safe when several processes race:
    cache.json is created with a hard link, which fails if another process created it first."""
    layout = CacheLayout.at(root)
    _check_root(layout.root)
    expected_dtype = fingerprint.storage.storage_dtype  # an unknown codec was refused when it was built
    if fingerprint.storage_dtype != expected_dtype:
        raise CacheFormatError(
            f"storage_dtype {fingerprint.storage_dtype!r} does not go with codec {fingerprint.codec!r}; "
            f"use {expected_dtype!r}"
        )
    if not layout.cache_json.exists():
        if _has_foreign_files(layout.root):
            raise CacheFormatError(
                f"{layout.root} is not empty and has no cache.json: it is not a dflash cache; "
                f"pass a new or empty directory"
            )
        layout.root.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(layout.cache_json)
        tmp.write_bytes(_cache_json_text(fingerprint))
        try:
            os.link(tmp, layout.cache_json)  # atomic create-if-absent
        except FileExistsError:
            pass  # another process won the race: check its fingerprint below
        finally:
            tmp.unlink()
    existing = read_fingerprint(layout.root)
    existing.check_same(fingerprint)
    layout.shards_dir.mkdir(exist_ok=True)
    for table in MANIFEST_TABLES:
        layout.table_dir(table).mkdir(parents=True, exist_ok=True)
    return layout


def is_own_temp_file(path: Path) -> bool:
    """A name ``temp_path`` gives (``<name>.tmp-<pid>-<n>``, or the ``.wal`` DuckDB keeps beside such a
    database): nothing else is ours to delete, not even ``x.tmp-1-2.parquet``, which every reader of
    the manifest takes for a part."""
    return _OWN_TEMP_NAME.search(path.name) is not None


def partial_files(root: str | Path) -> list[Path]:
    """Stale temp files: zarr's ``*.partial`` in the shards, our ``temp_path`` names anywhere in the cache
    but ``manifest/damaged/`` (what repair moved aside is kept, whatever its name)."""
    layout = CacheLayout.at(root)
    found: list[Path] = []
    if layout.shards_dir.is_dir():
        found += [p for p in layout.shards_dir.rglob(f"*{PARTIAL_SUFFIX}") if p.is_file()]
        ours = layout.shards_dir.rglob(f"*{TEMP_MARKER}*")
        found += [p for p in ours if is_own_temp_file(p) and p.is_file()]
    if layout.manifest_dir.is_dir():
        found += [
            p
            for p in layout.manifest_dir.rglob(f"*{TEMP_MARKER}*")
            if is_own_temp_file(p) and p.is_file() and layout.damaged_dir not in p.parents
        ]
    if layout.root.is_dir():
        found += [p for p in layout.root.glob(f"*{TEMP_MARKER}*") if is_own_temp_file(p) and p.is_file()]
    return sorted(found)


def sweep_partial_files(root: str | Path) -> int:
    """Delete stale temp files left by killed writers; returns how many. Call only while no writer runs
    (generate's main process does, before starting workers)."""
    removed = 0
    for path in partial_files(root):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed
