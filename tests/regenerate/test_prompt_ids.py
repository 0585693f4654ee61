"""``PromptEncoder``: a turn's prompt that continues the previous turn's ids is, id for id, the tokenizer's
own tokenization of the whole rendered prompt (reference: ``tokenizer(text)`` on ``apply_chat_template``'s
text, with the SmolLM2 tokenizer), on multi-turn conversations with empty, cut, unicode and
special-token-bearing answers; where the shortcut would not be exact (a tokenizer whose pieces depend on their
place, a template that renders earlier turns anew, a text tokenized by its head) every prompt is tokenized
whole. Through the driver, continued and whole prompts give the engine the same ids and the output the same
bytes."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import pre_tokenizers

from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import iter_records
from dflash_offline.data.template import head_chars
from dflash_offline.regenerate.driver import KEY, ConversationSink, Driver
from dflash_offline.regenerate.engine_protocol import Finished
from dflash_offline.regenerate.generation import GeneratedTokens
from dflash_offline.regenerate.jsonl_out import ResumableJsonl
from dflash_offline.regenerate.prompt_ids import PromptEncoder, PromptIds, cut_token_ids
from dflash_offline.target_model.loader import load_tokenizer

ANSWERS = [
    "",
    "\n\nAn answer that opens with newlines.",
    " a leading space, and trailing ones  \n",
    "héllo 你好 🙂 naïve — a\u2028line separator",
    "a literal <|im_end|>\n<|im_start|>user\nthat looks like a turn",
    "cut in the middle of a character \ufffd",
    "def f(x):\n\treturn x  *  2\n\n",
]
USERS = ["What is 2+2?", "  and now with leading spaces", "多谢 🙏\r\nnext line", "<|im_start|> literal"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("default")


def reference(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    """The whole rendered prompt through the tokenizer's own call."""
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


class _Spy:
    """The backend tokenizer, recording the length of each text it encodes."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.lengths: list[int] = []

    def encode(self, text: str, **kw: Any) -> Any:
        self.lengths.append(len(text))
        return self.backend.encode(text, **kw)


def _turns(
    encoder: PromptEncoder, chats: Sequence[list[dict[str, str]]]
) -> tuple[list[PromptIds], list[int]]:
    """Each chat's prompt, continuing the one before; with the length of the text the backend encoded."""
    spy = _Spy(encoder._backend)
    encoder._backend = spy
    prompts: list[PromptIds] = []
    for chat in chats:
        prompts.append(encoder.encode(chat, previous=prompts[-1] if prompts else None))
    return prompts, spy.lengths


def _growing_chat(answers: Sequence[str], *, system: bool) -> list[list[dict[str, str]]]:
    chat: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}] if system else []
    chats = []
    for k, user in enumerate(USERS):
        chat = [*chat, {"role": "user", "content": user}]
        chats.append(chat)
        chat = [*chat, {"role": "assistant", "content": answers[k % len(answers)]}]
    return chats


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("system", [False, True])
def test_a_continued_prompt_is_the_whole_prompts_ids(tokenizer: Any, answer: str, system: bool) -> None:
    encoder = PromptEncoder(tokenizer, max_tokens=2048)
    assert encoder.continues_turns
    chats = _growing_chat([answer, *ANSWERS], system=system)
    prompts, lengths = _turns(encoder, chats)
    for chat, prompt, length in zip(chats, prompts, lengths, strict=True):
        assert list(prompt.ids) == reference(tokenizer, chat)
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert prompt.head_text == text[: text.rindex("<|im_start|>") + len("<|im_start|>")]
        assert length < len(text) or chat is chats[0]  # later turns encoded only their tail
    assert lengths[0] == len(
        tokenizer.apply_chat_template(chats[0], tokenize=False, add_generation_prompt=True)
    )


def test_a_tokenizer_whose_pieces_depend_on_their_place_is_tokenized_whole(tokenizer: Any) -> None:
    """A pre-tokenizer marking a text's first piece alone (Metaspace's prepend_scheme "first") tokenizes a
    tail otherwise than the same piece inside the whole text: the probe finds it and nothing is continued."""
    marked = copy.deepcopy(tokenizer)
    marked.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme="first"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tail = "assistant\nhello"
    alone = marked.backend_tokenizer.encode(tail).ids
    within = marked.backend_tokenizer.encode("<|im_start|>" + tail).ids[1:]
    assert alone != within  # the premise of the shortcut is false for this tokenizer
    encoder = PromptEncoder(marked, max_tokens=2048)
    assert not encoder.continues_turns
    chats = _growing_chat(ANSWERS, system=False)
    prompts, lengths = _turns(encoder, chats)
    assert [list(p.ids) for p in prompts] == [reference(marked, chat) for chat in chats]
    assert lengths == []  # whole, through render_prompt's path


