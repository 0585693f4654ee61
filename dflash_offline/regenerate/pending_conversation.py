"""Which turns the target answers, and the conversation it builds from its own answers.

The original assistant turns are dropped. The system and user turns are cut into groups
(``data/user_groups.py``); the target answers after each group, and the prompt of answer k holds
groups 0..k and the target's own answers 0..k−1 (so later turns build on what the target said, not on
what another model said).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflash_offline.data.conversations import Conversation
from dflash_offline.data.schemas import TOKEN_IDS_FIELD
from dflash_offline.data.user_groups import user_groups
from dflash_offline.regenerate.prompt_ids import PromptIds

__all__ = ["Answer", "FinishReason", "PendingConversation"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Answer:
    """One regenerated assistant turn."""

    text: str
    """The decoded answer, stop token excluded."""
    finish_reason: FinishReason
    """``stop``: the target ended its turn; ``length``: cut at --max-new-tokens."""
    num_tokens: int
    """Generated tokens, the stop token excluded."""
    token_ids: tuple[int, ...] | None = None
    """The ids the target generated (stop token excluded), written beside the text so that ``dflash
    generate`` caches them rather than its own split of the text; None when the engine had text only."""

    def to_dict(self) -> dict[str, Any]:
        """The answer as a JSON object (the partial file, ``partial_out.py``); ``from_dict`` reads it back."""
        d: dict[str, Any] = {
            "content": self.text,
            "finish_reason": self.finish_reason,
            "num_tokens": self.num_tokens,
        }
        if self.token_ids is not None:
            d[TOKEN_IDS_FIELD] = list(self.token_ids)
        return d

    @staticmethod
    def from_dict(d: Any) -> Answer:
        """``to_dict``'s object as an ``Answer``; ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"an answer is a JSON object, got {type(d).__name__}")
        text, reason, num_tokens, ids = d.get("content"), d.get("finish_reason"), d.get("num_tokens"), None
        if not isinstance(text, str):
            raise ValueError("an answer has no string 'content'")
        if reason not in ("stop", "length"):
            raise ValueError(f"an answer's finish_reason {reason!r} is neither 'stop' nor 'length'")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"an answer's num_tokens {num_tokens!r} is no count")
        if TOKEN_IDS_FIELD in d:
            raw = d[TOKEN_IDS_FIELD]
            if not isinstance(raw, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in raw):
                raise ValueError(f"an answer's {TOKEN_IDS_FIELD!r} is not a list of token ids")
            ids = tuple(raw)
        return Answer(text=text, finish_reason=reason, num_tokens=num_tokens, token_ids=ids)


class PendingConversation:
    """A conversation being regenerated, one answer per generation round (owned by one thread)."""

    def __init__(self, conv: Conversation) -> None:
        self.conv = conv
        self.groups = user_groups(conv.messages)
        self.answers: list[Answer] = []
        self.dropped_turns = 0
        """Answers not generated because their prompt grew past the limit (the conversation ends early)."""
        self.prompt: PromptIds | None = None
        """The prompt of the turn last submitted, which the next turn's prompt continues
        (``PromptEncoder.encode``)."""

    @property
    def done(self) -> bool:
        return len(self.answers) + self.dropped_turns >= len(self.groups)

    def next_prompt(self) -> list[dict[str, str]]:
        """Chat messages (role/content) of the prompt of the next answer."""
        k = len(self.answers)
        assert k < len(self.groups), "the conversation is complete"
        return self.chat(upto=k + 1)

    def restore(self, answers: Sequence[Answer]) -> None:
        """Take the answers an earlier run gave to the first turns (kept at its stop): the next prompt is
        then turn ``len(answers)``'s, built from them as if they had just been generated."""
        assert not self.answers, "answers are restored before the first turn is submitted"
        assert len(answers) < len(self.groups), "a complete conversation is written, not restored"
        self.answers = list(answers)

    def add_answer(self, answer: Answer) -> None:
        assert not self.done
        self.answers.append(answer)

    def stop_early(self) -> None:
        """End the conversation with the answers so far (the next prompt is too long)."""
        self.dropped_turns = len(self.groups) - len(self.answers)

    def chat(self, *, upto: int | None = None) -> list[dict[str, str]]:
        """Groups 0..upto−1 with the answers between them (all answered groups when ``upto`` is None)."""
        upto = len(self.answers) if upto is None else upto
        chat: list[dict[str, str]] = []
        for k, group in enumerate(self.groups[:upto]):
            chat += [{"role": m.role, "content": m.content} for m in group]
            if k < len(self.answers):
                chat.append({"role": "assistant", "content": self.answers[k].text})
        return chat

    def messages(self) -> list[dict[str, Any]]:
        """The output line's messages: ``chat()`` with each answer's ``token_ids`` beside its text."""
        messages: list[dict[str, Any]] = []
        for k, group in enumerate(self.groups[: len(self.answers)]):
            messages += [{"role": m.role, "content": m.content} for m in group]
            answer = self.answers[k]
            message: dict[str, Any] = {"role": "assistant", "content": answer.text}
            if answer.token_ids is not None:
                message[TOKEN_IDS_FIELD] = list(answer.token_ids)
            messages.append(message)
        return messages
