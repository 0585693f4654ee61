"""Labels, the decayed cross-entropy and a memory-safe chunked LM-head loss (docs/drafter.md#labels-and-loss).

Legend: T tokens of the packed row, A anchors, B block size, K = B−1 draft positions (k = 1..B−1),
N loss rows, H hidden, V vocabulary.

Labels are not shifted: block position k predicts x[a+k], the token at the same position. Position 0
(the anchor itself) carries no loss; neither do positions past the end of the anchor's document nor
positions with loss_mask 0. Loss = Σ w_k·m·CE / Σ w_k·m with w_k = exp(−(k−1)/γ).

Metrics: ``acc_k`` = accuracy of block position k over the rows that carry loss there. The simulated
acceptance length here follows eval's convention, τ = accepted drafts + 1 (docs/drafter.md#metrics):
``simulated_acceptance_length(acc) = 1 + Σ_k Π_{i≤k} acc_i``; the accepted drafts alone, Σ_k Π_{i≤k} acc_i,
are ``simulated_acceptance_length(acc, include_bonus=False)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def decay_weights(block_size: int, gamma: float, *, device: torch.device | str | None = None) -> Tensor:
    """float32 [B]: 0 at position 0, exp(−(k−1)/γ) at positions k = 1..B−1. One cached tensor per
    (B, γ, device): callers must not modify it."""
    return _decay_weights(block_size, float(gamma), torch.device(device) if device is not None else None)


@functools.lru_cache(maxsize=32)
def _decay_weights(block_size: int, gamma: float, device: torch.device | None) -> Tensor:
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    # torch.where, not ``w[0] = 0.0``: assigning a Python number into a CUDA tensor is a blocking
    # host-to-device copy, a host sync (twice a microbatch before this was cached).
    return torch.where(k >= 1, w, torch.zeros_like(w))


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockLabels:
    """What each block position must predict, and whether it counts."""

    label_ids_AB: Tensor
    """int64 [A, B]: x[a+k] (clamped to the row end where a+k runs past it)."""
    valid_AB: Tensor
    """bool [A, B]: k ≥ 1, a+k inside the anchor's document and loss_mask[a+k] = 1."""


def block_labels(
    input_ids_T: Tensor, loss_mask_T: Tensor, doc_ids_T: Tensor, anchors_A: Tensor, block_size: int
) -> BlockLabels:
    """Unshifted labels of every block position (see module docstring)."""
    safe_AB, valid_AB = _block_positions(loss_mask_T, doc_ids_T, anchors_A, block_size)
    return BlockLabels(label_ids_AB=input_ids_T[safe_AB], valid_AB=valid_AB)


