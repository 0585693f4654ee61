"""Batched answers from the target: left-padded prompts through HF ``generate`` (greedy or sampled).

``generate`` handles padding, positions and the KV cache for every model family in every transformers
version we support. Every sampling knob is set explicitly, because unset ones are filled in from the
model's ``generation_config`` (Qwen3 ships temperature 0.6, top-k 20, top-p 0.95): greedy means greedy,
and ``temperature`` > 0 means temperature sampling with the given top-p (no top-k). Sampled answers depend on
the batch they were drawn in (one random stream per batch); greedy answers do not, up to the
floating-point effect of padding.

Shape legend: N prompts in the batch, L longest prompt, G generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_offline.regenerate.pending_conversation import FinishReason
from dflash_offline.target_model.loader import quiet_transformers


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationSettings:
    """How answers are drawn."""

    max_new_tokens: int
    temperature: float
    """0: greedy; > 0: sampling at this temperature."""
    stop_ids: frozenset[int]
    """End-of-turn token ids (the tokenizer's EOS and the generation config's)."""
    pad_id: int
    """Left-padding id (masked out; any valid id)."""
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


def generation_config(settings: GenerationSettings) -> Any:
    from transformers import GenerationConfig

    sampling = settings.temperature > 0
    return GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sampling,
        temperature=settings.temperature if sampling else 1.0,
        top_k=0,
        top_p=settings.top_p if sampling else 1.0,
        eos_token_id=sorted(settings.stop_ids),
        pad_token_id=settings.pad_id,
    )


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, L] and attention mask [N, L] with each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids_NL = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask_NL = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids_NL[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.int64)
        mask_NL[row, width - len(prompt) :] = 1
    return ids_NL.to(device), mask_NL.to(device)


@torch.inference_mode()
def generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], settings: GenerationSettings
) -> list[GeneratedTokens]:
    """Answer every prompt (non-empty token lists) in one ``generate`` call."""
    assert prompts
    assert all(len(p) > 0 for p in prompts)
    device = next(model.parameters()).device
    ids_NL, mask_NL = left_pad(prompts, settings.pad_id, device)
    with quiet_transformers():
        out_NS = model.generate(
            input_ids=ids_NL, attention_mask=mask_NL, generation_config=generation_config(settings)
        )
    new_NG = out_NS[:, ids_NL.shape[1] :].tolist()
    return [split_at_stop(row, settings) for row in new_NG]


def split_at_stop(row: Sequence[int], settings: GenerationSettings) -> GeneratedTokens:
    """Generated ids up to the first stop id (a padded ``generate`` row, or a CB answer that ends with it)."""
    stop_at = next((i for i, t in enumerate(row) if t in settings.stop_ids), None)
    if stop_at is None:
        return GeneratedTokens(token_ids=tuple(row), finish_reason="length")
    return GeneratedTokens(token_ids=tuple(row[:stop_at]), finish_reason="stop")
