"""Render conversations with the target's chat template and mark the tokens the assistant generates.

The loss mask is 1 on every token the model itself produces in an assistant turn: the turn's content
*and* its end-of-turn token (``<|im_end|>`` for ChatML templates such as SmolLM2's), because the
drafter must learn to predict where a turn ends. It is 0 on the turn header (``<|im_start|>assistant\\n``),
on the whitespace a template writes after the end-of-turn token (the model never generates it: decoding
stops at the end token), on system and user turns, and on empty assistant turns.

Spans are found on characters, then mapped to tokens with the tokenizer's offset mapping, so a token
that merges header and content characters (``"\\n\\n"`` when the content starts with a newline) is
handled: a token is trained when it overlaps a span by at least one character.

How the character spans are found, for any template that renders messages in order:
  1. by prefix (exact): turn k starts where ``render(messages[:k], add_generation_prompt=True)`` ends and
     ends where ``render(messages[:k+1])`` ends, trailing whitespace excluded. Used when every such
     render is a prefix of the full render.
  2. by search, when a template renders a turn differently once later turns follow (Qwen3 drops
     reasoning from earlier turns; SmolLM2 adds its default system prompt only on a non-empty list):
     each message's content is found in order in the full render, and the assistant span extends over
     the template's end-of-turn marker (learned by rendering a probe conversation).
Neither works -> ``template_error`` with the turn named.

An assistant message whose ``token_ids`` (the target's own, written by ``dflash regenerate``) decode to its
content is cached as those ids: a greedy answer need not be the tokenizer's split of its text (SmolLM2
generates ``"\n\n"`` as one token where its text re-encodes as two before a word), and the drafter must
learn the tokens the target produces. The rest of the render is tokenized in pieces cut at those contents
(``_with_answer_ids``), so the tokens before an answer are its prompt as the target read it.

Shape legend: T = tokens of the rendered conversation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dflash_offline.config_fields import field_ref
from dflash_offline.data.conversations import Conversation, Message, SourceFailure, TokenizedSample
from dflash_offline.data.sources import conversation_root
from dflash_offline.errors import DataError

TooLong = Literal["truncate", "skip"]
# How messages name the options (GenerateConfig sits above this module: they name the class).
MAX_LENGTH = field_ref("GenerateConfig", "max_length")
TOO_LONG = field_ref("GenerateConfig", "too_long")
_PROBE_SENTINEL = "\u2063dflash-probe-7f3a\u2063"

Chat = list[dict[str, str]]
Render = Callable[[Chat, bool], str]


def _sha16(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def chat_template_hash(tokenizer: Any) -> str:
    """16 hex characters of sha256 over the chat template text (all named templates when a dict)."""
    template = tokenizer.chat_template
    if template is None:
        raise DataError("the tokenizer has no chat template; use a target whose tokenizer defines one")
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return _sha16(text)


def tokenizer_hash(tokenizer: Any) -> str:
    """16 hex characters of sha256 over the canonical tokenizer definition.

    For fast tokenizers this is the backend's JSON (vocab, merges, added tokens, normalizer,
    pre-tokenizer, post-processor, decoder) with keys sorted and the runtime padding/truncation
    settings removed, plus the special-token map: stable across processes, machines and a
    save_pretrained round trip."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state: dict[str, Any] = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:
        state = {"vocab": sorted(tokenizer.get_vocab().items())}
    state["special_tokens_map"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return _sha16(json.dumps(state, sort_keys=True, ensure_ascii=False))


def _renderer(tokenizer: Any) -> Render:
    def render(messages: Chat, add_generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(text, str), type(text)
        return text

    return render


HEAD_CHARS_PER_TOKEN = 8
"""First guess of characters per token when only the head of a long text is tokenized (doubled until
the prefix holds enough tokens)."""
HEAD_MARGIN_TOKENS = 16
"""Tokens beyond the limit that a prefix must hold: its last tokens may differ from the whole text's
(the cut can fall inside a word), the ones before do not."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EncodedHead:
    """The first tokens of a text (``encode_head``)."""

    ids_T: np.ndarray
    """int32 [T]: token ids."""
    offsets_T2: np.ndarray
    """int64 [T, 2]: each token's character range [start, end) in the text."""
    complete: bool
    """The whole text was tokenized (T is its token count); else it has more tokens than T."""


def _encode(tokenizer: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids_T = np.asarray(encoded["input_ids"], dtype=np.int32)
    return ids_T, np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)


def head_chars(max_tokens: int) -> int:
    """The longest text ``encode_head`` tokenizes whole at once (a longer one is tokenized by prefixes)."""
    return (max_tokens + HEAD_MARGIN_TOKENS) * HEAD_CHARS_PER_TOKEN


def encode_head(tokenizer: Any, text: str, max_tokens: int) -> EncodedHead:
    """The tokens of ``text``, at least the first ``max_tokens`` + 1 of them when it has more.

    A huge record (megabytes of text) tokenized whole holds gigabytes of encodings and offsets for
    tokens that truncation drops at once; so a text longer than the limit can need is tokenized by
    prefixes of doubling length until one holds ``max_tokens`` + ``HEAD_MARGIN_TOKENS`` tokens. A prefix
    tokenizes like the whole text except for its last few tokens (the cut may fall inside a word): its
    first tokens are kept once the prefix twice as long agrees on them, else the text is tokenized
    whole."""
    need = max_tokens + HEAD_MARGIN_TOKENS
    chars = head_chars(max_tokens)
    while chars < len(text):
        ids_T, offsets_T2 = _encode(tokenizer, text[:chars])
        if ids_T.shape[0] > need:
            longer_ids_T, longer_offsets_T2 = _encode(tokenizer, text[: 2 * chars])
            if np.array_equal(ids_T[:need], longer_ids_T[:need]) and np.array_equal(
                offsets_T2[:need], longer_offsets_T2[:need]
            ):
                return EncodedHead(ids_T=ids_T[:need], offsets_T2=offsets_T2[:need], complete=False)
            break
        chars *= 2
    ids_T, offsets_T2 = _encode(tokenizer, text)
    return EncodedHead(ids_T=ids_T, offsets_T2=offsets_T2, complete=True)


def tokenize_conversation(
    tokenizer: Any, conv: Conversation, *, max_length: int, too_long: TooLong
) -> TokenizedSample | SourceFailure:
    """Render ``conv`` with the tokenizer's chat template, tokenize it and build the loss mask.

    Longer than ``max_length`` tokens: ``truncate`` keeps the first ``max_length`` tokens,
    ``skip`` returns a ``too_long`` failure. No trained token (left) -> ``empty_response``."""
    if max_length < 1:
        raise DataError(f"{MAX_LENGTH} must be >= 1, got {max_length}")
    if too_long not in ("truncate", "skip"):
        raise DataError(f"{TOO_LONG} must be 'truncate' or 'skip', got {too_long!r}")
    if tokenizer.chat_template is None:
        raise DataError("the tokenizer has no chat template; use a target whose tokenizer defines one")

    def fail(reason: str, detail: str) -> SourceFailure:
        return SourceFailure(
            sample_id=conv.sample_id, source_index=conv.source_index, reason=reason, detail=detail
        )

    if not conv.messages:
        return fail("empty_conversation", "the conversation has no messages")
    chat: Chat = [{"role": m.role, "content": m.content} for m in conv.messages]
    render = _renderer(tokenizer)
    try:
        text = render(chat, False)
    except Exception as e:  # a user-supplied template may raise anything (jinja's raise_exception, ...)
        return fail("template_error", f"rendering the conversation: {type(e).__name__}: {e}")

    if any(m.role == "assistant" and m.token_ids is not None for m in conv.messages):
        head = _with_answer_ids(tokenizer, render, chat, conv, text, max_length)
    else:
        head = encode_head(tokenizer, text, max_length)
    ids_T, offsets_T2 = head.ids_T, head.offsets_T2
    num_tokens = int(ids_T.shape[0])
    truncated = num_tokens > max_length
    if truncated:
        if too_long == "skip":
            count = f"{num_tokens}" if head.complete else f"over {num_tokens}"
            return fail(
                "too_long",
                f"{count} tokens after templating > {MAX_LENGTH} {max_length}",
            )
        ids_T = ids_T[:max_length]
        offsets_T2 = offsets_T2[:max_length]
    char_limit = int(offsets_T2[-1, 1]) if num_tokens else 0

    try:
        spans = assistant_char_spans(render, chat, text, char_limit=char_limit)
    except _SpanError as e:
        return fail("template_error", str(e))
    loss_mask_T = spans_to_token_mask(spans, offsets_T2)
    if not loss_mask_T.any():
        where = f" within the first {max_length} tokens" if truncated else ""
        return fail("empty_response", f"no assistant token to train on{where}")
    return TokenizedSample(
        sample_id=conv.sample_id,
        source_index=conv.source_index,
        input_ids_T=np.ascontiguousarray(ids_T),
        loss_mask_T=loss_mask_T,
        truncated=truncated,
        conversation_root=conversation_root(conv.record_id, conv.sample_id),
    )


def _with_answer_ids(
    tokenizer: Any,
    render: Render,
    chat: Chat,
    conv: Conversation,
    text: str,
    max_length: int,
) -> EncodedHead:
    """The rendered conversation with each assistant content whose ``token_ids`` decode to it spliced in
    as those ids: the target's own tokens, where the tokenizer may split the same text otherwise.

    The text around them is tokenized piece by piece, cut where each such content starts and ends: the
    piece before an answer ends with the generation prompt, tokenized alone as the target's prompt was,
    and the end-of-turn token that follows the content is a special token either way. Each spliced id
    gets the character range of its whole content (the loss mask marks it as inside the turn). Pieces
    are tokenized by their heads as ``encode_head`` does, up to ``max_length`` tokens in all. The text
    tokenized whole (``encode_head``) when no ids apply, or when the tokens do not decode to the text (a
    tokenizer that adds a prefix to every piece)."""

    def whole() -> EncodedHead:
        return encode_head(tokenizer, text, max_length)

    try:
        spans = assistant_char_spans(render, chat, text)
    except _SpanError:
        return whole()  # the caller reports the template error
    answered = [m for m in conv.messages if m.role == "assistant" and m.content.strip()]
    if len(spans) != len(answered):
        return whole()
    splices = _answer_splices(tokenizer, text, answered, spans)
    if not splices:
        return whole()
    spliced = _encode_around(tokenizer, text, splices, max_length)
    covered = int(spliced.offsets_T2[-1, 1]) if spliced.ids_T.shape[0] else 0
    if tokenizer.decode(spliced.ids_T.tolist(), skip_special_tokens=False) != text[:covered]:
        return whole()
    return spliced


@dataclass(frozen=True, kw_only=True, slots=True)
class _Splice:
    """An assistant content that is cached as the target's own ids."""

    start: int
    end: int
    """Its characters [start, end) in the rendered conversation."""
    ids: list[int]
    """Its ``token_ids``."""


def _answer_splices(
    tokenizer: Any, text: str, answered: list[Message], spans: list[tuple[int, int]]
) -> list[_Splice]:
    """The answers (non-blank assistant messages, with their spans in ``text``) whose ``token_ids``
    decode to their content, found where the render holds that content verbatim."""
    splices: list[_Splice] = []
    for message, (start, _end) in zip(answered, spans, strict=True):
        if message.token_ids is None or not text.startswith(message.content, start):
            continue
        try:
            decoded = tokenizer.decode(list(message.token_ids), skip_special_tokens=False)
        except Exception:  # ids outside this tokenizer's vocabulary: not this target's tokens
            continue
        if decoded == message.content:
            splices.append(
                _Splice(start=start, end=start + len(message.content), ids=list(message.token_ids))
            )
    return splices


def _encode_around(tokenizer: Any, text: str, splices: list[_Splice], max_length: int) -> EncodedHead:
    """The splices' ids with the text before, between and after them tokenized piece by piece, until
    ``max_length`` tokens are passed."""
    ids: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    cursor = count = 0
    complete = True
    for splice in (*splices, _Splice(start=len(text), end=len(text), ids=[])):
        if count > max_length:  # enough tokens: the rest is cut off anyway
            complete = False
            break
        piece = encode_head(tokenizer, text[cursor : splice.start], max_length - count)
        ids.append(piece.ids_T)
        offsets.append(piece.offsets_T2 + cursor)
        count += piece.ids_T.shape[0]
        if not piece.complete:
            complete = False
            break
        count += len(splice.ids)
        ids.append(np.asarray(splice.ids, dtype=np.int32))
        offsets.append(
            np.tile(np.asarray([[splice.start, splice.end]], dtype=np.int64), (len(splice.ids), 1))
        )
        cursor = splice.end
    return EncodedHead(ids_T=np.concatenate(ids), offsets_T2=np.concatenate(offsets), complete=complete)


def spans_to_token_mask(spans: list[tuple[int, int]], offsets_T2: np.ndarray) -> np.ndarray:
    """uint8 [T]: 1 on each token whose character range [start, end) overlaps a span [a, b)."""
    starts_T, ends_T = offsets_T2[:, 0], offsets_T2[:, 1]
    mask_T = np.zeros(offsets_T2.shape[0], dtype=bool)
    for a, b in spans:
        # A zero-width token strictly inside a span counts as inside it.
        mask_T |= (ends_T > a) & (starts_T < b)
    return mask_T.astype(np.uint8)


class _SpanError(Exception):
    """The assistant turns cannot be located in the rendered text (becomes ``template_error``)."""


def assistant_char_spans(
    render: Render, chat: Chat, text: str, *, char_limit: int | None = None
) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant-generated text in ``text`` = render(chat).

    Turns starting at or after ``char_limit`` (the end of the kept tokens) are not located."""
    limit = len(text) if char_limit is None else char_limit
    spans = _spans_by_prefix(render, chat, text, limit)
    if spans is None:
        spans = _spans_by_search(render, chat, text, limit)
    return spans


def _spans_by_prefix(render: Render, chat: Chat, text: str, limit: int) -> list[tuple[int, int]] | None:
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(chat):
        if message["role"] != "assistant" or not message["content"].strip():
            continue
        try:
            before = render(chat[:k], True)
            through = render(chat[: k + 1], False)
        except Exception:
            return None  # e.g. a template that refuses an empty or assistant-first prefix
        if not (through.startswith(before) and text.startswith(through)):
            return None
        start, end = len(before), len(through.rstrip())
        if start >= limit:
            break
        if end > start:
            spans.append((start, end))
    return spans


def _end_of_turn_marker(render: Render) -> str:
    """What the template writes right after an assistant message's content, whitespace stripped."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_SENTINEL}]
    try:
        rendered = render(probe, False)
    except Exception:
        return ""
    at = rendered.rfind(_PROBE_SENTINEL)
    if at < 0:
        return ""
    return rendered[at + len(_PROBE_SENTINEL) :].strip()


def _spans_by_search(render: Render, chat: Chat, text: str, limit: int) -> list[tuple[int, int]]:
    end_marker = _end_of_turn_marker(render)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, message in enumerate(chat):
        content = message["content"]
        if not content.strip():
            continue
        at = text.find(content, cursor)
        if at < 0:  # templates often strip the content
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            if message["role"] == "assistant":
                raise _SpanError(
                    f"message {k} (assistant) is not found verbatim in the rendered conversation and the "
                    "template does not render conversation prefixes as prefixes; cannot mark its tokens"
                )
            continue  # a system/user text the template rewrites: nothing to mark, keep the cursor
        end = at + len(content)
        if message["role"] == "assistant":
            if at >= limit:
                break
            if end_marker and text.startswith(end_marker, end):
                end += len(end_marker)
            spans.append((at, end))
        cursor = end
    return spans
