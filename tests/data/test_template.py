"""Chat templating and the loss mask, checked on known conversations with the real SmolLM2 tokenizer.

Expected values are hand-written strings: the rendered text, the exact text of every trained run of
tokens, and token counts from tokenizing each assistant content on its own (+1 for <|im_end|>)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_offline.data.conversations import Conversation, Message, SourceFailure, TokenizedSample
from dflash_offline.data.template import (
    chat_template_hash,
    spans_to_token_mask,
    tokenize_conversation,
    tokenizer_hash,
)
from dflash_offline.errors import DataError
from dflash_offline.target_model.loader import load_tokenizer

pytestmark = pytest.mark.smollm2

SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
REPO = Path(__file__).resolve().parents[2]


def conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation(
        sample_id="s",
        source_index=0,
        record_id="",
        messages=tuple(Message(role=r, content=c) for r, c in turns),  # type: ignore[arg-type]
    )


def tokenize(tok: Any, c: Conversation, max_length: int = 100_000, too_long: str = "truncate") -> Any:
    return tokenize_conversation(tok, c, max_length=max_length, too_long=too_long)  # type: ignore[arg-type]


def runs(tok: Any, sample: TokenizedSample, value: int = 1) -> list[str]:
    """Decoded text of each maximal run of tokens whose mask equals ``value``."""
    out, start = [], None
    mask = [*list(sample.loss_mask_T), 1 - value]
    for i, m in enumerate(mask):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append(tok.decode(sample.input_ids_T[start:i].tolist()))
            start = None
    return out


def n_tokens(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_single_turn(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    c = conv(("user", "Hi there"), ("assistant", "Hello! How can I help?"))
    s = tokenize(tok, c)
    assert isinstance(s, TokenizedSample)
    assert not s.truncated
    expected_text = (
        SMOL_SYSTEM
        + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    )
    assert tok.decode(s.input_ids_T.tolist()) == expected_text
    reference = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in c.messages])
    assert s.input_ids_T.tolist() == list(reference["input_ids"])
    assert runs(tok, s) == ["Hello! How can I help?<|im_end|>"]
    assert s.num_loss_tokens == n_tokens(tok, "Hello! How can I help?") + 1
    # Header untrained, the newline after <|im_end|> untrained.
    assert runs(tok, s, value=0)[-1] == "\n"
    assert runs(tok, s, value=0)[0].endswith("<|im_start|>assistant\n")
    assert s.input_ids_T.dtype == np.int32
    assert s.loss_mask_T.dtype == np.uint8


def test_multi_turn_with_system_prompt(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    c = conv(
        ("system", "Be brief."),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "And 3+3?"),
        ("assistant", "6, of course."),
    )
    s = tokenize(tok, c)
    assert isinstance(s, TokenizedSample)
    assert runs(tok, s) == ["4<|im_end|>", "6, of course.<|im_end|>"]
    assert runs(tok, s, value=0) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]
    assert s.num_loss_tokens == n_tokens(tok, "4") + 1 + n_tokens(tok, "6, of course.") + 1


def test_unicode_content(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    answer = "Grüße 🙂 日本語 — naïve e\u0301 𝔘"
    s = tokenize(tok, conv(("user", "Ünïcödé? 🤔"), ("assistant", answer)))
    assert isinstance(s, TokenizedSample)
    # Byte-level tokens split multi-byte characters; the trained run still decodes to the exact text.
    assert runs(tok, s) == [answer + "<|im_end|>"]
    assert s.num_loss_tokens == n_tokens(tok, answer) + 1


def test_content_starting_with_newlines_trains_the_merged_token(smol_tokenizer: Any) -> None:
    """ "\\n" (end of the header) + "\\n\\nSix" merge into one "\\n\\n" token: it holds content, so it is
    trained; the header tokens before it are not."""
    tok = smol_tokenizer
    s = tokenize(tok, conv(("user", "q"), ("assistant", "\n\nSix")))
    assert isinstance(s, TokenizedSample)
    assert runs(tok, s) == ["\n\n\nSix<|im_end|>"]
    assert runs(tok, s, value=0)[0].endswith("<|im_start|>assistant")


def test_truncation_keeps_a_prefix_and_skip_reports_too_long(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    c = conv(
        ("user", "Count."), ("assistant", "one two"), ("user", "More."), ("assistant", "three four five")
    )
    full = tokenize(tok, c)
    assert isinstance(full, TokenizedSample)
    second_run_start = int(np.flatnonzero(np.diff(full.loss_mask_T.astype(int)) == 1)[1]) + 1
    cut = second_run_start + 2
    short = tokenize(tok, c, max_length=cut)
    assert isinstance(short, TokenizedSample)
    assert short.truncated
    assert short.num_tokens == cut
    assert np.array_equal(short.input_ids_T, full.input_ids_T[:cut])
    assert np.array_equal(short.loss_mask_T, full.loss_mask_T[:cut])
    assert runs(tok, short) == [
        "one two<|im_end|>",
        tok.decode(full.input_ids_T[second_run_start:cut].tolist()),
    ]

    exact = tokenize(tok, c, max_length=full.num_tokens)
    assert isinstance(exact, TokenizedSample)
    assert not exact.truncated

    skipped = tokenize(tok, c, max_length=cut, too_long="skip")
    assert isinstance(skipped, SourceFailure)
    assert skipped.reason == "too_long"
    assert f"{full.num_tokens} tokens" in skipped.detail
    assert f"`GenerateConfig.max_length` {cut}" in skipped.detail

    first_trained = int(np.flatnonzero(full.loss_mask_T)[0])
    nothing_left = tokenize(tok, c, max_length=first_trained)
    assert isinstance(nothing_left, SourceFailure)
    assert nothing_left.reason == "empty_response"
    assert "within the first" in nothing_left.detail


def test_empty_turns_and_conversations(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    empty_answer = tokenize(tok, conv(("user", "q"), ("assistant", "  ")))
    assert isinstance(empty_answer, SourceFailure)
    assert empty_answer.reason == "empty_response"
    no_answer = tokenize(tok, conv(("system", "s"), ("user", "q")))
    assert isinstance(no_answer, SourceFailure)
    assert no_answer.reason == "empty_response"
    nothing = tokenize(tok, conv())
    assert isinstance(nothing, SourceFailure)
    assert nothing.reason == "empty_conversation"
    # An empty assistant turn among others is simply not trained (not even its <|im_end|>).
    mixed = tokenize(tok, conv(("user", "a"), ("assistant", ""), ("user", "b"), ("assistant", "ok")))
    assert isinstance(mixed, TokenizedSample)
    assert runs(tok, mixed) == ["ok<|im_end|>"]


def test_assistant_first_conversation_uses_the_search_path(smol_tokenizer: Any) -> None:
    """SmolLM2 adds its default system prompt only to a non-empty message list, so the prefix render
    of an assistant-first conversation is not a prefix of the whole: the search path takes over."""
    tok = smol_tokenizer
    s = tokenize(tok, conv(("assistant", "I start"), ("user", "ok"), ("assistant", "yes")))
    assert isinstance(s, TokenizedSample)
    assert runs(tok, s) == ["I start<|im_end|>", "yes<|im_end|>"]
    assert runs(tok, s, value=0)[0] == SMOL_SYSTEM + "<|im_start|>assistant\n"
    no_user = tokenize(tok, conv(("system", "Be kind."), ("assistant", "Hello.")))
    assert isinstance(no_user, TokenizedSample)
    assert runs(tok, no_user) == ["Hello.<|im_end|>"]


def test_template_that_renders_the_last_turn_differently(smol_tokenizer: Any) -> None:
    """A Qwen3-like template: only the final assistant turn gets an empty think block. Prefix renders
    are then not prefixes; the search path still marks exactly content + <|im_end|> of each turn."""
    tok = load_tokenizer("default")  # a private copy: the template is changed below
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    c = conv(("user", "A?"), ("assistant", "first answer"), ("user", "B?"), ("assistant", "second answer"))
    s = tokenize(tok, c)
    assert isinstance(s, TokenizedSample)
    assert runs(tok, s) == ["first answer<|im_end|>", "second answer<|im_end|>"]
    assert "<think>" in tok.decode(s.input_ids_T.tolist())


def test_template_errors_become_failures(smol_tokenizer: Any) -> None:
    tok = load_tokenizer("default")
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    failure = tokenize(tok, conv(("user", "q"), ("assistant", "a")))
    assert isinstance(failure, SourceFailure)
    assert failure.reason == "template_error"
    assert "roles must alternate" in failure.detail
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        tokenize(tok, conv(("user", "q"), ("assistant", "a")))
    with pytest.raises(DataError, match="no chat template"):
        chat_template_hash(tok)


def test_spans_to_token_mask_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        cuts = np.sort(rng.integers(0, 60, size=rng.integers(2, 20)))
        offsets = np.stack([cuts[:-1], cuts[1:]], axis=1)  # includes zero-width tokens
        points = np.sort(rng.choice(61, size=4, replace=False))
        spans = [(int(points[0]), int(points[1])), (int(points[2]), int(points[3]))]
        expected = [
            int(any(max(s, a) < min(e, b) or (s == e and a < s < b) for a, b in spans)) for s, e in offsets
        ]
        assert spans_to_token_mask(spans, offsets).tolist() == expected


def test_hashes_are_stable_across_save_and_processes(smol_tokenizer: Any, tmp_path: Path) -> None:
    tok = smol_tokenizer
    th, ch = tokenizer_hash(tok), chat_template_hash(tok)
    tok.save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tokenizer_hash(reloaded), chat_template_hash(reloaded)) == (th, ch)
    code = (
        "from dflash_offline.target_model.loader import load_tokenizer;"
        "from dflash_offline.data.template import tokenizer_hash, chat_template_hash;"
        "t = load_tokenizer('default'); print(tokenizer_hash(t), chat_template_hash(t))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [th, ch]
    # And they do change with what they describe.
    reloaded.add_tokens(["<dflash-new-token>"])
    assert tokenizer_hash(reloaded) != th
    reloaded.chat_template = reloaded.chat_template + " "
    assert chat_template_hash(reloaded) != ch


def test_real_sharegpt_trained_runs_are_exactly_the_assistant_turns(smol_tokenizer: Any) -> None:
    """On the first 300 records of the embedded data set, each trained run decodes to one non-empty
    assistant content + <|im_end|> (plus the header's newline when the content starts with one and
    the tokenizer merged them), in order."""
    from dflash_offline.data.sources import iter_records

    tok = smol_tokenizer
    checked = 0
    for item in iter_records(None, limit=300):
        if not isinstance(item, Conversation):
            continue
        sample = tokenize(tok, item)
        answers = [m.content for m in item.messages if m.role == "assistant" and m.content.strip()]
        if not answers:
            assert isinstance(sample, SourceFailure)
            assert sample.reason == "empty_response"
            continue
        assert isinstance(sample, TokenizedSample)
        got = runs(tok, sample)
        assert len(got) == len(answers), item.source_index
        for run, answer in zip(got, answers):
            expected = answer + "<|im_end|>"
            assert run in (expected, "\n" + expected), (item.source_index, run[:80], answer[:80])
            assert run == expected or answer.startswith("\n")
        checked += 1
    assert checked > 250


class _RecordingTokenizer:
    """The tokenizer, noting the length of every text it is asked to tokenize."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.lengths: list[int] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.lengths.append(len(text))
        return self._tok(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_a_huge_record_is_tokenized_by_its_head_only(smol_tokenizer: Any) -> None:
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "x", "yy", "\n", "12345", "naïve", "日本語"]
    answer = " ".join(rng.choice(words, 200_000))  # about 1 MB: a record far past any --max-len
    c = conv(("user", "Say a lot."), ("assistant", answer))
    # The reference: the whole text tokenized, then cut (what every record went through before).
    whole = tokenize(smol_tokenizer, c, max_length=10_000_000)
    assert isinstance(whole, TokenizedSample)
    recording = _RecordingTokenizer(smol_tokenizer)
    head = tokenize(recording, c, max_length=256)
    assert isinstance(head, TokenizedSample)
    assert head.truncated
    assert np.array_equal(head.input_ids_T, whole.input_ids_T[:256])
    assert np.array_equal(head.loss_mask_T, whole.loss_mask_T[:256])
    assert max(recording.lengths) < len(answer) // 100  # never the megabyte
    skipped = tokenize(recording, c, max_length=256, too_long="skip")
    assert isinstance(skipped, SourceFailure)
    assert skipped.reason == "too_long"
    assert skipped.detail == "over 272 tokens after templating > `GenerateConfig.max_length` 256"


