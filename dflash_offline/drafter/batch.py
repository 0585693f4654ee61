"""The drafter's packed training input: several documents in one row, with their anchors.

Legend: T tokens of the packed row (documents back to back, optionally padding at the end),
F = n·H feature width, A anchors (block starts) over all documents of the row.

A feature row p is the target's residual stream after token x[p] (unshifted:
docs/drafter.md#captured-layers), so the block anchored at a sees the features of its own document at
positions < a only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_offline.errors import DataError

PAD_DOC_ID = -1
"""doc_ids_T value of padding tokens: they belong to no document and are never visible."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DocumentTensors:
    """One document (sample) before packing."""

    input_ids_T: Tensor
    """int64 [T]: token ids."""
    features_TF: Tensor
    """bf16/float [T, F]: target features, row p taken after token p."""
    loss_mask_T: Tensor
    """bool [T]: True where the token is a trained (assistant) token."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterInputs:
    """One packed row of documents and the anchors to train on; the input of ``forward_train``."""

    input_ids_T: Tensor
    """int64 [T]: token ids of all documents back to back (padding: any valid id)."""
    features_TF: Tensor
    """bf16/float [T, F]: target features of each token (padding rows: anything finite)."""
    loss_mask_T: Tensor
    """bool [T]: True on trained tokens; False on prompts and padding."""
    doc_ids_T: Tensor
    """int32 [T]: document index within the row (0, 1, ...; contiguous runs); PAD_DOC_ID on padding."""
    positions_T: Tensor
    """int32 [T]: position of the token inside its document (0 at each document start)."""
    anchors_A: Tensor
    """int64 [A]: ascending indices into T where blocks start (see ``anchors.sample_anchors``)."""
    loss_rows_N: Tensor | None = None
    """int64 [N]: ``loss.loss_rows`` of these anchors (the block positions that carry loss), computed
    on the host ahead of time so that the forward needs no device sync; None: the forward computes it."""

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.input_ids_T.shape[0])

    @property
    def num_anchors(self) -> int:
        """A."""
        return int(self.anchors_A.shape[0])

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> DrafterInputs:
        """All tensors moved to ``device``."""
        return DrafterInputs(
            input_ids_T=self.input_ids_T.to(device, non_blocking=non_blocking),
            features_TF=self.features_TF.to(device, non_blocking=non_blocking),
            loss_mask_T=self.loss_mask_T.to(device, non_blocking=non_blocking),
            doc_ids_T=self.doc_ids_T.to(device, non_blocking=non_blocking),
            positions_T=self.positions_T.to(device, non_blocking=non_blocking),
            anchors_A=self.anchors_A.to(device, non_blocking=non_blocking),
            loss_rows_N=None
            if self.loss_rows_N is None
            else self.loss_rows_N.to(device, non_blocking=non_blocking),
        )

    def validate(self, *, feature_width: int | None = None, check_values: bool = False) -> None:
        """Raise ``DataError`` on inconsistent shapes/dtypes; ``check_values`` also checks contents
        (anchors inside documents, positions restarting at document starts) at the cost of a sync."""
        T = self.num_tokens
        for name in ("input_ids_T", "loss_mask_T", "doc_ids_T", "positions_T"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != T:
                raise DataError(f"{name} has shape {tuple(t.shape)}; expected [{T}] like input_ids_T")
        if self.features_TF.dim() != 2 or self.features_TF.shape[0] != T:
            raise DataError(f"features_TF has shape {tuple(self.features_TF.shape)}; expected [{T}, F]")
        if feature_width is not None and self.features_TF.shape[1] != feature_width:
            raise DataError(
                f"features are {self.features_TF.shape[1]} wide but the drafter expects {feature_width} "
                "(n target layers × hidden size): the cache and the drafter config disagree on layer ids"
            )
        if self.anchors_A.dim() != 1 or self.anchors_A.dtype != torch.int64:
            raise DataError(f"anchors_A must be int64 [A], got {self.anchors_A.dtype} {self.anchors_A.shape}")
        if self.input_ids_T.dtype != torch.int64:
            raise DataError(f"input_ids_T must be int64, got {self.input_ids_T.dtype}")
        rows = self.loss_rows_N
        if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
            raise DataError(f"loss_rows_N must be int64 [N], got {rows.dtype} {tuple(rows.shape)}")
        if not check_values:
            return
        a = self.anchors_A
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= T):
            raise DataError(f"anchors outside [0, {T}): min {int(a.min())}, max {int(a.max())}")
        if a.numel() > 1 and bool((a[1:] <= a[:-1]).any()):
            raise DataError("anchors_A must be strictly ascending")
        if a.numel() and bool((self.doc_ids_T[a] < 0).any()):
            raise DataError("an anchor lies on a padding token (doc_ids_T < 0)")
        starts = torch.ones(T, dtype=torch.bool, device=self.doc_ids_T.device)
        starts[1:] = self.doc_ids_T[1:] != self.doc_ids_T[:-1]
        idx = torch.arange(T, device=self.positions_T.device)
        start_idx = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=0).values
        expected = (idx - start_idx).to(self.positions_T.dtype)
        real = self.doc_ids_T >= 0
        if not bool((self.positions_T[real] == expected[real]).all()):
            raise DataError("positions_T must count 0, 1, ... from each document start")


def pack_documents(
    documents: Sequence[DocumentTensors], *, pad_to: int | None = None, anchors_A: Tensor | None = None
) -> DrafterInputs:
    """Concatenate documents into one row (doc ids 0.., positions restarting per document).

    ``pad_to`` appends padding tokens (doc id PAD_DOC_ID, loss mask False, zero features) up to that
    length. Anchors default to none; draw them with ``anchors.sample_anchors``.
    """
    if not documents:
        raise DataError("pack_documents needs at least one document")
    ids, feats, masks, docs, pos = [], [], [], [], []
    for d, doc in enumerate(documents):
        n = int(doc.input_ids_T.shape[0])
        if n == 0:
            raise DataError(f"document {d} is empty")
        ids.append(doc.input_ids_T.to(torch.int64))
        feats.append(doc.features_TF)
        masks.append(doc.loss_mask_T.to(torch.bool))
        docs.append(torch.full((n,), d, dtype=torch.int32))
        pos.append(torch.arange(n, dtype=torch.int32))
    total = sum(int(i.shape[0]) for i in ids)
    if pad_to is not None and pad_to > total:
        extra = pad_to - total
        ids.append(torch.zeros(extra, dtype=torch.int64))
        feats.append(torch.zeros(extra, feats[0].shape[1], dtype=feats[0].dtype))
        masks.append(torch.zeros(extra, dtype=torch.bool))
        docs.append(torch.full((extra,), PAD_DOC_ID, dtype=torch.int32))
        pos.append(torch.zeros(extra, dtype=torch.int32))
    return DrafterInputs(
        input_ids_T=torch.cat(ids),
        features_TF=torch.cat(feats),
        loss_mask_T=torch.cat(masks),
        doc_ids_T=torch.cat(docs),
        positions_T=torch.cat(pos),
        anchors_A=anchors_A if anchors_A is not None else torch.zeros(0, dtype=torch.int64),
    )