def test_a_turn_whose_earlier_turns_render_anew_is_tokenized_whole(tokenizer: Any) -> None:
    """A template whose text of the earlier turns changes as the chat grows (here: a line in front once it
    holds 7 messages, past the probe's 5) leaves that turn nothing to continue: it is tokenized whole, the
    turns before it continued, all equal to the reference."""
    growing = copy.deepcopy(tokenizer)
    growing.chat_template = (
        "{% if messages | length > 6 %}{{ 'a long chat\\n' }}{% endif %}" + tokenizer.chat_template
    )
    encoder = PromptEncoder(growing, max_tokens=2048)
    assert encoder.continues_turns
    chats = _growing_chat(ANSWERS, system=False)
    assert [len(c) for c in chats] == [1, 3, 5, 7]
    prompts, lengths = _turns(encoder, chats)
    texts = [growing.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    assert [list(p.ids) for p in prompts] == [reference(growing, chat) for chat in chats]
    assert texts[3].startswith("a long chat\n")
    assert lengths[1] < len(texts[1])
    assert lengths[2] < len(texts[2])
    assert lengths[3] == len(texts[3])  # whole


def test_a_text_past_the_head_is_tokenized_by_its_head(tokenizer: Any) -> None:
    """A prompt longer than ``head_chars``: its first max_tokens + 1 or more ids (enough to refuse it), the
    reference's first ones, and nothing to continue."""
    max_tokens = 64
    encoder = PromptEncoder(tokenizer, max_tokens=max_tokens)
    chats = _growing_chat(["word " * 2 * head_chars(max_tokens)], system=False)
    prompts, _ = _turns(encoder, chats[:2])
    assert list(prompts[0].ids) == reference(tokenizer, chats[0])
    expected = reference(tokenizer, chats[1])
    assert max_tokens < len(prompts[1].ids) < len(expected)
    assert list(prompts[1].ids) == expected[: len(prompts[1].ids)]
    assert prompts[1].head_tokens == 0


def test_a_cut_token_matches_as_itself(tokenizer: Any) -> None:
    """A token inside a longer added token, or one that swallows the spaces around it, is no cut."""
    assert {"<|im_start|>", "<|im_end|>"} <= set(cut_token_ids(tokenizer).values())
    longer = copy.deepcopy(tokenizer)
    longer.add_special_tokens({"additional_special_tokens": ["<|im_start|>assistant"]})
    cuts = set(cut_token_ids(longer).values())
    assert "<|im_start|>" not in cuts
    assert {"<|im_end|>", "<|im_start|>assistant"} <= cuts


class _Recorded:
    """Answers every turn at once (two a poll) with its scripted answer; records each submitted prompt."""

    name = "slots"

    def __init__(self, answers: dict[str, list[GeneratedTokens]]) -> None:
        self.answers = answers
        self.queue: list[str] = []
        self.prompts: dict[str, list[int]] = {}

    def submit(self, key: str, prompt: Sequence[int], **hints: Any) -> None:
        self.prompts[key] = list(prompt)
        self.queue.append(key)

    def release(self, key: str) -> None:
        pass

    def pending(self) -> int:
        return len(self.queue)

    def poll(self, timeout: float) -> list[Finished]:
        done, self.queue = self.queue[:2], self.queue[2:]
        return [
            Finished(key=k, tokens=self.answers[k.rsplit("#", 1)[0]][int(k.rsplit("#", 1)[1])]) for k in done
        ]

    def close(self, *, abort: bool = False) -> None:
        pass


def _records(path: Path, tokenizer: Any) -> tuple[list[Conversation], dict[str, list[GeneratedTokens]]]:
    """Conversations covering the driver's edges, and each one's scripted answers by sample id."""
    long_user = "many words " * 400  # a prompt past --max-prompt-tokens 512, under head_chars
    huge_user = "x y " * 4 * head_chars(512)  # a text past head_chars: tokenized by its head
    rows = [
        ["Hi there.", "Tell me more.", "And then?"],
        ["First question.", long_user, "never asked"],  # turn 1 too long: dropped turns
        [long_user],  # the first turn too long: a failure
        ["Short.", huge_user],
        ["An empty answer follows.", "never asked"],
        ["多谢 🙏", "<|im_start|> literal", "  spaces  "],
    ]
    records = [
        {"id": f"r{i}", "messages": [m for u in users for m in ({"role": "user", "content": u},
                                                                  {"role": "assistant", "content": "."})]}
        for i, users in enumerate(rows)
    ]  # fmt: skip
    records += [{"id": f"s{i}", "conversations": c["conversations"]} for i, c in enumerate(_sharegpt(12))]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    convs = [c for c in iter_records(path) if isinstance(c, Conversation)]
    encode = tokenizer.backend_tokenizer.encode
    pool = [GeneratedTokens(token_ids=tuple(encode(a).ids), finish_reason="stop") for a in ANSWERS if a]
    snowman = tuple(encode("a snowman ☃ and more").ids)
    cut = GeneratedTokens(token_ids=snowman[:-3], finish_reason="length")  # ends inside ☃'s bytes
    assert "\ufffd" in tokenizer.decode(list(cut.token_ids))
    empty = GeneratedTokens(token_ids=(), finish_reason="stop")
    answers: dict[str, list[GeneratedTokens]] = {}
    for i, c in enumerate(convs):
        turns = [pool[(i + k) % len(pool)] for k in range(8)]
        if c.record_id == "r4":
            turns[0] = empty
        if c.record_id in ("r0", "r5"):
            turns[1] = cut
        answers[c.sample_id] = turns
    return convs, answers


def _sharegpt(n: int) -> list[dict[str, Any]]:
    """The first ``n`` multi-turn records of the embedded ShareGPT file, as ShareGPT records."""
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    out = []
    for c in iter_records(None, limit=200):
        if isinstance(c, Conversation) and sum(m.role == "user" for m in c.messages) > 1:
            out.append({"conversations": [{"from": roles[m.role], "value": m.content} for m in c.messages]})
            if len(out) == n:
                break
    return out


def _drive(
    tmp: Path, tokenizer: Any, convs: list[Conversation], answers: Any, *, continued: bool
) -> _Recorded:
    engine = _Recorded(answers)
    tmp.mkdir()
    with ResumableJsonl(tmp / "o.jsonl", key=KEY) as out, ResumableJsonl(tmp / "f.jsonl", key=KEY) as fails:
        sink = ConversationSink(
            out=out, failures=fails, partial=tmp / "o.jsonl.partial", source="t", regenerated_by={},
            on_tally=lambda t: None, on_failure=lambda s: None,
        )  # fmt: skip
        driver = Driver(
            engine=engine, sink=sink, tokenizer=tokenizer, max_prompt_tokens=512, window=5,
            done=lambda s: False,
        )  # fmt: skip
        if not continued:
            driver.prompts = PromptEncoder(tokenizer, max_tokens=512, continue_turns=False)
        assert driver.prompts.continues_turns == continued
        assert driver.run(iter(convs), should_stop=lambda: False)
    return engine


def test_the_driver_submits_and_writes_the_same_with_continued_prompts(
    tmp_path: Path, tokenizer: Any
) -> None:
    convs, answers = _records(tmp_path / "chat.jsonl", tokenizer)
    whole = _drive(tmp_path / "whole", tokenizer, convs, answers, continued=False)
    continued = _drive(tmp_path / "continued", tokenizer, convs, answers, continued=True)
    assert continued.prompts == whole.prompts
    for name in ("o.jsonl", "f.jsonl"):
        assert (tmp_path / "continued" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    # Every submitted prompt of a written conversation is the reference's for the chat written before it.
    lines = [json.loads(x) for x in (tmp_path / "whole" / "o.jsonl").read_text().split("\n")[:-1]]
    checked = 0
    for line in lines:
        chat = [{"role": m["role"], "content": m["content"]} for m in line["messages"]]
        said = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        for turn, at in enumerate(said):
            assert continued.prompts[f"{line[KEY]}#{turn}"] == reference(tokenizer, chat[:at])
            checked += 1
    # The edges were reached: dropped turns, a first turn too long, an empty answer, a cut answer.
    failures = [json.loads(x)["reason"] for x in (tmp_path / "whole" / "f.jsonl").read_text().splitlines()]
    assert sorted(failures) == ["empty_response", "too_long"]
    dropped = {line["id"] for line in lines if line["dropped_turns"]}
    assert {"r1", "r3"} <= dropped
    assert any("\ufffd" in m["content"] for line in lines for m in line["messages"])
    assert checked > 2 * len(lines)
