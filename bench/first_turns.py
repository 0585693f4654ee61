"""The first user turns of a chat data set, rendered as prompts: what bench/answer_roundtrip.py,
bench/regenerate.py and bench/decode.py answer.

A prompt is a record's first user group (``data/user_groups.py``, what ``dflash regenerate`` answers first)
rendered with the chat template and the generation prompt (``regenerate/driver.py:render_prompt``).
Records that are not conversations, have no user turn, are refused by the template or render longer
than ``max_prompt_tokens`` are skipped: they are not part of a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_offline.data.conversations import Conversation, Message
from dflash_offline.data.sources import iter_records
from dflash_offline.data.user_groups import user_groups
from dflash_offline.regenerate.driver import render_prompt


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstTurn:
    """One record's first user turn, rendered."""

    conversation: Conversation
    messages: tuple[Message, ...]
    """The first user group (system messages before it included)."""
    prompt_ids: list[int]
    """Its token ids: the chat template with the generation prompt."""


def first_turns(
    tokenizer: Any,
    data: str | None,
    *,
    max_prompt_tokens: int,
    limit: int | None = None,
    records: int | None = None,
) -> list[FirstTurn]:
    """The first turns of ``data`` (None: the embedded ShareGPT file) in record order: at most ``limit``
    of them, from at most the first ``records`` records."""
    turns: list[FirstTurn] = []
    for item in iter_records(data, limit=records):
        if limit is not None and len(turns) >= limit:
            break
        if not isinstance(item, Conversation):
            continue
        groups = user_groups(item.messages)
        if not groups:
            continue
        try:
            ids = render_prompt(tokenizer, [{"role": m.role, "content": m.content} for m in groups[0]])
        except Exception:  # a chat template may raise anything (jinja's raise_exception, ...)
            continue
        if len(ids) <= max_prompt_tokens:
            turns.append(FirstTurn(conversation=item, messages=groups[0], prompt_ids=ids))
    return turns
