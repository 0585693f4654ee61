"""Column mapping: one raw record (a dict from JSON, Parquet or Arrow) -> a list of chat messages.

The schemas of the chat data sets drafters are trained on (``--data-format`` forces one; ``auto``
picks, per record, the first whose fields are present, in this order):
  ``sharegpt``:        ``conversations`` of ``{"from": human|gpt|system (or user|assistant), "value"}``
  ``messages``:        ``messages`` of ``{"role": system|user|assistant, "content"}``; a content may be a
                       list of ``{"type": "text", "text"}`` parts
  ``prompt-response``: ``prompt`` and ``response`` strings -> one user turn, one assistant turn
  ``alpaca``:          ``instruction`` (+ optional ``input``) and ``output`` (Alpaca, CodeAlpaca): the user
                       turn is the instruction, followed by a blank line and the input when it is not empty
A turn of ``sharegpt`` or ``messages`` may carry ``token_ids``, the ids the target produced for its text
(``dflash regenerate`` writes them): generate then caches an assistant turn as those ids instead of
re-tokenizing its text (``template.py``); a value that is not a list of non-negative integers is a
``malformed_record`` failure.
ShareGPT speakers outside its mapping (the V3 file has a few ``bing``/``chatgpt``/``bard`` turns) are an
``unknown_role`` failure, because we cannot tell whose words they are. Text that is not valid Unicode (a
lone surrogate: an escape such as ``"\\ud800"``, or invalid UTF-8 bytes in a JSON array) is a
``malformed_record`` failure naming the field: it cannot be hashed, tokenized or stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from dflash_offline.config_fields import DATA_FORMAT, field_ref
from dflash_offline.data.conversations import Message, Role
from dflash_offline.errors import DataError

TOKEN_IDS_FIELD = "token_ids"
"""Optional per-message field (``sharegpt`` and ``messages``): the target's own token ids for the
message's text, as ``dflash regenerate`` writes them beside each answer."""

DataFormat = Literal["auto", "sharegpt", "messages", "prompt-response", "alpaca"]
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)

_SHAREGPT_ROLES: dict[str, Role] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_CHAT_ROLES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant"}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "sharegpt": ("conversations",),
    "messages": ("messages",),
    "prompt-response": ("prompt", "response"),
    "alpaca": ("instruction", "output"),
}


def parse_data_format(value: str) -> DataFormat:
    if value not in DATA_FORMATS:
        raise DataError(f"{field_ref(DATA_FORMAT)} {value!r}: expected one of {', '.join(DATA_FORMATS)}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True, slots=True)
class MappedRecord:
    """A record's messages and id, or why it has none (``reason`` + ``detail``)."""

    messages: tuple[Message, ...] = ()
    record_id: str = ""
    """The record's own ``id`` as a string; ``""`` when it has none."""
    reason: str | None = None
    """A ``FAILURE_REASONS`` entry when the record yields no conversation."""
    detail: str = ""


def _fail(reason: str, detail: str) -> MappedRecord:
    return MappedRecord(reason=reason, detail=detail)


def map_record(record: Any, data_format: DataFormat) -> MappedRecord:
    """The messages of one decoded record under ``data_format``."""
    if not isinstance(record, dict):
        return _fail("malformed_record", f"expected a JSON object, got {type(record).__name__}")
    schema = _schema_of(record) if data_format == "auto" else data_format
    if schema is None:
        keys = sorted(str(k) for k in record)[:8]
        return _fail(
            "malformed_record",
            "has none of 'conversations', 'messages', 'prompt'+'response', 'instruction'+'output' "
            f"(keys: {keys})",
        )
    missing = [k for k in _REQUIRED[schema] if k not in record]
    if missing:
        return _fail(
            "malformed_record", f"{field_ref(DATA_FORMAT)} {schema}: the record has no {missing} field"
        )
    if schema == "sharegpt":
        mapped = _map_turns(record["conversations"], "conversations", "from", "value", _SHAREGPT_ROLES)
    elif schema == "messages":
        mapped = _map_turns(record["messages"], "messages", "role", "content", _CHAT_ROLES)
    elif schema == "prompt-response":
        mapped = _map_pair(record, user_fields=("prompt",), answer_field="response")
    else:
        mapped = _map_pair(record, user_fields=("instruction", "input"), answer_field="output")
    if isinstance(mapped, MappedRecord):
        return mapped
    return MappedRecord(messages=mapped, record_id=_record_id(record.get("id")))


def _schema_of(record: dict[str, Any]) -> str | None:
    # Spelled out (not a loop over _REQUIRED): this runs once per record of multi-GB data sets.
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "messages"
    if "prompt" in record and "response" in record:
        return "prompt-response"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return None


def _map_turns(
    turns: Any, field: str, role_key: str, content_key: str, roles: dict[str, Role]
) -> tuple[Message, ...] | MappedRecord:
    if not isinstance(turns, list):
        return _fail("malformed_record", f"'{field}' is a {type(turns).__name__}, expected a list")
    if not turns:
        return _fail("empty_conversation", f"'{field}' is empty")
    messages: list[Message] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return _fail("malformed_record", f"{field}[{k}] is a {type(turn).__name__}, expected an object")
        if turn.get(role_key) is None or turn.get(content_key) is None:
            return _fail("malformed_record", f"{field}[{k}] lacks '{role_key}' or '{content_key}'")
        speaker = turn[role_key]
        if not isinstance(speaker, str) or speaker not in roles:
            return _fail(
                "unknown_role", f"{field}[{k}].{role_key} is {speaker!r}, expected one of {sorted(roles)}"
            )
        content = _content_text(turn[content_key])
        if content is None:
            return _fail(
                "malformed_record", f"{field}[{k}].{content_key} is not a string (or a list of text parts)"
            )
        token_ids = turn.get(TOKEN_IDS_FIELD)
        if token_ids is not None and not _is_token_ids(token_ids):
            return _fail(
                "malformed_record", f"{field}[{k}].{TOKEN_IDS_FIELD} is not a list of non-negative integers"
            )
        messages.append(
            Message(
                role=roles[speaker],
                content=content,
                token_ids=None if token_ids is None else tuple(token_ids),
            )
        )
    return tuple(messages)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def _map_pair(
    record: dict[str, Any], *, user_fields: tuple[str, ...], answer_field: str
) -> tuple[Message, ...] | MappedRecord:
    parts: list[str] = []
    for name in (*user_fields, answer_field):
        value = record.get(name, "")  # only the optional ``input`` can be absent here
        if value is None:
            value = ""
        if not isinstance(value, str):
            return _fail("malformed_record", f"'{name}' is a {type(value).__name__}, expected a string")
        parts.append(value)
    *user_parts, answer = parts
    user = "\n\n".join(p for p in user_parts if p.strip())
    if not user.strip():
        return _fail("empty_conversation", f"'{user_fields[0]}' is empty")
    return (Message(role="user", content=user), Message(role="assistant", content=answer))


def invalid_text(mapped: MappedRecord) -> str | None:
    """None when every text of ``mapped`` is valid Unicode, else the failure detail naming the turn.

    Only called once hashing the record failed to encode: the common case pays one encode, not one
    per field."""
    fields = [("id", mapped.record_id)]
    fields += [(f"turn {k} ({m.role}) content", m.content) for k, m in enumerate(mapped.messages)]
    for field, text in fields:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"{field} is not valid text: a lone surrogate {text[e.start]!r} at character {e.start} "
                "(invalid UTF-8 bytes in the file, or an escape such as \\ud800)"
            )
    return None


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
