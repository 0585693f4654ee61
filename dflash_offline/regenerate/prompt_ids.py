"""Regenerate's prompts as token ids: each turn's chat rendered with the chat template and tokenized, where a
turn that continues its conversation's previous turn tokenizes only the text after that prompt's last
special token and takes the ids before it from the previous prompt.

Turn k's prompt is turn k − 1's, its answer and the next user turns, so tokenizing every prompt whole
tokenizes a conversation's first turns again at each turn: on real ShareGPT conversations that was the
driver's largest host cost between the engine's steps (bench/RESULTS.md, "Regenerate's driver").

Why the shortcut gives the whole text's ids exactly. A fast tokenizer first cuts the raw text at the added
tokens it finds there and then tokenizes each piece between them on its own; so the ids of a text are the
ids of its part up to the end of an added token followed by the ids of the rest, provided the match of that
token ends there in the whole text too. That holds when the token matches as its own text (not normalized,
no ``lstrip``/``rstrip``/``single_word``: ``cut_token_ids``), lies inside no other added token (no longer
match can cross the cut), and the new text starts with the previous prompt's text up to it (checked each
turn: a template that re-renders earlier turns differently, as Qwen3's drops their reasoning, gets the whole
text). A tokenizer whose pieces depend on their place in the text (Metaspace's ``prepend_scheme="first"``
marks the first piece alone) breaks the premise: a probe conversation tokenized both ways at construction
catches it, and then every prompt is tokenized whole, as is every prompt of a slow tokenizer and every text
long enough to be tokenized by its head (``render_prompt``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_offline.data.template import encode_head, head_chars

__all__ = ["PromptEncoder", "PromptIds", "cut_token_ids", "render_prompt"]

Chat = list[dict[str, str]]

PROBE_TURNS = (
    ("Hé, 你好 🙂 — a first question?", "\n\nLeading newlines, then   spaces\tand a tab  "),
    ("  second turn with leading spaces", " an answer with a literal <|im_end|> inside\n"),
    ("third\r\nturn", ""),
)
"""(user, answer) turns whose prompts are tokenized both ways at construction: unicode, whitespace at the
edges of an answer (where the cut meets it), a literal special token's text and an empty answer."""


def render(tokenizer: Any, chat: Chat) -> str:
    """The chat rendered with the generation prompt (the assistant's turn opened)."""
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str), type(text)
    return text


def encode_text(tokenizer: Any, text: str, *, max_tokens: int | None = None) -> list[int]:
    """A rendered prompt's token ids; with ``max_tokens``, a longer prompt's first ``max_tokens`` + 1 or more
    (enough to refuse it, without tokenizing megabytes: ``data.template.encode_head``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and (max_tokens is None or len(text) <= head_chars(max_tokens)):
        # A text ``encode_head`` would tokenize whole: the fast tokenizer's own encoder, which
        # ``tokenizer(text)`` calls too, without the offsets and the BatchEncoding around it (0.60× the
        # time a prompt, bench/RESULTS.md).
        return list(backend.encode(text, add_special_tokens=False).ids)
    if max_tokens is not None:
        return [int(i) for i in encode_head(tokenizer, text, max_tokens).ids_T]
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def render_prompt(tokenizer: Any, chat: Chat, *, max_tokens: int | None = None) -> list[int]:
    """The prompt's token ids, rendered and tokenized whole (``encode_text``)."""
    return encode_text(tokenizer, render(tokenizer, chat), max_tokens=max_tokens)


def cut_token_ids(tokenizer: Any) -> dict[int, str]:
    """The added tokens a prompt's ids may be cut after (module docstring), by id, with their text: special,
    matched on the raw text as themselves, and inside no other added token."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    contents = [t.content for t in added.values()]
    return {
        token_id: t.content
        for token_id, t in added.items()
        if t.special
        and t.content
        and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
        and sum(t.content in other for other in contents) == 1
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptIds:
    """One turn's prompt as token ids, and the part of it the conversation's next turn can continue."""

    ids: tuple[int, ...]
    """The prompt's token ids (a prompt longer than the head ``render_prompt`` tokenizes: its first
    ``max_tokens`` + 1 or more)."""
    head_text: str
    """The rendered prompt up to the end of its last cut token (``cut_token_ids``); "" when nothing of it can
    be continued."""
    head_tokens: int
    """The ids of ``head_text``: the first ``head_tokens`` of ``ids``."""


class PromptEncoder:
    """Renders and tokenizes turns' prompts, continuing the previous turn's ids where that is exact."""

    def __init__(self, tokenizer: Any, *, max_tokens: int, continue_turns: bool = True) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        """Prompts longer than this are refused by the driver: a longer text is tokenized by its head."""
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._cut_tokens: dict[int, str] = {}
        if continue_turns and self._backend is not None:
            self._cut_tokens = cut_token_ids(tokenizer)
            if self._cut_tokens and not self._probe_agrees():
                self._cut_tokens = {}

    @property
    def continues_turns(self) -> bool:
        """Whether a turn's prompt may continue the previous turn's ids (else every prompt is whole)."""
        return bool(self._cut_tokens)

    def encode(self, chat: Chat, *, previous: PromptIds | None = None) -> PromptIds:
        """``chat``'s prompt (``render_prompt``'s ids, exactly); ``previous``: the conversation's previous
        prompt, whose ids up to its ``head_text`` are reused when the new text starts with it."""
        text = render(self.tokenizer, chat)
        if not self._cut_tokens or len(text) > head_chars(self.max_tokens):
            return PromptIds(ids=tuple(encode_text(self.tokenizer, text, max_tokens=self.max_tokens)),
                             head_text="", head_tokens=0)  # fmt: skip
        return self._continue(text, previous)

    def _continue(self, text: str, previous: PromptIds | None) -> PromptIds:
        """``text``'s ids, those of ``previous.head_text`` taken from ``previous`` when ``text`` starts with
        it, and where its next turn may continue it."""
        assert self._backend is not None
        start, kept = 0, tuple[int, ...]()
        if previous is not None and previous.head_tokens and text.startswith(previous.head_text):
            start, kept = len(previous.head_text), previous.ids[: previous.head_tokens]
        encoding = self._backend.encode(text[start:], add_special_tokens=False)
        tail = encoding.ids
        head_end, head_tokens = start, len(kept)
        for i in range(len(tail) - 1, -1, -1):  # the last cut token: the generation prompt's, near the end
            content = self._cut_tokens.get(tail[i])
            if content is None:
                continue
            end = start + encoding.offsets[i][1]
            if text.startswith(content, end - len(content)):  # the offsets point at the token's own text
                head_end, head_tokens = end, len(kept) + i + 1
            break
        return PromptIds(ids=kept + tuple(tail), head_text=text[:head_end], head_tokens=head_tokens)

    def _probe_agrees(self) -> bool:
        """Whether continued prompts equal whole ones on ``PROBE_TURNS``, at least one of them continued
        (False too when the template refuses the probe)."""
        chat: Chat = []
        previous, continued = None, False
        try:
            for user, answer in PROBE_TURNS:
                chat.append({"role": "user", "content": user})
                text = render(self.tokenizer, chat)
                prompt = self._continue(text, previous)
                if list(prompt.ids) != encode_text(self.tokenizer, text):
                    return False
                if previous is not None and previous.head_tokens and text.startswith(previous.head_text):
                    continued = True
                chat.append({"role": "assistant", "content": answer})
                previous = prompt
        except Exception:  # a chat template may raise anything on the probe (jinja's raise_exception, ...)
            return False
        return continued
