"""How answers are drawn (``GenerationSettings``) and what an engine hands back for one prompt
(``GeneratedTokens``): the ids before the first stop token, and why the answer ended.

Every sampling knob is explicit, so nothing is filled in from the model's ``generation_config`` (Qwen3
ships temperature 0.6, top-k 20, top-p 0.95): greedy means greedy, and ``temperature`` > 0 means
temperature sampling with the given top-p (no top-k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dflash_offline.regenerate.pending_conversation import FinishReason


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationSettings:
    """How answers are drawn."""

    max_new_tokens: int
    temperature: float
    """0: greedy; > 0: sampling at this temperature."""
    stop_ids: frozenset[int]
    """End-of-turn token ids (the tokenizer's EOS and the generation config's)."""
    top_p: float = 1.0
    """With temperature > 0: sample only among the most likely tokens whose probability reaches top_p."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GeneratedTokens:
    """One prompt's answer as token ids."""

    token_ids: tuple[int, ...]
    """Generated ids before the first stop token (which is not included)."""
    finish_reason: FinishReason
    """``stop`` when a stop token ended it, ``length`` when max_new_tokens did."""
    from_target: bool = True
    """False when the ids are our tokenizer's reading of a text-only answer (a server that returns no
    ids), not the tokens the target generated."""


def split_at_stop(row: Sequence[int], settings: GenerationSettings) -> GeneratedTokens:
    """Generated ids up to the first stop id (an answer that ends with its stop token, or runs to the end)."""
    stop_at = next((i for i, t in enumerate(row) if t in settings.stop_ids), None)
    if stop_at is None:
        return GeneratedTokens(token_ids=tuple(row), finish_reason="length")
    return GeneratedTokens(token_ids=tuple(row[:stop_at]), finish_reason="stop")
