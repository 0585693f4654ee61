"""Attention over the slot cache: every row's queries against its own live keys, GQA read in place.

Legend: N rows, S query tokens per row, Hq query heads, Hk key/value heads, Lb key positions attended
over (a bucket of the slot capacity), D head dim.

One call, for the target's layers and the drafter's alike:
``scaled_dot_product_attention(q, k, v, attn_mask=bool [N, 1, S, Lb], enable_gqa=True)``. Measured on an
H200 in bf16 (bench/RESULTS.md, "Decode attention"): cuDNN takes grouped K/V and the boolean length mask
directly, 12× faster than expanding K/V to the query heads first (the ``repeat_kv`` copy that was 81 % of
transformers' decode step) at 1,024 rows; the efficient kernel refuses GQA and FlexAttention rebuilds its
block mask per call. So on CUDA in half precision cuDNN is first, the math kernel the fallback (float32,
which cuDNN does not take); on the CPU the math kernel, the exact reference the tests compare against.

A masked-out key contributes an exact zero, so a row never attends to another request's keys, nor to
positions past its own length; every row must see at least one key (a fully masked row is NaN).

The model's attention modules find this function through transformers' ``AttentionInterface`` under
``SLOT_ATTENTION``; ``slot_attention_enabled`` points the model's config at it only while a slot-cache
forward runs, so the same model answers ordinary forwards (``generate``, the exactness check) as loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SLOT_ATTENTION = "dflash_slots"
"""The name of ``slot_attention`` in transformers' AttentionInterface."""

LIVE_KEYS_KWARG = "slot_live_keys"
"""The keyword that carries a forward's ``LiveKeys`` from the decoder layers to ``slot_attention``
(transformers hands a layer's extra keywords on to its attention function)."""


def sdpa_backends(device: torch.device, dtype: torch.dtype) -> list[SDPBackend]:
    """Kernels to try, best first: cuDNN on CUDA in half precision, else the math kernel."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.MATH]


def causal_backends(device: torch.device, dtype: torch.dtype) -> list[SDPBackend]:
    """Kernels for a causal block over its own keys (no mask): flash first on CUDA in half precision (it
    takes GQA, and needs no per-shape plan, which prefill shapes would otherwise pay per call)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.MATH]


