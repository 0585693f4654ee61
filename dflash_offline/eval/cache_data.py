"""What a training cache's data files say about its samples.

The cache stores sample ids, not records; the records are in the data files its ``dflash generate`` runs
read (named in its runs table, data/generate_inputs.py). Read again with the cache's source name, each record
gives the sample id the cache stored, its own id and conversation root (ShareGPT's ``X_11`` belongs to
``X``), and, for ``dflash regenerate`` output, the original record it was answered from
(``source_sample_id``). ``dflash eval`` keeps its prompts held out with them (prompts.py) and draws the
``validation`` set from them (validation_set.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.data.conversations import Conversation
from dflash_offline.data.schemas import DataFormat


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheRecord:
    """One record of a cache's data files."""

    conversation: Conversation
    """The record as generate parsed it (its ``sample_id`` is the one the cache stored)."""
    root: str
    """Its conversation root (``data/sources.py:conversation_root``)."""
    origin: str | None
    """``source_sample_id`` of a ``dflash regenerate`` output line: the sample id of the original record
    (in the file regenerate read); None for any other record."""


def readable_inputs(cache_dir: Path) -> tuple[list[tuple[Path, DataFormat]], list[str]]:
    """The data files (with their ``--data-format``) of the cache's generate runs that are on disk, each
    once, and the names of those that are not."""
    from dflash_offline.data.generate_inputs import generate_inputs
    from dflash_offline.data.sources import resolve_data_path
    from dflash_offline.errors import DataError

    found: list[tuple[Path, DataFormat]] = []
    missing: list[str] = []
    try:
        inputs = generate_inputs(cache_dir)
    except Exception:  # an unreadable runs table only loses what the files would tell
        return [], []
    for item in inputs:
        try:
            path = resolve_data_path(item.data)
        except DataError:
            missing.append(item.data or "the embedded ShareGPT file")
            continue
        if all(path != p for p, _ in found):
            found.append((path, item.data_format))
    return found, missing


def iter_cache_records(cache_dir: Path, *, source: str) -> Iterator[CacheRecord]:
    """Every parseable record of the cache's data files on disk, in file order; ``source``: the cache's
    data source name (its fingerprint's), so that the sample ids are the cache's."""
    from dflash_offline.data.containers import iter_container, open_container
    from dflash_offline.data.sources import conversation_root, parse_record

    paths, _ = readable_inputs(cache_dir)
    for path, data_format in paths:
        for raw in iter_container(open_container(path)):
            item = parse_record(raw, source=source, data_format=data_format)
            if not isinstance(item, Conversation):
                continue
            origin = raw.value.get("source_sample_id") if isinstance(raw.value, dict) else None
            yield CacheRecord(
                conversation=item,
                root=conversation_root(item.record_id, item.sample_id),
                origin=origin if isinstance(origin, str) else None,
            )