def _block_positions(
    loss_mask_T: Tensor, doc_ids_T: Tensor, anchors_A: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """(row index of each block position clamped into the row, whether it carries loss), both [A, B]."""
    T = loss_mask_T.shape[0]
    k_B = torch.arange(block_size, device=anchors_A.device)
    idx_AB = anchors_A[:, None] + k_B[None, :]
    in_row = idx_AB < T
    safe = idx_AB.clamp(max=T - 1)
    same_doc = doc_ids_T[safe] == doc_ids_T[anchors_A][:, None]
    valid = in_row & same_doc & loss_mask_T.to(torch.bool)[safe] & (k_B[None, :] >= 1)
    return safe, valid


def loss_rows(loss_mask_T: Tensor, doc_ids_T: Tensor, anchors_A: Tensor, block_size: int) -> Tensor:
    """int64 [N]: the flat indices j·B + k (ascending) of the block positions that carry loss, i.e.
    ``nonzero(valid_AB)``. Its length is data-dependent: on a GPU ``nonzero`` waits for the device, so
    the prefetcher computes it on the host while packing and hands it over with the batch."""
    _safe, valid_AB = _block_positions(loss_mask_T, doc_ids_T, anchors_A, block_size)
    return torch.nonzero(valid_AB.reshape(-1)).flatten()


def decayed_cross_entropy(logits_ABV: Tensor, labels_AB: Tensor, valid_AB: Tensor, *, gamma: float) -> Tensor:
    """Reference loss from full logits: Σ w_k·m·CE / Σ w_k·m (0 when no position counts).

    Materialises [A, B, V]; the model uses ``linear_cross_entropy`` over chunks instead.
    """
    _A, B, V = logits_ABV.shape
    w_AB = decay_weights(B, gamma, device=logits_ABV.device)[None, :] * valid_AB.float()
    ce = F.cross_entropy(logits_ABV.reshape(-1, V).float(), labels_AB.reshape(-1), reduction="none")
    total = w_AB.sum()
    return (ce * w_AB.reshape(-1)).sum() / total.clamp_min(torch.finfo(torch.float32).tiny)


class _ChunkedLinearCE(torch.autograd.Function):
    """Σ_i w_i·CE(h_i·Wᵀ, y_i) computed chunk by chunk; dL/dh is formed in the same pass.

    Only [chunk, V] logits exist at any time. The head W is frozen (no gradient). The gradient of the
    weighted sum with respect to h is Σ_i w_i (softmax_i − onehot_i) W, computed while the chunk's
    logits are at hand and kept ([N, H] float32), so the backward pass is a scaling: no recompute.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_NH: Tensor,
        head_VH: Tensor,
        labels_N: Tensor,
        weights_N: Tensor,
        chunk_rows: int,
        need_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        N = hidden_NH.shape[0]
        dev = hidden_NH.device
        total = torch.zeros((), dtype=torch.float32, device=dev)
        preds_N = torch.empty(N, dtype=torch.int64, device=dev)
        grad_NH = torch.zeros(N, hidden_NH.shape[1], dtype=torch.float32, device=dev) if need_grad else None
        with torch.autocast(dev.type, enabled=False):
            h = hidden_NH.to(head_VH.dtype)
            for s in range(0, N, chunk_rows):
                e = min(s + chunk_rows, N)
                logits = (h[s:e] @ head_VH.T).float()
                lse = torch.logsumexp(logits, dim=-1)
                y = labels_N[s:e]
                w = weights_N[s:e].float()
                ce = lse - logits.gather(1, y[:, None])[:, 0]
                total += (ce * w).sum()
                preds_N[s:e] = logits.argmax(dim=-1)
                if grad_NH is not None:
                    probs = logits.sub_(lse[:, None]).exp_()
                    probs[torch.arange(e - s, device=dev), y] -= 1.0
                    probs.mul_(w[:, None])
                    grad_NH[s:e] = (probs.to(head_VH.dtype) @ head_VH).float()
        ctx.save_for_backward(grad_NH if grad_NH is not None else torch.empty(0, device=dev))
        ctx.hidden_dtype = hidden_NH.dtype
        ctx.mark_non_differentiable(preds_N)
        return total, preds_N

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, _grad_preds: Tensor) -> tuple[Tensor | None, ...]:
        (grad_NH,) = ctx.saved_tensors
        return (grad_NH * grad_total).to(ctx.hidden_dtype), None, None, None, None, None


def linear_cross_entropy(
    hidden_NH: Tensor, head_VH: Tensor, labels_N: Tensor, weights_N: Tensor, *, chunk_rows: int = 1024
) -> tuple[Tensor, Tensor]:
    """(Σ w_i·CE_i as a float32 scalar with gradient to ``hidden_NH``, argmax predictions int64 [N])."""
    need_grad = torch.is_grad_enabled() and hidden_NH.requires_grad
    total, preds = _ChunkedLinearCE.apply(hidden_NH, head_VH, labels_N, weights_N, chunk_rows, need_grad)
    return total, preds


@torch.no_grad()
def linear_argmax(hidden_NH: Tensor, head_VH: Tensor, *, chunk_rows: int = 1024) -> Tensor:
    """int64 [N]: argmax of h_i·Wᵀ, computed as ``linear_cross_entropy``'s predictions are (``hidden_NH``
    cast to the head's dtype, float32 logits, autocast off) and, like them, ``chunk_rows`` rows at a time:
    [chunk, V] logits at most."""
    N = hidden_NH.shape[0]
    dev = hidden_NH.device
    preds_N = torch.empty(N, dtype=torch.int64, device=dev)
    with torch.autocast(dev.type, enabled=False):
        h = hidden_NH.to(head_VH.dtype)
        for s in range(0, N, chunk_rows):
            e = min(s + chunk_rows, N)
            preds_N[s:e] = (h[s:e] @ head_VH.T).float().argmax(dim=-1)
    return preds_N


def position_accuracy(correct_K: Tensor, total_K: Tensor) -> Tensor:
    """float64 [K]: acc_k = correct_k / total_k (NaN where no position k carried loss); sum the
    counts over microbatches and ranks first."""
    total = total_K.double()
    nan = torch.full_like(total, float("nan"))
    return torch.where(total > 0, correct_K.double() / total.clamp_min(1), nan)


def simulated_acceptance_length(acc_K: Sequence[float] | Tensor, *, include_bonus: bool = True) -> float:
    """1 + Σ_k Π_{i≤k} acc_i (τ convention: accepted drafts + the target's bonus token);
    without the bonus: Σ_k Π_{i≤k} acc_i, the expected accepted drafts. A NaN accuracy (no position
    of that index carried loss) ends the sum."""
    values = acc_K.tolist() if isinstance(acc_K, Tensor) else list(acc_K)
    total, running = 0.0, 1.0
    for acc in values:
        if math.isnan(acc):
            break
        running *= acc
        total += running
    return total + (1.0 if include_bonus else 0.0)