def attend(
    q_NHSD: Tensor, k_NHLD: Tensor, v_NHLD: Tensor, mask: Tensor | None, *, scale: float | None = None
) -> Tensor:
    """[N, Hq, S, D]: each query over the keys its boolean ``mask`` ([N or 1, 1, S, Lb]) allows; without a
    mask, causal over the block's own S keys (query i sees keys 0..i)."""
    device, dtype = q_NHSD.device, q_NHSD.dtype
    backends = sdpa_backends(device, dtype) if mask is not None else causal_backends(device, dtype)
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(
            q_NHSD,
            k_NHLD,
            v_NHLD,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q_NHSD.shape[1] != k_NHLD.shape[1],
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveKeys:
    """How many keys each row of a one-token-per-row forward attends over, laid out for the flash kernel's
    variable-length call (``attend_live``): built once a step, read by every layer. Each (row, K/V head)
    pair is one sequence of the call, its query heads that head's group (GQA read in place), its keys the
    row's slot at that head: positions 0..count−1, nothing past them (no attention over padding)."""

    seqused_k: Tensor
    """int32 [N·Hk]: keys of each (row, head) sequence (the row's count, repeated per head)."""
    cu_seqlens_q: Tensor
    """int32 [N·Hk + 1]: one query a sequence."""
    cu_seqlens_k: Tensor
    """int32 [N·Hk + 1]: where each sequence's keys start, in positions of the flattened cache view."""
    max_keys: int
    """The most keys a row may attend over (the forward's attended bucket)."""


def live_keys(key_counts_N: Tensor, *, num_kv_heads: int, positions_per_head: int, max_keys: int) -> LiveKeys:
    """``LiveKeys`` of rows attending over positions 0..count−1 of a cache whose (row, head) planes are
    ``positions_per_head`` positions apart (a slot cache's capacity)."""
    n = key_counts_N.shape[0]
    device = key_counts_N.device
    starts = torch.arange(n * num_kv_heads + 1, device=device, dtype=torch.int32)
    return LiveKeys(
        seqused_k=key_counts_N.to(torch.int32).repeat_interleave(num_kv_heads),
        cu_seqlens_q=starts,
        cu_seqlens_k=starts * positions_per_head,
        max_keys=max_keys,
    )


def grouped_layout(q_NHSD: Tensor, k_NHLD: Tensor, v_NHLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The flash kernel's variable-length layout of one query a row over a slot cache, with no copy of K/V:
    queries [N·Hk, G, D] (row n's query heads of K/V head h: transformers' GQA pairs query head j with
    K/V head j // G), keys and values [T, 1, D] views of the cache planes (T = N·Hk·L, L the positions
    between one plane and the next: ``k_NHLD.stride(1) // D``)."""
    n, hq, s, d = q_NHSD.shape
    hk = k_NHLD.shape[1]
    assert s == 1, "one query a row"
    assert k_NHLD.stride() == v_NHLD.stride(), (k_NHLD.stride(), v_NHLD.stride())
    plane = k_NHLD.stride(1)
    assert k_NHLD.stride(3) == 1, k_NHLD.stride()
    assert k_NHLD.stride(2) == d, k_NHLD.stride()
    assert k_NHLD.stride(0) == hk * plane, k_NHLD.stride()
    rows = n * hk * (plane // d)
    q = q_NHSD.reshape(n * hk, hq // hk, d)
    k = k_NHLD.as_strided((rows, 1, d), (d, d, 1))
    v = v_NHLD.as_strided((rows, 1, d), (d, d, 1))
    return q, k, v


def attend_live(
    q_NHSD: Tensor, k_NHLD: Tensor, v_NHLD: Tensor, live: LiveKeys, *, scale: float | None = None
) -> Tensor:
    """[N, Hq, 1, D]: each row's query over its own live keys alone, K/V read in place (CUDA, half
    precision: the flash kernel's variable-length forward with per-sequence used key counts)."""
    n, hq, _, d = q_NHSD.shape
    q, k, v = grouped_layout(q_NHSD, k_NHLD, v_NHLD)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, live.cu_seqlens_q, live.cu_seqlens_k, 1, live.max_keys, 0.0, False, False,
        scale=scale, seqused_k=live.seqused_k,
    )[0]  # fmt: skip
    return out.view(n, hq, 1, d)


def flash_reads_live_lengths(
    device: torch.device, dtype: torch.dtype, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether ``attend_live`` runs here and agrees with the masked kernel on a small case (CUDA in half
    precision with a torch whose flash forward takes ``seqused_k``); else the padded path."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    slots, cap = 3, 256
    q = torch.randn((slots, num_heads, 1, head_dim), generator=gen, device=device, dtype=dtype)
    k = torch.randn((slots + 1, num_kv_heads, cap, head_dim), generator=gen, device=device, dtype=dtype)
    v = torch.randn((slots + 1, num_kv_heads, cap, head_dim), generator=gen, device=device, dtype=dtype)
    counts = torch.tensor([1, 70, 200], device=device)
    mask = (torch.arange(128, device=device)[None, :] < counts[:, None])[:, None, None, :]
    try:
        live = live_keys(counts, num_kv_heads=num_kv_heads, positions_per_head=cap, max_keys=128)
        got = attend_live(q, k[:slots, :, :128], v[:slots, :, :128], live)
    except (RuntimeError, TypeError):
        return False
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(
            q.float(), k[:slots, :, :128].float(), v[:slots, :, :128].float(), attn_mask=mask,
            enable_gqa=num_heads != num_kv_heads,
        )  # fmt: skip
    return bool(torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2))


def cudnn_reads_slices(
    device: torch.device, dtype: torch.dtype, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the preferred kernel takes K/V sliced along positions (a strided view of the cache); when
    cuDNN refuses one, the caller attends over the whole capacity instead of falling back to the math
    kernel (which would expand K/V again)."""
    if sdpa_backends(device, dtype)[0] != SDPBackend.CUDNN_ATTENTION:
        return True
    q = torch.zeros((1, num_heads, 1, head_dim), dtype=dtype, device=device)
    kv = torch.zeros((1, num_kv_heads, 128, head_dim), dtype=dtype, device=device)
    mask = torch.ones((1, 1, 1, 64), dtype=torch.bool, device=device)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(
                q, kv[:, :, :64], kv[:, :, :64], attn_mask=mask, enable_gqa=num_heads != num_kv_heads
            )
    except RuntimeError:
        return False
    return True


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
    """The ``AttentionInterface`` entry: ``attention_mask`` is the slot forward's boolean mask (None: a
    prefill of fresh prompts, causal over their own keys), ``key`` and ``value`` what ``SlotCache.update``
    returned. Output [N, S, Hq, D], as transformers' own functions."""
    live = kwargs.get(LIVE_KEYS_KWARG)
    if live is not None:
        out = attend_live(query, key, value, live, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    assert attention_mask is None or attention_mask.dtype == torch.bool, attention_mask.dtype
    out = attend(query, key, value, attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


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
def slot_attention_enabled(configs: list[Any]) -> Iterator[None]:
    """The attention modules reading ``configs`` (``attention_configs(model)``) call ``slot_attention``
    inside the block, and what they called before after it."""
    register_slot_attention()
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = SLOT_ATTENTION
    try:
        yield
    finally:
        for c, name in zip(configs, before, strict=True):
            c._attn_implementation = name
