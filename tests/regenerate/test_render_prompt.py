"""``render_prompt``: the prompt's token ids are the tokenizer's own for the rendered chat, whether the fast
tokenizer's encoder is called directly (a prompt that fits) or the text is tokenized by its head (a longer
one): reference, ``tokenizer(text)`` on the same rendering."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_offline.data.template import head_chars
from dflash_offline.regenerate.driver import render_prompt
from dflash_offline.target_model.loader import load_target

TEXTS = [
    "héllo wörld, 你好 🙂 — naïve café",
    "def f(x):\n\tif x:\n        return  x  *  2\n\n\n    # trailing   \n",
    "a literal <|im_end|> and <|im_start|>assistant inside the text",
    "   leading spaces, then\r\nWindows lines\u00a0and a no-break space",
    "numbers 1234567890 3.14159 1e-9 and URLs https://example.com/a?b=c&d=e",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_target("random:tiny", device="cpu").tokenizer


def reference(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


@pytest.mark.parametrize("text", TEXTS)
def test_the_prompt_is_the_tokenizers_own_ids(tokenizer: Any, text: str) -> None:
    chat = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": text[::-1]},
        {"role": "user", "content": "and " + text},
    ]
    expected = reference(tokenizer, chat)
    assert render_prompt(tokenizer, chat, max_tokens=2048) == expected  # fits: the encoder directly
    assert render_prompt(tokenizer, chat) == expected


def test_a_prompt_longer_than_the_head_keeps_its_first_tokens(tokenizer: Any) -> None:
    """Past ``head_chars`` the text is tokenized by its head: at least the first ``max_tokens`` + 1 tokens,
    equal to the whole text's."""
    max_tokens = 40
    chat = [{"role": "user", "content": " ".join(TEXTS) * 20}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert len(text) > head_chars(max_tokens)
    expected = reference(tokenizer, chat)
    got = render_prompt(tokenizer, chat, max_tokens=max_tokens)
    assert max_tokens < len(got) < len(expected)
    assert got == expected[: len(got)]
