"""Typed records of the data layer: parsed conversations, per-record failures, tokenized samples.

Shape legend: T = tokens of one sample (after templating and truncation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from dflash_offline.cache.rows import FAILURE_REASONS

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One turn of a conversation, already mapped onto the chat-template roles."""

    role: Role
    """``system``, ``user`` or ``assistant`` (ShareGPT's human/gpt are mapped onto user/assistant)."""
    content: str
    """The turn's text, verbatim from the data set."""
    token_ids: tuple[int, ...] | None = None
    """The target's own token ids for ``content`` (the message's optional ``token_ids`` field, which
    ``dflash regenerate`` writes beside each answer), or None. ``tokenize_conversation`` uses them for an
    assistant turn when they decode to ``content``; they are not part of the sample id."""

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role
        assert isinstance(self.content, str), type(self.content)


@dataclass(frozen=True, kw_only=True, slots=True)
class Conversation:
    """One valid record of a data set."""

    sample_id: str
    """Stable id: hash of the source name, the record id and the canonical content (``make_sample_id``)."""
    source_index: int
    """0-based position of the record in its file (array element or non-blank JSONL line)."""
    record_id: str
    """The record's own ``id`` field as a string, or ``""`` when it has none."""
    messages: tuple[Message, ...]
    """The turns in order; never empty."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFailure:
    """A record that yields no sample, with the reason; it becomes a row of the cache's failures table."""

    sample_id: str
    """The stable id when the record could be parsed, else ``"<source>#<source_index>"``."""
    source_index: int
    """0-based position of the record in its file."""
    reason: str
    """One of ``dflash_offline.cache.rows.FAILURE_REASONS``."""
    detail: str
    """Human-readable detail naming the line / element and what is wrong."""

    def __post_init__(self) -> None:
        assert self.reason in FAILURE_REASONS, self.reason


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizedSample:
    """A conversation rendered by the chat template and tokenized, with its training mask."""

    sample_id: str
    source_index: int
    input_ids_T: np.ndarray
    """int32 [T]: token ids of the rendered conversation (no padding, no extra special tokens)."""
    loss_mask_T: np.ndarray
    """uint8 [T]: 1 exactly on tokens the assistant generates (content and its end-of-turn token)."""
    truncated: bool
    """True when the rendered conversation was longer than ``max_length`` and was cut to it."""
    conversation_root: str | None = None
    """The conversation the record belongs to (``data/sources.py:conversation_root``); the cache stores
    it in the sample's row. None where the sample was built without its record."""

    def __post_init__(self) -> None:
        assert self.input_ids_T.dtype == np.int32
        assert self.input_ids_T.ndim == 1
        assert self.loss_mask_T.dtype == np.uint8
        assert self.loss_mask_T.shape == self.input_ids_T.shape

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask_T))
