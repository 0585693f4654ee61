"""The DFlash training attention mask, as a flex_attention BlockMask (CUDA) or a dense boolean mask.

Legend: T tokens of the packed row, A anchors, B block size, Q = A·B queries (padded to Qp),
S = T + Q key slots (padded to Sp), D head dim.

Queries are the block tokens, block j (anchor a_j) occupying rows j·B .. j·B+B−1. Keys are
[context rows 0..T−1 ; block rows T .. T+Q−1]. A query of block j sees (docs/drafter.md#attention-mask):
  - context row c iff doc(c) == doc(a_j) and pos(c) < pos(a_j)   (strictly before the anchor),
  - block row T + i·B + m iff i == j                            (its whole block, bidirectional),
  - nothing else: no other document, no other block, no padding.
Both backends evaluate the same ``mask_mod`` over per-query and per-key index vectors, so they
cannot drift apart; tests compare them with a brute-force reference built position by position.

Padding query rows (added so that flex sees few distinct shapes) would be fully masked; they see key
slot 0 instead and their outputs are dropped, so no kernel ever meets a fully masked row from the
model. ``attend`` additionally guards fully masked rows of any dense mask (zero output, no NaN in
forward or backward).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_offline.errors import ConfigError
from dflash_offline.interrupt import stop_requested

AttentionBackend = Literal["auto", "flex", "sdpa"]

# Sentinels of the index vectors: no real query or key carries them, so they never compare equal to a
# real document/block id (data doc ids are >= -1, block ids >= 0).
_CTX_KEY_BLOCK = -2  # block id of context keys
_BLOCK_KEY_DOC = -3  # document id of block keys
_PAD_QUERY = -4  # document and block id of padding queries
_PAD_KEY = -5  # document and block id of padding keys
FLEX_BLOCK = 128  # flex_attention's sparse block size; padded lengths are multiples of it


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionIndex:
    """Per-query and per-key-slot ids from which the mask is evaluated (all on the row's device)."""

    q_doc_Q: Tensor
    """int32 [Qp]: document of each query's anchor; _PAD_QUERY on padding."""
    q_pos_Q: Tensor
    """int32 [Qp]: position of each query's anchor in its document."""
    q_block_Q: Tensor
    """int32 [Qp]: block index j of each query; _PAD_QUERY on padding."""
    kv_doc_S: Tensor
    """int32 [Sp]: document of context keys; _BLOCK_KEY_DOC on block keys, _PAD_KEY on padding."""
    kv_pos_S: Tensor
    """int32 [Sp]: position of context keys in their document (0 elsewhere)."""
    kv_block_S: Tensor
    """int32 [Sp]: block index of block keys; _CTX_KEY_BLOCK on context keys, _PAD_KEY on padding."""
    q_anchor_Q: Tensor
    """int32 [Qp]: row index a of each query's anchor (0 on padding): its context keys are the rows
    a − pos(a) .. a − 1, its document's start up to the anchor (documents are contiguous runs)."""
    block_size: int
    """B: queries (and block keys) per block."""
    num_queries: int
    """Q = A·B real queries (rows beyond are padding)."""
    num_keys: int
    """S = T + Q real key slots (slots beyond are padding)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_attention_index(
    doc_ids_T: Tensor, positions_T: Tensor, anchors_A: Tensor, *, block_size: int, pad_to: int = 1
) -> AttentionIndex:
    """Index vectors for a packed row; Q and S are padded up to multiples of ``pad_to``."""
    T, A, B = int(doc_ids_T.shape[0]), int(anchors_A.shape[0]), block_size
    Q, S = A * B, T + A * B
    Qp, Sp = _round_up(max(Q, 1), pad_to), _round_up(S, pad_to)
    dev = doc_ids_T.device
    i32 = torch.int32
    q_doc = torch.full((Qp,), _PAD_QUERY, dtype=i32, device=dev)
    q_pos = torch.zeros(Qp, dtype=i32, device=dev)
    q_block = torch.full((Qp,), _PAD_QUERY, dtype=i32, device=dev)
    q_doc[:Q] = doc_ids_T[anchors_A].to(i32).repeat_interleave(B)
    q_pos[:Q] = positions_T[anchors_A].to(i32).repeat_interleave(B)
    q_block[:Q] = torch.arange(A, dtype=i32, device=dev).repeat_interleave(B)
    q_anchor = torch.zeros(Qp, dtype=i32, device=dev)
    q_anchor[:Q] = anchors_A.to(i32).repeat_interleave(B)
    kv_doc = torch.full((Sp,), _PAD_KEY, dtype=i32, device=dev)
    kv_pos = torch.zeros(Sp, dtype=i32, device=dev)
    kv_block = torch.full((Sp,), _PAD_KEY, dtype=i32, device=dev)
    kv_doc[:T] = doc_ids_T.to(i32)
    kv_pos[:T] = positions_T.to(i32)
    kv_block[:T] = _CTX_KEY_BLOCK
    kv_doc[T:S] = _BLOCK_KEY_DOC
    kv_block[T:S] = torch.arange(A, dtype=i32, device=dev).repeat_interleave(B)
    return AttentionIndex(
        q_doc_Q=q_doc,
        q_pos_Q=q_pos,
        q_block_Q=q_block,
        kv_doc_S=kv_doc,
        kv_pos_S=kv_pos,
        kv_block_S=kv_block,
        q_anchor_Q=q_anchor,
        block_size=B,
        num_queries=Q,
        num_keys=S,
    )


def make_mask_mod(index: AttentionIndex) -> Callable[[Any, Any, Tensor, Tensor], Tensor]:
    """The visibility rule as a flex ``mask_mod(b, h, q_idx, kv_idx)``; also works on broadcast
    index tensors for the dense mask."""
    q_doc, q_pos, q_block = index.q_doc_Q, index.q_pos_Q, index.q_block_Q
    kv_doc, kv_pos, kv_block = index.kv_doc_S, index.kv_pos_S, index.kv_block_S

    def mask_mod(b: Any, h: Any, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        qd, qb = q_doc[q_idx], q_block[q_idx]
        context = (kv_doc[kv_idx] == qd) & (kv_pos[kv_idx] < q_pos[q_idx]) & (qd >= 0)
        own_block = (kv_block[kv_idx] == qb) & (qb >= 0)
        padding_query_dummy = (qb == _PAD_QUERY) & (kv_idx == 0)
        return context | own_block | padding_query_dummy

    return mask_mod


def dense_mask(index: AttentionIndex) -> Tensor:
    """bool [Qp, Sp]: True where the query sees the key."""
    dev = index.q_doc_Q.device
    q = torch.arange(index.q_doc_Q.shape[0], device=dev)[:, None]
    kv = torch.arange(index.kv_doc_S.shape[0], device=dev)[None, :]
    return make_mask_mod(index)(None, None, q, kv)


def flex_block_mask(index: AttentionIndex) -> Any:
    """The flex_attention BlockMask of the row (sparse over 128×128 tiles), equal to
    ``create_block_mask(make_mask_mod(index), …)`` (tests/drafter/test_attention_mask.py).

    ``create_block_mask`` evaluates the mask_mod at every one of the Qp × Sp (query, key) pairs to
    classify the tiles: 134M pairs and several [Qp, Sp] int32 temporaries for a microbatch of 8,192
    tokens and 512 anchors of 16, every microbatch. Here the tiles are classified from intervals
    instead: a real query sees exactly two runs of keys, its document's rows before the anchor
    [a − pos(a), a) and its own block [T + j·B, T + (j+1)·B); a padding query sees key 0. The number of
    visible pairs in a tile is the sum over its queries of each run's overlap with the tile's keys
    ([Qp, Sp / 128] work): a tile is full when every pair is visible, partial when some are."""
    from torch.nn.attention.flex_attention import BlockMask

    tile = FLEX_BLOCK
    Qp, Sp = int(index.q_doc_Q.shape[0]), int(index.kv_doc_S.shape[0])
    T, Q, dev = index.num_keys - index.num_queries, index.num_queries, index.q_doc_Q.device
    nq, nk = -(-Qp // tile), -(-Sp // tile)
    real_Q = torch.arange(Qp, device=dev) < Q
    anchor = index.q_anchor_Q.to(torch.int64)
    ctx_lo = torch.where(real_Q, anchor - index.q_pos_Q.to(torch.int64), 0)
    ctx_hi = torch.where(real_Q, anchor, 1)  # a padding query's one visible key: slot 0
    block = index.block_size
    blk_lo = torch.where(real_Q, T + index.q_block_Q.to(torch.int64).clamp_min(0) * block, 0)
    blk_hi = torch.where(real_Q, blk_lo + block, 0)
    start_K = torch.arange(nk, device=dev, dtype=torch.int64) * tile

    def overlap_QK(lo: Tensor, hi: Tensor) -> Tensor:
        return (torch.minimum(hi[:, None], start_K + tile) - torch.maximum(lo[:, None], start_K)).clamp_min(0)

    visible_QK = overlap_QK(ctx_lo, ctx_hi) + overlap_QK(blk_lo, blk_hi)
    visible_QK = F.pad(visible_QK, (0, 0, 0, nq * tile - Qp))  # queries of a partial last tile: none
    count_NK = visible_QK.view(nq, tile, nk).sum(1)
    full = count_NK == tile * tile
    partial = (count_NK > 0) & ~full
    kv_num, kv_indices = _ordered_blocks(partial)
    full_num, full_indices = _ordered_blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=tile,
        mask_mod=make_mask_mod(index),
        seq_lengths=(Qp, Sp),
    )


def _ordered_blocks(tiles_NK: Tensor) -> tuple[Tensor, Tensor]:
    """A BlockMask's (count, indices) of a bool tile map [nq, nk], with a batch and a head dimension of
    1: the same stable descending sort ``create_block_mask`` applies, so the tensors are identical."""
    dense = tiles_NK.to(torch.int32)[None, None]
    num = dense.sum(dim=-1).to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), indices.contiguous()


def sdpa_attend(q: Tensor, k: Tensor, v: Tensor, mask_QS: Tensor) -> Tensor:
    """SDPA with a boolean mask; fully masked rows give 0 (finite forward and backward on any kernel).

    q [1, Hq, Q, D], k/v [1, Hk, S, D], mask [Q, S].
    """
    has_key_Q = mask_QS.any(dim=-1)
    # A fully masked row would softmax over nothing (NaN on some kernels); let it see every key,
    # then zero its output: the product with 0 also zeroes every gradient through that row.
    safe = mask_QS | ~has_key_Q[:, None]
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.device.type == "cuda":
        # With a mask, CUDA's memory-efficient kernel takes no GQA and SDPA would fall back to the
        # math kernel (Q×S scores per head in memory): repeat the KV heads instead.
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, enable_gqa=gqa)
    return out * has_key_Q[:, None].to(out.dtype)


_compiled_flex: Any = None
"""The compiled kernel, a cache only: whether a model still uses flex is its ``FlexFallback``'s say."""


class FlexFallbackWarning(RuntimeWarning):
    """A model's compiled flex_attention failed: it runs dense SDPA from then on."""


class FlexFallback:
    """One model's record of a compiled flex_attention failure. The failing forward and every later
    forward of that model run dense SDPA (the same mask, more memory), and a ``FlexFallbackWarning``
    says so once, naming the error. Per model, not per process: another model tries flex afresh. A
    failure while a stop is requested (``dflash_offline/interrupt.py``) is not recorded: only its forward
    runs SDPA (see ``TrainingAttention.__call__``)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        """The error that made the model leave flex, None while it has not."""

    @property
    def failed(self) -> bool:
        return self.reason is not None

    @staticmethod
    def covers(device: torch.device) -> bool:
        """Only CUDA's compiled kernel may fail over: off CUDA flex is eager, and a failure is a bug."""
        return device.type == "cuda"

    def record(self, exc: Exception) -> None:
        if self.reason is None:
            warnings.warn(
                FlexFallbackWarning(
                    f"compiled flex_attention failed ({type(exc).__name__}: {exc}); this model trains "
                    "with dense SDPA attention from now on (pass --attention sdpa to skip flex)"
                ),
                stacklevel=3,
            )
        self.reason = f"{type(exc).__name__}: {exc}"


def _flex_kernel(device: torch.device) -> Callable[..., Tensor]:
    """Compiled flex_attention on CUDA (compiled once per process), eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex  # type: ignore[no-any-return]


def flex_attend(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    """flex_attention with the BlockMask (q/k/v padded to the mask's lengths by the caller)."""
    kernel = _flex_kernel(q.device)
    with warnings.catch_warnings():
        # Off CUDA flex runs unfused (forward only); its warning says so on every first call.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out  # type: ignore[no-any-return]


class TrainingAttention:
    """The attend function of one training forward: pads q/k/v, applies the mask, un-pads."""

    def __init__(
        self, index: AttentionIndex, backend: Literal["flex", "sdpa"], fallback: FlexFallback | None = None
    ) -> None:
        """``fallback``: the model's record; without one a flex failure propagates."""
        self.index = index
        self.backend = backend
        self.fallback = fallback
        self._block_mask: Any = flex_block_mask(index) if backend == "flex" else None
        self._dense: Tensor | None = dense_mask(index) if backend == "sdpa" else None

    def dense(self) -> Tensor:
        """The dense mask (built on first use when the flex path had to fall back)."""
        if self._dense is None:
            self._dense = dense_mask(self.index)
        return self._dense

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        Q, S = self.index.num_queries, self.index.num_keys
        assert q.shape[2] == Q, (q.shape, Q)
        assert k.shape[2] == S, (k.shape, S)
        Qp, Sp = int(self.index.q_doc_Q.shape[0]), int(self.index.kv_doc_S.shape[0])
        q = F.pad(q, (0, 0, 0, Qp - Q))
        k = F.pad(k, (0, 0, 0, Sp - S))
        v = F.pad(v, (0, 0, 0, Sp - S))
        if self.backend == "flex":
            try:
                return flex_attend(q, k, v, self._block_mask)[:, :, :Q]
            except Exception as exc:  # a torch.compile/Triton failure must not kill the run
                if self.fallback is None or not self.fallback.covers(q.device):
                    raise
                if not stop_requested():
                    self.fallback.record(exc)
                # else: a Ctrl-C (or a deadline's SIGINT) reaches the compiler's subprocesses too, and
                # ptxas dying of it says nothing about flex: this forward finishes on SDPA so that the
                # step can end and the run stop, checkpointed, and the model keeps flex.
                self.backend = "sdpa"
        return sdpa_attend(q, k, v, self.dense())[:, :, :Q]


def resolve_backend(
    backend: AttentionBackend, device: torch.device, *, requires_grad: bool, flex_failed: bool = False
) -> str:
    """'auto' → flex on CUDA, sdpa elsewhere; flex off CUDA is allowed only without gradients
    (torch has no CPU flex backward). ``flex_failed`` (the model's ``FlexFallback``, which warned
    when it happened): sdpa, whether flex was asked for or chosen."""
    if backend == "auto":
        return "flex" if device.type == "cuda" and not flex_failed else "sdpa"
    if backend == "flex" and device.type != "cuda" and requires_grad:
        raise ConfigError("flex_attention has no backward off CUDA; use attention='sdpa' for training")
    if backend == "flex" and flex_failed:
        return "sdpa"
    return backend
