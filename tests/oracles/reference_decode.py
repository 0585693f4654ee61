"""Test oracles: greedy speculative decoding with a block drafter (batch 1), and plain greedy decoding, over
transformers' own forward and ``DynamicCache``. Written independently of the decode engine (no slot cache,
no CUDA graphs, no static drafter context, their own stop rule), so that the tests can hold the product's
one loop (``dflash_offline/decode/speculative.py``) to their outputs; ``tests/eval/test_speculative.py``
checks these loops themselves against a greedy decode without any KV cache.

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

Stopping: the output is cut after the first stop token (kept) and to ``max_new_tokens`` exactly; a cycle
that overshoots is truncated, but its acceptance length counts what the target verified.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dflash_offline.decode import DecodeResult
from dflash_offline.drafter.model import ContextCache, DFlashDrafter
from dflash_offline.target_model.capture import capture_layer_outputs


class BlockDrafter(Protocol):
    """A drafter proposing on the host, one block at a time."""

    @property
    def block_size(self) -> int:
        """B: the anchor plus K = B − 1 drafted tokens."""
        ...

    def reset(self) -> None:
        """Forget the context of the previous prompt."""
        ...

    def propose(self, *, new_features_CF: Tensor, anchor_token: int, anchor_position: int) -> Tensor:
        """int64 [K]: draft tokens for positions anchor_position+1..anchor_position+K.

        ``new_features_CF`` are the features of the positions the drafter has not seen yet; together
        with the earlier calls since ``reset`` they cover positions 0..anchor_position−1 exactly."""
        ...


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


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _stopped(tokens: list[int], *, max_new_tokens: int, stop_ids: frozenset[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in stop_ids for t in tokens)


def _result(
    tokens: list[int], accepted: list[int], forwards: int, t0: float, t1: float, t2: float, **stop: Any
) -> DecodeResult:
    """Cut after the first stop token (kept), then to max_new_tokens."""
    stop_ids: frozenset[int] = stop["stop_ids"]
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    out = tokens[: min(cut, stop["max_new_tokens"])]
    return DecodeResult(
        tokens=tuple(out),
        accepted_per_cycle=tuple(accepted),
        stop_reason="stop_token" if out and out[-1] in stop_ids else "length",
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        num_target_forwards=forwards,
    )


@torch.inference_mode()
def target_only_decode(
    target: TargetCaller, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: frozenset[int]
) -> DecodeResult:
    """Plain greedy decoding with the KV cache, one token per forward."""
    assert len(prompt_ids) >= 1, "an empty prompt has no position to predict from"
    assert max_new_tokens >= 1, max_new_tokens
    cache = target.new_cache()
    t0 = _now(target.device)
    next_1 = target(prompt_ids, cache, last_only=True)[-1:].argmax(dim=-1)
    tokens = [int(next_1)]
    t1 = _now(target.device)
    forwards = 0
    while not _stopped(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids):
        next_1 = target(next_1, cache, last_only=True)[-1:].argmax(dim=-1)
        tokens.append(int(next_1))
        forwards += 1
    t2 = _now(target.device)
    return _result(tokens, [], forwards, t0, t1, t2, max_new_tokens=max_new_tokens, stop_ids=stop_ids)


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
    assert len(prompt_ids) >= 1, "an empty prompt has no position to predict from"
    assert max_new_tokens >= 1, max_new_tokens
    K = drafter.block_size - 1
    drafter.reset()
    cache = target.new_cache()
    accepted: list[int] = []
    with capture_layer_outputs(target.model, layer_ids) as captured:
        t0 = _now(target.device)
        anchor_1 = target(prompt_ids, cache, last_only=True)[-1:].argmax(dim=-1)
        tokens = [int(anchor_1)]
        new_features_CF = captured.features()[0]  # positions 0..P−1
        t1 = _now(target.device)
        n = len(prompt_ids)  # position of tokens[-1], the anchor: known, not yet run through the target
        while not _stopped(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids):
            draft_K = drafter.propose(
                new_features_CF=new_features_CF, anchor_token=tokens[-1], anchor_position=n
            )
            assert draft_K.shape == (K,), f"the drafter proposed {tuple(draft_K.shape)} tokens, expected {K}"
            draft_K = draft_K.to(device=target.device, dtype=torch.int64)
            predictions_B = target(torch.cat([anchor_1, draft_K]), cache).argmax(dim=-1)
            a = 0
            while a < K and int(draft_K[a]) == int(predictions_B[a]):
                a += 1
            accepted.append(a)
            tokens.extend(int(p) for p in predictions_B[: a + 1])
            anchor_1 = predictions_B[a : a + 1]
            if a < K:
                # A negative crop removes that many tokens in every transformers version (5.24 refuses a
                # positive target length; 4.x reads crop(0) as "keep nothing").
                cache.crop(-(K - a))
            assert cache.get_seq_length() == n + a + 1, (cache.get_seq_length(), n, a)
            new_features_CF = captured.features()[0, : a + 1]  # positions n..n+a
            n += a + 1
        t2 = _now(target.device)
    return _result(
        tokens, accepted, len(accepted), t0, t1, t2, max_new_tokens=max_new_tokens, stop_ids=stop_ids
    )
