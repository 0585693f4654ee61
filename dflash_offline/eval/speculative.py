"""Greedy speculative decoding with a block drafter (batch 1), and the target-only loop it is timed against,
over transformers' own forward and ``DynamicCache``: the reference loops. ``dflash eval`` runs the same
two loops on the decode engine (``decode/single.py``: slot cache, CUDA graphs, no host sync inside a
cycle), and the tests hold both to the same outputs.

Legend: P prompt tokens, S tokens of one target call, B block size, K = B − 1 drafted tokens,
C context positions handed to the drafter, F = n·H feature width, V vocabulary.

The speculative loop (docs/data-flow.md#eval). Prefill: one target forward over the prompt with forward
hooks on the drafter's target layers gives the features of positions 0..P−1 and, from the last logits, the
first new token x[P]. Then, with n the position of the newest token x[n] (not yet seen by the target):
  1. the drafter proposes d_1..d_K from [x[n], MASK × K] at positions n..n+K, its context being the
     features of positions 0..n−1 (handed over incrementally: only the positions it has not seen);
  2. the target runs ONE forward over [x[n], d_1..d_K] (positions n..n+K) on its KV cache; p_i is its
     greedy prediction for position n+i+1;
  3. accepted a = the longest run with d_i == p_{i−1} (i = 1..a); the new tokens are d_1..d_a and the
     bonus p_a, so the cycle's acceptance length is τ_cycle = a + 1;
  4. the KV cache is cropped to positions 0..n+a, and the features of positions n..n+a (rows 0..a of
     this forward) become the drafter's new context; n ← n + a + 1.
Every token the loop emits is the target's own greedy choice given the tokens before it, so the output
equals plain greedy decoding up to floating-point differences between one B-token forward and B
one-token forwards (none in float32 on our CPU tests; a near-tie in bfloat16 can flip a token).

Stopping is the same in both loops: the output is cut after the first stop token (kept) and to
``max_new_tokens`` exactly; a cycle that overshoots is truncated, but its acceptance length counts
what the target verified (the drafter's quality, not the budget's edge).
Timing excludes the prefill in both loops; on CUDA the clock reads are preceded by a synchronize.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dflash_offline.decode.single import (
    BlockDrafter,
    Clock,
    DecodeResult,
    StopReason,
    finish_tokens,
    is_done,
)
from dflash_offline.drafter.model import ContextCache, DFlashDrafter
from dflash_offline.target_model.capture import capture_layer_outputs

__all__ = [
    "BlockDrafter",
    "DFlashBlockDrafter",
    "DecodeResult",
    "StopReason",
    "TargetCaller",
    "speculative_decode",
    "target_only_decode",
]


class DFlashBlockDrafter:
    """A ``DFlashDrafter`` behind the ``BlockDrafter`` protocol, keeping its per-layer context K/V."""

    def __init__(self, model: DFlashDrafter) -> None:
        self.model = model
        self._cache: ContextCache = model.new_context_cache()

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def reset(self) -> None:
        self._cache = self.model.new_context_cache()

    def propose(self, *, new_features_CF: Tensor, anchor_token: int, anchor_position: int) -> Tensor:
        return self.model.draft(
            context_features_CF=new_features_CF,
            anchor_token=anchor_token,
            anchor_position=anchor_position,
            cache=self._cache,
        )


class TargetCaller:
    """One HF CausalLM forward over new tokens on a ``DynamicCache``, portable across transformers 4.56–5.x
    (5.24 renamed ``past_key_values`` to ``cache``; the old name warns there)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self.device = next(model.parameters()).device

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def __call__(self, ids: Sequence[int] | Tensor, cache: Any, *, last_only: bool = False) -> Tensor:
        """float logits [S, V] of the S new tokens (only the last row when ``last_only``)."""
        ids_1S = torch.as_tensor(ids, dtype=torch.int64, device=self.device).reshape(1, -1)
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(input_ids=ids_1S, **kwargs).logits[0]
        return logits[-1:] if last_only else logits


