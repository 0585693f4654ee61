"""Check the Zarr metadata of a shard group against what it must be, and rebuild it when it is damaged.

Every ``zarr.json`` of a group (the group's own and one per array) follows from the cache's fingerprint
(codec, feature width, fp8 layout) and the group's ``manifest/shards`` row (chunk and shard rows, worker,
session), except ``shape[0]``: the rows the writer had reserved, which no reader of ours trusts
(docs/cache.md#layout). So a damaged ``zarr.json`` (a flipped byte, a truncated or missing file) is not a
reason to give up the samples of its group: ``expected_group_meta`` writes the metadata the writer wrote,
with ``shape[0]`` taken from an intact sibling array or, failing that, from the committed rows.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import write_atomic
from dflash_offline.cache.rows import ShardInfo
from dflash_offline.cache.zarr_format import (
    ARRAYS,
    ArrayFormat,
    array_format_from_meta,
    create_shard_group,
    read_meta,
)
from dflash_offline.errors import CacheFormatError

GROUP = ""
"""Key of the group's own ``zarr.json`` in the dicts below (arrays are keyed by name)."""
META_KEYS = (GROUP, *ARRAYS)


def meta_path(group: Path, key: str) -> Path:
    return group / key / "zarr.json" if key else group / "zarr.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class MetadataDamage:
    """One ``zarr.json`` of a shard group that is not what its writer wrote."""

    shard: str
    path: Path
    problem: str
    rebuilt: bytes | None
    """The content ``dflash verify --repair`` writes instead; None when it cannot be rebuilt (the
    group's ``manifest/shards`` row is missing or damaged)."""


@lru_cache(maxsize=32)
def _template(fingerprint: CacheFingerprint, chunk_rows: int, shard_rows: int) -> dict[str, str]:
    """key -> the JSON text zarr-python writes for a new group of this layout (attributes empty)."""
    storage = fingerprint.storage
    with tempfile.TemporaryDirectory(prefix="dflash-meta-") as tmp:
        group = Path(tmp) / "g.zarr"
        create_shard_group(
            group, storage=storage, chunk_rows=chunk_rows, shard_rows=shard_rows, attributes={}
        )
        return {key: meta_path(group, key).read_text() for key in META_KEYS}


def expected_group_meta(fingerprint: CacheFingerprint, info: ShardInfo, num_rows: int) -> dict[str, Any]:
    """key -> the metadata the writer of ``info``'s group wrote, with ``shape[0] = num_rows``."""
    template = _template(fingerprint, info.chunk_rows, info.shard_rows)
    out: dict[str, Any] = {}
    for key in META_KEYS:
        meta = json.loads(template[key])
        if key == GROUP:
            meta["attributes"] = {"shard": info.shard, "worker": info.worker, "session": info.session}
        else:
            meta["shape"][0] = int(num_rows)
        out[key] = meta
    return out


def _without_rows(meta: dict[str, Any]) -> dict[str, Any]:
    if isinstance(meta.get("shape"), list) and meta["shape"]:
        return {**meta, "shape": [None, *meta["shape"][1:]]}
    return meta


def _num_rows(meta: dict[str, Any] | None) -> int | None:
    shape = meta.get("shape") if meta is not None else None
    if isinstance(shape, list) and shape and isinstance(shape[0], int) and shape[0] >= 0:
        return int(shape[0])
    return None


def _read(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return read_meta(path), None
    except CacheFormatError as e:
        return None, str(e).removeprefix(f"{path} ")


def check_group_meta(
    group: Path,
    *,
    shard: str,
    fingerprint: CacheFingerprint,
    info: ShardInfo | None,
    committed_rows: int,
) -> list[MetadataDamage]:
    """The ``zarr.json`` files of ``group`` that differ from what its writer wrote (``shape[0]`` aside),
    each with its rebuilt content. Without ``info`` a file can only be checked for being a readable array
    of our layout, and not rebuilt."""
    if not group.is_dir():
        return []  # nothing to describe: its samples' data is missing, which reading them reports
    found = {key: _read(meta_path(group, key)) for key in META_KEYS}
    if info is None:
        damage = []
        for key in ARRAYS:
            meta, problem = found[key]
            if meta is not None:
                try:
                    array_format_from_meta(meta, group / key, key)
                except CacheFormatError as e:
                    problem = str(e)
            if problem is not None:
                path = meta_path(group, key)
                damage.append(MetadataDamage(shard=shard, path=path, problem=problem, rebuilt=None))
        return damage
    rows = [_num_rows(meta) for key, (meta, _) in found.items() if key != GROUP]
    expected = expected_group_meta(fingerprint, info, 0)
    intact = [
        r
        for key, r in zip(ARRAYS, rows, strict=True)
        if r is not None and _without_rows(found[key][0] or {}) == _without_rows(expected[key])
    ]
    num_rows = max([*intact, committed_rows]) if intact else committed_rows
    expected = expected_group_meta(fingerprint, info, num_rows)
    damage = []
    for key in META_KEYS:
        meta, problem = found[key]
        if meta is not None:
            want = expected[key] if key == GROUP else _without_rows(expected[key])
            got = meta if key == GROUP else _without_rows(meta)
            if got != want:
                problem = "differs from the metadata its writer wrote"
            elif key != GROUP and _num_rows(meta) is None:
                problem = f"has shape {meta.get('shape')!r}"
        if problem is not None:
            text = (json.dumps(expected[key], indent=2) + "\n").encode()
            damage.append(
                MetadataDamage(shard=shard, path=meta_path(group, key), problem=problem, rebuilt=text)
            )
    return damage


def rebuilt_formats(group: Path, damage: list[MetadataDamage]) -> dict[str, ArrayFormat]:
    """The formats of a group's arrays as they will be after ``rebuild`` (on-disk ones where intact)."""
    replaced = {d.path: d.rebuilt for d in damage if d.rebuilt is not None}
    out = {}
    for key in ARRAYS:
        path = meta_path(group, key)
        meta = json.loads(replaced[path]) if path in replaced else read_meta(path)
        out[key] = array_format_from_meta(meta, group / key, key)
    return out


def rebuild(damage: MetadataDamage) -> None:
    """Write the rebuilt ``zarr.json`` (temp file + rename)."""
    assert damage.rebuilt is not None
    damage.path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(damage.path, damage.rebuilt, fsync=True)
