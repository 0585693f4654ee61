"""How the target's attention modules reach the slot cache, eager and under ``torch.compile``.

``SlotForward`` calls each decoder layer without a transformers cache: the layer's attention module
computes its queries and its new keys and values (RoPE applied, as the model's own code does) and hands
them to its attention function, which transformers finds through its ``AttentionInterface`` under
``SLOT_ATTENTION``. That function, ``slot_attention``, writes the new keys and values into the forward's
``SlotCache`` and attends over it (``SlotCache.attend``). ``slot_attention_enabled`` points the model's
configs at it and makes the cache the active one only while a slot forward runs, so the same model answers
ordinary forwards (``generate``, the exactness check) as loaded.

Compiled layers (``SlotForward(..., compile_backend=...)``): dynamo traces a whole decoder layer (norms,
projections, RoPE, the MLP and the residual adds, which inductor fuses into a few kernels) and meets the
attention as one opaque operator, ``dflash::slot_attention``. The operator finds the cache and the
forward's rows where ``SlotForward`` left them (the active cache), the way a serving engine's attention
finds its forward context: no cache tensor, slot index or bucket length becomes a graph input, so one
compiled graph serves every layer (its index a dynamic integer), every bucket and every row count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from dflash_offline.decode.slot_cache import SlotCache

SLOT_ATTENTION = "dflash_slots"
"""The name of ``slot_attention`` in transformers' AttentionInterface."""

_active: SlotCache | None = None
"""The cache of the slot forward running now (set by ``slot_attention_enabled``)."""


def active_cache() -> SlotCache:
    assert _active is not None, "slot attention outside a slot forward (SlotForward.hidden)"
    return _active


# The schema spelled out, not inferred from the annotations (strings here, which torch versions evaluate
# differently).
@torch.library.custom_op(
    "dflash::slot_attention",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, Tensor? mask, SymInt layer_idx, float? scale) -> Tensor",
)
def slot_attention_op(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, layer_idx: int, scale: float | None
) -> Tensor:
    """``SlotCache.attend`` on the active cache, opaque to the compiler. It writes into the cache, which is
    not among its arguments: nothing else in a layer's graph reads the cache, and its output feeds the rest
    of the layer, so the compiler neither drops it nor moves it past a reader."""
    return active_cache().attend(layer_idx, query, key, value, mask, scale=scale)


@slot_attention_op.register_fake
def _slot_attention_shape(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, layer_idx: int, scale: float | None
) -> Tensor:
    n, hq, s, d = query.shape
    return query.new_empty((n, s, hq, d))


def slot_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``AttentionInterface`` entry: ``key`` and ``value`` the forward's new ones [N, Hk, S, D],
    ``attention_mask`` the slot forward's boolean mask (None: causal over the rows' own keys, or each row
    over its live keys). Output [N, S, Hq, D], as transformers' own functions."""
    layer_idx: Any = module.layer_idx  # an int of transformers' attention modules (symbolic when compiling)
    if torch.compiler.is_compiling():
        return slot_attention_op(query, key, value, attention_mask, layer_idx, scaling), None
    return active_cache().attend(layer_idx, query, key, value, attention_mask, scale=scaling), None


_registered = False


def register_slot_attention() -> None:
    """Make ``slot_attention`` known to transformers (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    _registered = True


def attention_configs(model: nn.Module) -> list[Any]:
    """Every distinct config object the model's attention modules read their implementation from."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextmanager
def slot_attention_enabled(configs: list[Any], cache: SlotCache) -> Iterator[None]:
    """Inside the block the attention modules reading ``configs`` (``attention_configs(model)``) call
    ``slot_attention`` over ``cache``; after it, what they called before."""
    global _active
    register_slot_attention()
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = SLOT_ATTENTION
    _active = cache
    try:
        yield
    finally:
        _active = None
        for c, name in zip(configs, before, strict=True):
            c._attn_implementation = name