@torch.inference_mode()
def target_only_decode(
    target: TargetCaller, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: frozenset[int]
) -> DecodeResult:
    """Plain greedy decoding with the KV cache: the speculative loop with a block of one token."""
    _check_args(prompt_ids, max_new_tokens)
    clock = Clock(target.device)
    cache = target.new_cache()
    t0 = clock.now()
    # The next token stays on the device as the next call's input: one host sync per token (the
    # stop check), no host-to-device copy.
    next_1 = target(prompt_ids, cache, last_only=True)[-1:].argmax(dim=-1)
    tokens = [int(next_1)]
    t1 = clock.now()
    forwards = 0
    while not is_done(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids, checked=len(tokens) - 1):
        next_1 = target(next_1, cache, last_only=True)[-1:].argmax(dim=-1)
        tokens.append(int(next_1))
        forwards += 1
    t2 = clock.now()
    out, stopped = finish_tokens(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    return DecodeResult(
        tokens=tuple(out),
        accepted_per_cycle=(),
        stop_reason="stop_token" if stopped else "length",
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        num_target_forwards=forwards,
    )


@torch.inference_mode()
def speculative_decode(
    target: TargetCaller,
    drafter: BlockDrafter,
    prompt_ids: Sequence[int],
    *,
    layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int],
) -> DecodeResult:
    """Greedy speculative decoding of one prompt (see the module docstring for the cycle)."""
    _check_args(prompt_ids, max_new_tokens)
    clock = Clock(target.device)
    K = drafter.block_size - 1
    drafter.reset()
    cache = target.new_cache()
    accepted: list[int] = []
    forwards = 0
    with capture_layer_outputs(target.model, layer_ids) as captured:
        t0 = clock.now()
        anchor_1 = target(prompt_ids, cache, last_only=True)[-1:].argmax(dim=-1)
        tokens = [int(anchor_1)]
        new_features_CF = captured.features()[0]  # positions 0..P−1
        t1 = clock.now()
        n = len(prompt_ids)  # position of tokens[-1], the anchor: known, not yet run through the target
        checked = 0
        while not is_done(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids, checked=checked):
            checked = len(tokens)
            draft_K = drafter.propose(
                new_features_CF=new_features_CF, anchor_token=tokens[-1], anchor_position=n
            )
            assert draft_K.shape == (K,), f"the drafter proposed {tuple(draft_K.shape)} tokens, expected {K}"
            draft_K = draft_K.to(device=target.device, dtype=torch.int64)
            block_B = torch.cat([anchor_1, draft_K])
            predictions_B = target(block_B, cache).argmax(dim=-1)
            forwards += 1
            # Accepted a and the predictions come to the host together: one sync per cycle. The
            # accepted drafts equal predictions 0..a−1, so the new tokens are predictions 0..a (the
            # last one the bonus).
            accepted_1 = (draft_K == predictions_B[:-1]).to(torch.int64).cumprod(dim=0).sum().reshape(1)
            a, *predictions = torch.cat([accepted_1, predictions_B]).tolist()
            accepted.append(a)
            tokens.extend(predictions[: a + 1])
            anchor_1 = predictions_B[a : a + 1]
            _drop_rejected(cache, n=n, accepted=a, num_drafts=K)
            new_features_CF = captured.features()[0, : a + 1]  # positions n..n+a
            n += a + 1
        t2 = clock.now()
    out, stopped = finish_tokens(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    return DecodeResult(
        tokens=tuple(out),
        accepted_per_cycle=tuple(accepted),
        stop_reason="stop_token" if stopped else "length",
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        num_target_forwards=forwards,
    )


def _drop_rejected(cache: Any, *, n: int, accepted: int, num_drafts: int) -> None:
    """Positions n+a+1..n+K of the block verified at n hold rejected drafts: drop them from the target's
    cache. A negative crop removes that many tokens in every transformers version (5.24 refuses a
    positive target length; 4.x reads crop(0) as "keep nothing"), hence the guard."""
    if accepted < num_drafts:
        cache.crop(-(num_drafts - accepted))
    assert cache.get_seq_length() == n + accepted + 1, (cache.get_seq_length(), n, accepted)


def _check_args(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    assert len(prompt_ids) >= 1, "an empty prompt has no position to predict from"
    assert max_new_tokens >= 1, max_new_tokens
