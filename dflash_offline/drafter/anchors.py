"""Anchor sampling: where the training blocks start (docs/drafter.md#anchors).

Legend: T tokens of the packed row, E eligible positions, A chosen anchors.

Eligible anchors are {a : loss_mask[a] = 1 and loss_mask[a+1] = 1, a+1 in the same document}: the
anchor token x[a] is a trained token and the block's first draft x[a+1] carries loss. Per document up
to ``num_anchors`` eligible positions are drawn uniformly without replacement (the k smallest of i.i.d.
uniform keys form a uniform k-subset). The draw depends only on the row and the generator's state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_offline.errors import ConfigError


def eligible_anchor_mask(loss_mask_T: Tensor, doc_ids_T: Tensor | None = None) -> Tensor:
    """bool [T]: positions that may start a block."""
    mask = loss_mask_T.to(torch.bool)
    out = torch.zeros_like(mask)
    if mask.shape[0] < 2:
        return out
    ok = mask[:-1] & mask[1:]
    if doc_ids_T is not None:
        ok &= (doc_ids_T[:-1] == doc_ids_T[1:]) & (doc_ids_T[:-1] >= 0)
    out[:-1] = ok
    return out


def sample_anchors(
    loss_mask_T: Tensor,
    doc_ids_T: Tensor | None = None,
    *,
    num_anchors: int,
    generator: torch.Generator,
    max_total: int | None = None,
) -> Tensor:
    """int64 [A], ascending: up to ``num_anchors`` anchors per document, on ``loss_mask_T``'s device.

    Without ``doc_ids_T`` the row is one document. ``max_total`` caps the whole row (a row packed
    with many short documents would otherwise get num_anchors each): the per-document draw is then
    subsampled uniformly. Random numbers are drawn on the generator's device, so a CPU generator
    gives the same anchors whatever device the row is on.
    """
    if num_anchors <= 0 or (max_total is not None and max_total <= 0):
        raise ConfigError(f"num_anchors={num_anchors} and max_total={max_total} must be positive")
    device = loss_mask_T.device
    eligible_E = torch.nonzero(eligible_anchor_mask(loss_mask_T, doc_ids_T)).flatten()
    if eligible_E.numel() == 0:
        return eligible_E.to(torch.int64)
    gen_device = generator.device
    keys_E = torch.rand(eligible_E.numel(), generator=generator, device=gen_device).to(device)
    if doc_ids_T is None:
        docs_E = torch.zeros_like(eligible_E)
    else:
        docs_E = doc_ids_T[eligible_E].to(torch.int64)
    # Group by document, random order inside each group: sort by key, then stably by document.
    by_key = torch.argsort(keys_E)
    by_doc = torch.sort(docs_E[by_key], stable=True).indices
    order = by_key[by_doc]
    docs_sorted = docs_E[order]
    idx = torch.arange(order.numel(), device=device)
    new_group = torch.ones_like(docs_sorted, dtype=torch.bool)
    new_group[1:] = docs_sorted[1:] != docs_sorted[:-1]
    group_start = torch.cummax(torch.where(new_group, idx, torch.zeros_like(idx)), dim=0).values
    keep = (idx - group_start) < num_anchors
    chosen = eligible_E[order[keep]]
    if max_total is not None and chosen.numel() > max_total:
        keys = torch.rand(chosen.numel(), generator=generator, device=gen_device).to(device)
        chosen = chosen[torch.argsort(keys)[:max_total]]
    return torch.sort(chosen).values.to(torch.int64)
