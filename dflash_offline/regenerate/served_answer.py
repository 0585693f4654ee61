"""Parse one ``/v1/completions`` answer of an OpenAI-compatible server into a typed record, checking every
value regenerate keeps against the request before anything of it is written.

A server is another program: a bug, a proxy or another model behind the URL can return anything. So each
field is checked for its type, its range and its length against what was asked (``AnswerRequest``), and
the first one that is wrong becomes the conversation's failure row, naming the field (``AnswerFault``).
What passes is a ``ServedAnswer`` the engine trusts: its token ids are ids of the target's vocabulary, at
most ``max_tokens`` of them, with no stop token before their end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_offline.regenerate.pending_conversation import FinishReason

MAX_SHOWN = 200
"""Characters of a bad value quoted in a failure row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AnswerRequest:
    """What the answer is checked against: the request, and the target's vocabulary."""

    prompt_tokens: int
    """Tokens of the prompt sent (the server's ``usage.prompt_tokens`` must equal it)."""
    max_tokens: int
    """The request's ``max_tokens`` (the stop token counts among them, as vLLM counts it)."""
    vocab_size: int
    """Rows of the target's embedding: a token id is in ``[0, vocab_size)``."""
    stop_ids: frozenset[int]
    """End-of-turn ids: one may end the answer, none may stand inside it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedAnswer:
    """A checked answer."""

    text: str
    """``choices[0].text``."""
    finish_reason: FinishReason
    token_ids: tuple[int, ...] | None
    """``choices[0].token_ids`` less a final stop token; None when the server returned text only."""
    completion_tokens: int | None
    """``usage.completion_tokens`` (None when the server leaves it out)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AnswerFault:
    """Why an answer is refused: a failure row's ``reason`` and ``detail`` (which names the field)."""

    reason: str
    detail: str


def parse_served_answer(answer: Any, request: AnswerRequest) -> ServedAnswer | AnswerFault:
    """The checked answer, or the first fault found in it."""
    if not isinstance(answer, dict):
        return _bad(f"the answer is {_show(answer)}, not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return _bad(f"choices is {_show(choices)}, not a list of objects")
    choice = choices[0]
    text, finish = choice.get("text"), choice.get("finish_reason")
    if not isinstance(text, str):
        return _bad(f"choices[0].text is {_show(text)}, not a string")
    if finish not in ("stop", "length"):
        return AnswerFault(reason="unfinished", detail=f"choices[0].finish_reason {finish!r}")
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return _bad(f"usage is {_show(usage)}, not an object")
    seen = usage.get("prompt_tokens")
    if not _is_int(seen):
        return _bad(f"usage.prompt_tokens is {_show(seen)}, not an integer")
    if seen != request.prompt_tokens:
        return AnswerFault(
            reason="prompt_mismatch",
            detail=f"the server read the prompt as {seen} tokens, ours has {request.prompt_tokens}",
        )
    counted = usage.get("completion_tokens")
    if counted is not None and not (_is_int(counted) and 0 <= counted <= request.max_tokens):
        return _bad(
            f"usage.completion_tokens is {_show(counted)}, not an integer from 0 to the request's "
            f"max_tokens {request.max_tokens}"
        )
    ids = choice.get("token_ids")
    if ids is None:
        return ServedAnswer(text=text, finish_reason=finish, token_ids=None, completion_tokens=counted)
    checked = _check_ids(ids, request, finish)
    if isinstance(checked, AnswerFault):
        return checked
    return ServedAnswer(text=text, finish_reason=finish, token_ids=checked, completion_tokens=counted)


def _check_ids(ids: Any, request: AnswerRequest, finish: str) -> tuple[int, ...] | AnswerFault:
    """``choices[0].token_ids`` less a final stop token, or why they cannot be the target's answer."""
    if not isinstance(ids, list):
        return _bad(f"choices[0].token_ids is {_show(ids)}, not a list")
    for i, t in enumerate(ids):
        if not _is_int(t):
            return _bad(f"choices[0].token_ids[{i}] is {_show(t)}, not an integer")
        if not 0 <= t < request.vocab_size:
            last = request.vocab_size - 1
            return _bad(f"choices[0].token_ids[{i}] is {t}, not a token id of the target (0 to {last})")
    if len(ids) > request.max_tokens:
        most = request.max_tokens
        return _bad(f"choices[0].token_ids has {len(ids)} ids, more than the request's max_tokens {most}")
    kept = tuple(ids[:-1]) if finish == "stop" and ids and ids[-1] in request.stop_ids else tuple(ids)
    inside = next((i for i, t in enumerate(kept) if t in request.stop_ids), None)
    if inside is not None:
        return _bad(
            f"choices[0].token_ids[{inside}] is the stop token {kept[inside]} before the answer's end (the "
            "server did not stop at stop_token_ids)"
        )
    return kept


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no token count


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _bad(detail: str) -> AnswerFault:
    return AnswerFault(reason="bad_response", detail=detail)
