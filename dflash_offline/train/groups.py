"""Conversation roots of a cache's samples: what ``--val-group root-id`` splits by.

A format-3 cache stores each sample's conversation root in its row: ``dflash generate`` takes it from
the record it parsed (``data/sources.py:conversation_root``), so the roots are read from the manifest
and the data files are not opened. Rows of a format 1 or 2 cache store none; for those samples alone the
root comes from the data file itself, as before format 3: the files are those the cache's ``dflash
generate`` runs read (their configs are in the cache's runs table, ``data/generate_inputs.py``); every
record is parsed as generate parsed it (the same source name, so the same sample ids) and each sample
without a stored root gets ``conversation_root`` of its record. A sample whose record is in none of those
files (the file changed or is gone) is an error: a split that silently grouped some samples and not
others would leak what it is meant to keep apart.

The roots are computed once, when the run starts, and saved beside the snapshot
(``validation_groups.parquet``): a resume reads them back, so it keeps the split even if the data file
has moved since.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_offline.config_fields import flag
from dflash_offline.errors import CacheFormatError, ConfigError
from dflash_offline.train.config import TrainConfig

GROUPS_FILE = "validation_groups.parquet"
_META_VERSION = b"dflash_groups_version"
GROUPS_FORMAT_VERSION = 1


def conversation_groups(
    cache_dir: Path, sample_ids: Sequence[str], *, source: str, progress: bool = False
) -> dict[str, str]:
    """Sample id → conversation root for every id of ``sample_ids`` (module docstring); ``source`` is
    the cache's data source name (its fingerprint's)."""
    roots = stored_roots(cache_dir, sample_ids)
    if len(roots) < len(set(sample_ids)):  # rows of a format 1 or 2 cache: no root stored
        unstored = [s for s in sample_ids if s not in roots]
        roots.update(reparsed_roots(cache_dir, unstored, source=source, progress=progress))
    return roots


def stored_roots(cache_dir: Path, sample_ids: Sequence[str]) -> dict[str, str]:
    """Sample id → the conversation root stored in its manifest row, for the ids of ``sample_ids`` whose
    row stores one (every row of a format-3 cache written by ``dflash generate``)."""
    from dflash_offline.cache.manifest import read_table

    wanted = set(sample_ids)
    table = read_table(cache_dir, "samples", ["sample_id", "conversation_root"])
    ids, roots = table.column("sample_id").to_pylist(), table.column("conversation_root").to_pylist()
    return {s: r for s, r in zip(ids, roots, strict=True) if r is not None and s in wanted}


def reparsed_roots(
    cache_dir: Path, sample_ids: Sequence[str], *, source: str, progress: bool = False
) -> dict[str, str]:
    """Sample id → conversation root of each of ``sample_ids``, read from the data files the cache's
    generate runs read (module docstring); refuses samples none of those files holds."""
    from tqdm import tqdm

    from dflash_offline.data.conversations import Conversation
    from dflash_offline.data.generate_inputs import generate_inputs
    from dflash_offline.data.sources import conversation_root, iter_records, resolve_data_path
    from dflash_offline.errors import DataError

    wanted = set(sample_ids)
    roots: dict[str, str] = {}
    inputs = generate_inputs(cache_dir)
    unreadable: list[str] = []
    for item in inputs:
        if len(roots) == len(wanted):
            break
        try:
            resolve_data_path(item.data)
        except DataError as e:
            unreadable.append(f"{item.data or 'the embedded ShareGPT file'} ({e})")
            continue
        name = item.data or "the embedded ShareGPT file"
        bar = tqdm(desc=f"conversation roots: {name}", unit="rec", file=sys.stderr, disable=not progress)
        with bar:
            for record in iter_records(item.data, data_format=item.data_format, source=source):
                bar.update(1)
                if isinstance(record, Conversation) and record.sample_id in wanted:
                    roots[record.sample_id] = conversation_root(record.record_id, record.sample_id)
    missing = len(wanted) - len(roots)
    if missing:
        example = next(s for s in sample_ids if s not in roots)
        read = ", ".join(str(i.data or "default") for i in inputs) or "none (no generate run is recorded)"
        gone = f"; not readable: {'; '.join(unreadable)}" if unreadable else ""
        val_group = flag(TrainConfig, "val_group")
        raise ConfigError(
            f"{val_group} root-id needs the record id of every sample, read from the data files the "
            f"cache's generate runs read when the cache does not store it (format 1 or 2) ({read}{gone}); "
            f"{missing} of {len(wanted)} samples (first: {example!r}) are in none of them. Put the file "
            f"generate read back in place (unchanged), or use {val_group} sample"
        )
    return roots


def save_groups(groups: Mapping[str, str], path: Path) -> None:
    """Write sample id → root as Parquet (temp file, then rename)."""
    ids = sorted(groups)
    table = pa.table(
        {"sample_id": pa.array(ids, pa.string()), "root": pa.array([groups[s] for s in ids], pa.string())}
    ).replace_schema_metadata({_META_VERSION: str(GROUPS_FORMAT_VERSION).encode()})
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_groups(path: Path) -> dict[str, str]:
    """The saved sample id → root map (``save_groups``)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CacheFormatError(f"cannot read the validation groups {str(path)!r}: {exc}") from exc
    version = (table.schema.metadata or {}).get(_META_VERSION, b"?").decode()
    if version != str(GROUPS_FORMAT_VERSION):
        raise CacheFormatError(
            f"validation groups {str(path)!r} have format version {version!r}; this dflash reads "
            f"version {GROUPS_FORMAT_VERSION}: resume with the dflash version that started the run"
        )
    return dict(zip(table.column("sample_id").to_pylist(), table.column("root").to_pylist(), strict=True))