def test_answer_token_ids_are_cached_instead_of_the_tokenizers_split(smol_tokenizer: Any) -> None:
    """An assistant message's ``token_ids`` (what regenerate writes) that decode to its content are the
    sample's tokens for that content; the template's tokens before it are the generation prompt tokenized
    alone (the target's prompt), the end-of-turn token is trained as before. Reference: the prompt
    tokenized by ``apply_chat_template`` and the ids written by hand."""
    tok = smol_tokenizer
    paragraph = tok.convert_tokens_to_ids(["Intro", "ĊĊ", "Body"])  # SmolLM2 splits "\n\nBody" as Ċ Ċ Body
    text = tok.decode(paragraph)
    assert tok(text, add_special_tokens=False)["input_ids"] != paragraph
    leading = tok.convert_tokens_to_ids(["Ċ", "Six"])  # the header's "\n" would merge with this "\n"
    messages = (
        Message(role="user", content="q1"),
        Message(role="assistant", content=text, token_ids=tuple(paragraph)),
        Message(role="user", content="q2"),
        Message(role="assistant", content="\nSix", token_ids=tuple(leading)),
    )
    s = tokenize(tok, Conversation(sample_id="s", source_index=0, record_id="", messages=messages))
    assert isinstance(s, TokenizedSample)
    ids, mask = s.input_ids_T.tolist(), s.loss_mask_T.tolist()
    im_end, newline = tok.convert_tokens_to_ids(["<|im_end|>", "Ċ"])
    chat = [{"role": m.role, "content": m.content} for m in messages]
    first = list(tok.apply_chat_template(chat[:1], add_generation_prompt=True)["input_ids"])
    second = list(tok.apply_chat_template(chat[:3], add_generation_prompt=True)["input_ids"])
    middle = second[len(first) + len(tok(text, add_special_tokens=False)["input_ids"]) :]
    assert ids == [*first, *paragraph, *middle, *leading, im_end, newline]
    assert middle[0] == im_end
    assert middle[-1] == newline
    assert mask == [0] * len(first) + [1] * 4 + [0] * (len(middle) - 1) + [1] * 3 + [0]

    # Ids that do not decode to the content (edited text, another tokenizer) are ignored: as without ids.
    stale = (messages[0], Message(role="assistant", content=text + "!", token_ids=tuple(paragraph)))
    plain = (messages[0], Message(role="assistant", content=text + "!"))
    with_stale, without = (
        tokenize(tok, Conversation(sample_id="s", source_index=0, record_id="", messages=m))
        for m in (stale, plain)
    )
    assert isinstance(with_stale, TokenizedSample)
    assert isinstance(without, TokenizedSample)
    assert with_stale.input_ids_T.tolist() == without.input_ids_T.tolist()
    assert with_stale.loss_mask_T.tolist() == without.loss_mask_T.tolist()

    # Truncated inside the spliced answer: a prefix of the same tokens.
    cut = tokenize(
        tok, Conversation(sample_id="s", source_index=0, record_id="", messages=messages), len(first) + 2
    )
    assert isinstance(cut, TokenizedSample)
    assert cut.truncated
    assert cut.input_ids_T.tolist() == [*first, *paragraph[:2]]
    assert cut.loss_mask_T.tolist() == [0] * len(first) + [1, 1]
