"""Choosing the mask token id: the embedding row fed to the B−1 masked slots of every block.

The rule (docs/drafter.md#mask-token), in order: an explicit option; else the tokenizer's mask token;
else the first embedding row past the tokenizer's vocabulary (Qwen3: 151,669 tokenizer tokens, 151,936 rows →
151669, the id z-lab's published drafters use); else an unused special token: one the chat template does not
emit and that is not BOS/EOS/PAD/UNK (SmolLM2: 49,152 tokens == 49,152 rows, no mask token → the
highest such special, ``<empty_output>`` = 16). Whatever is chosen must be a row of the embedding: a
mask id outside it is one of the bugs other trainers shipped.
"""

from __future__ import annotations

from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import ConfigError

MASK_TOKEN_ID = field_ref("DrafterTrainConfig", "mask_token_id")
"""How messages name the option (train/ imports the drafter: it names the class)."""

# A small conversation that exercises every role the template renders; the ids it produces (with and
# without the generation prompt) are the template's own tokens and may not double as the mask.
_PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "Tell me a joke."},
]


def resolve_mask_token_id(tokenizer: Any, vocab_rows: int, explicit: int | None = None) -> int:
    """The mask token id for a target whose embedding has ``vocab_rows`` rows (the rule above).

    ``tokenizer`` is a transformers tokenizer (duck-typed: ``mask_token_id``, ``len()``,
    ``added_tokens_decoder``, ``apply_chat_template``, the special-token ids).
    """
    if vocab_rows <= 0:
        raise ConfigError(f"vocab_rows={vocab_rows} must be positive (rows of the target embedding)")
    if explicit is not None:
        if not 0 <= explicit < vocab_rows:
            raise ConfigError(
                f"{MASK_TOKEN_ID} {explicit} is not a row of the target embedding "
                f"(rows 0..{vocab_rows - 1}); pick a row inside it"
            )
        return int(explicit)
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and 0 <= int(mask_id) < vocab_rows:
        return int(mask_id)
    num_tokens = len(tokenizer)
    if num_tokens < vocab_rows:
        return num_tokens
    unused = unused_special_token_ids(tokenizer, vocab_rows)
    if not unused:
        raise ConfigError(
            f"no mask token: the tokenizer has no mask token, fills all {vocab_rows} embedding rows, "
            f"and every special token is used by the chat template; pass {MASK_TOKEN_ID} explicitly"
        )
    return unused[-1]


def unused_special_token_ids(tokenizer: Any, vocab_rows: int) -> list[int]:
    """Special tokens (ascending ids) that are not BOS/EOS/PAD/UNK and not emitted by the template."""
    reserved = {
        getattr(tokenizer, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id")
    }
    reserved |= chat_template_token_ids(tokenizer)
    specials: set[int] = set()
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            specials.add(int(token_id))
    specials |= {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    return sorted(i for i in specials if i not in reserved and 0 <= i < vocab_rows)


def chat_template_token_ids(tokenizer: Any) -> set[int]:
    """Every token id the chat template produces for a probe conversation (empty without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    ids: set[int] = set()
    for add_generation_prompt in (False, True):
        rendered = tokenizer.apply_chat_template(
            _PROBE_CONVERSATION[:3] if not add_generation_prompt else _PROBE_CONVERSATION,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
        )
        # transformers 5 returns a BatchEncoding, 4.x a plain list.
        token_ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        ids |= {int(i) for i in token_ids}
    # Without a system message some templates inject a default one with its own tokens.
    rendered = tokenizer.apply_chat_template(_PROBE_CONVERSATION[1:], tokenize=True)
    token_ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    ids |= {int(i) for i in token_ids}
    return ids
