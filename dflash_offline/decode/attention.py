"""Attention over the slot cache: every row's queries against its own live keys, GQA read in place.

Legend: N rows, S query tokens per row, Hq query heads, Hk key/value heads, Lb key positions attended
over (a bucket of the slot capacity), D head dim.

One call, for the target's layers and the drafter's alike:
``scaled_dot_product_attention(q, k, v, attn_mask=bool [N, 1, S, Lb], enable_gqa=True)``. Measured on an
H200 in bf16 (docs/facts.md#decoding): cuDNN takes grouped K/V and the boolean length mask
directly, 12× faster than expanding K/V to the query heads first (the ``repeat_kv`` copy that was 81 % of
transformers' decode step) at 1,024 rows; the efficient kernel refuses GQA and FlexAttention rebuilds its
block mask per call. So on CUDA in half precision cuDNN is first, the math kernel the fallback (float32,
which cuDNN does not take); on the CPU the math kernel, the exact reference the tests compare against.

A masked-out key contributes an exact zero, so a row never attends to another request's keys, nor to
positions past its own length; every row must see at least one key (a fully masked row is NaN).

With ``live_attention`` (``LiveKeys``, ``attend_live``; CUDA in half precision, where a probe agrees with
the masked kernel) a forward over the cache skips the mask and the bucket: the flash kernel's
variable-length forward reads each row's slot in place up to the row's count, each (row, K/V head) pair one
sequence of the call with that head's group of query heads as its heads. Nothing past a row's count is
read, so a decode step costs what its rows' live lengths cost, and a prefill chunk over the cache needs no
gather of its rows' slots and no per-shape plan.

``SlotCache.attend`` calls these kernels; ``layer_attention`` is how the model's attention modules reach it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel


def fused_kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused attention kernels (cuDNN's, flash) can run: CUDA in half precision."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def sdpa_backends(device: torch.device, dtype: torch.dtype) -> list[SDPBackend]:
    """Kernels to try, best first: cuDNN on CUDA in half precision, else the math kernel."""
    if fused_kernels_run(device, dtype):
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.MATH]


def causal_backends(device: torch.device, dtype: torch.dtype) -> list[SDPBackend]:
    """Kernels for a causal block over its own keys (no mask): flash first on CUDA in half precision (it
    takes GQA, and needs no per-shape plan, which prefill shapes would otherwise pay per call)."""
    if fused_kernels_run(device, dtype):
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
    """Which keys each row of a forward over the slot cache attends over, laid out for the flash kernel's
    variable-length call (``attend_live``): built once a forward, read by every layer. Each (row, K/V head)
    pair is one sequence of the call: its queries the row's S tokens, its heads that K/V head's group of
    query heads (GQA read in place), its keys the plane of the row's slot at that head, positions
    0..count−1 and nothing past them (no attention over padding, no gather of the cache). With S > 1 the
    queries are causal and aligned to the end of the keys: query s sees positions 0..count−S+s."""

    seqused_k: Tensor
    """int32 [N·Hk]: keys of each (row, head) sequence (the row's count, repeated per head)."""
    cu_seqlens_q: Tensor
    """int32 [N·Hk + 1]: S queries a sequence."""
    cu_seqlens_k: Tensor
    """int32 [N·Hk + 1]: where each sequence's plane starts in the cache flattened to positions (in any
    order: the kernel reads a sequence's start and ``seqused_k``, never the next start)."""
    queries: int
    """S."""
    max_keys: int
    """No count is larger (the slot capacity L)."""


def live_keys(
    slots_N: Tensor | None, key_counts_N: Tensor, *, queries: int, num_kv_heads: int, capacity: int
) -> LiveKeys:
    """``LiveKeys`` of rows reading slots ``slots_N`` (None: row n is slot n) over positions 0..count−1,
    in a cache of ``capacity`` positions a (slot, head) plane."""
    n, hk = key_counts_N.shape[0], num_kv_heads
    device = key_counts_N.device
    slot_N = torch.arange(n, device=device) if slots_N is None else slots_N
    plane_T = (slot_N[:, None] * hk + torch.arange(hk, device=device)[None, :]).reshape(-1)
    end = plane_T[-1:] + 1  # the kernel reads a sequence's start alone: any value ends the list
    return LiveKeys(
        seqused_k=key_counts_N.to(torch.int32).repeat_interleave(hk),
        cu_seqlens_q=torch.arange(n * hk + 1, device=device, dtype=torch.int32) * queries,
        cu_seqlens_k=(torch.cat([plane_T, end]) * capacity).to(torch.int32),
        queries=queries,
        max_keys=capacity,
    )


def grouped_layout(q_NHSD: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The flash kernel's variable-length layout of the rows' queries over a whole slot cache, with no copy
    of K/V: queries [N·Hk·S, G, D] (sequence (n, h) holds row n's S tokens, its heads the query heads of K/V
    head h: transformers' GQA pairs query head j with K/V head j // G), keys and values the cache
    [slots, Hk, L, D] viewed as [slots·Hk·L, 1, D] (``LiveKeys.cu_seqlens_k`` picks the planes)."""
    n, hq, s, d = q_NHSD.shape
    hk = k_cache.shape[1]
    assert k_cache.is_contiguous(), k_cache.stride()
    assert v_cache.is_contiguous(), v_cache.stride()
    q = q_NHSD.reshape(n, hk, hq // hk, s, d).transpose(2, 3).reshape(n * hk * s, hq // hk, d)
    return q, k_cache.view(-1, 1, d), v_cache.view(-1, 1, d)


def attend_live(
    q_NHSD: Tensor, k_cache: Tensor, v_cache: Tensor, live: LiveKeys, *, scale: float | None = None
) -> Tensor:
    """[N, S, Hq, D] (transformers' attention output layout): each row's queries over its own live keys
    alone, K/V read in place from the whole cache (CUDA, half precision: the flash kernel's
    variable-length forward with per-sequence used key counts)."""
    n, hq, s, d = q_NHSD.shape
    hk = k_cache.shape[1]
    q, k, v = grouped_layout(q_NHSD, k_cache, v_cache)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, live.cu_seqlens_q, live.cu_seqlens_k, s, live.max_keys, 0.0, s > 1, False,
        scale=scale, seqused_k=live.seqused_k,
    )[0]  # fmt: skip
    return out.view(n, hk, s, hq // hk, d).transpose(1, 2).reshape(n, s, hq, d)


def flash_reads_live_lengths(
    device: torch.device, dtype: torch.dtype, *, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether ``attend_live`` runs here and agrees with the masked math kernel on a small case, one query
    a row and a causal block alike, rows reading slots out of order (CUDA in half precision with a torch
    whose flash forward takes ``seqused_k``); else the padded path."""
    if not fused_kernels_run(device, dtype):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    cap = 256
    k = torch.randn((4, num_kv_heads, cap, head_dim), generator=gen, device=device, dtype=dtype)
    v = torch.randn((4, num_kv_heads, cap, head_dim), generator=gen, device=device, dtype=dtype)
    slots = torch.tensor([2, 0, 3], device=device)
    counts = torch.tensor([4, 70, 200], device=device)
    for s in (1, 4):
        q = torch.randn((3, num_heads, s, head_dim), generator=gen, device=device, dtype=dtype)
        try:
            live = live_keys(slots, counts, queries=s, num_kv_heads=num_kv_heads, capacity=cap)
            got = attend_live(q, k, v, live)
        except (RuntimeError, TypeError):
            return False
        want = masked_live_reference(q.float(), k.float(), v.float(), slots, counts)
        if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
            return False
    return True


def masked_live_reference(
    q_NHSD: Tensor, k_cache: Tensor, v_cache: Tensor, slots_N: Tensor, counts_N: Tensor
) -> Tensor:
    """[N, S, Hq, D]: what ``attend_live`` computes, by the math kernel over each row's gathered slot with a
    mask (query s of a row sees positions 0..count−S+s)."""
    s = q_NHSD.shape[2]
    p_L = torch.arange(k_cache.shape[2], device=q_NHSD.device)
    last_NS = counts_N[:, None] - s + torch.arange(s, device=q_NHSD.device)[None, :]
    mask = (p_L[None, None, :] <= last_NS[:, :, None])[:, None]
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(
            q_NHSD, k_cache[slots_N], v_cache[slots_N], attn_mask=mask,
            enable_gqa=q_NHSD.shape[1] != k_cache.shape[1],
        )  # fmt: skip
    return out.transpose(1, 2)


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
