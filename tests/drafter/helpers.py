"""Tiny drafters, random packed rows and brute-force attention references for the drafter tests (CPU)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dflash_offline.drafter import (
    DFlashDrafter,
    DocumentTensors,
    DrafterConfig,
    DrafterInputs,
    pack_documents,
)
from dflash_offline.drafter.anchors import sample_anchors

VOCAB = 61
HIDDEN = 32
NUM_FEATURES = 2


def tiny_config(*, block_size: int = 4, num_layers: int = 2, **overrides: object) -> DrafterConfig:
    """2 layers, hidden 32, 4 query heads over 2 KV heads (GQA), 2 target layers of features."""
    fields: dict[str, object] = {
        "hidden_size": HIDDEN,
        "num_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "block_size": block_size,
        "target_layer_ids": (1, 3),
        "num_target_layers": 5,
        "mask_token_id": VOCAB - 1,
        "max_position_embeddings": 256,
    }
    fields.update(overrides)
    return DrafterConfig(**fields)  # type: ignore[arg-type]


def tiny_drafter(config: DrafterConfig | None = None, *, seed: int = 0, tied: bool = False) -> DFlashDrafter:
    """A drafter with random weights (std 0.2 so that attention is far from uniform)."""
    config = config or tiny_config()
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=g)
    head = embed if tied else torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.3
    model = DFlashDrafter(config, embed_VH=embed, lm_head_VH=head)
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
        else:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return model


def random_row(
    lengths: list[int],
    *,
    seed: int,
    pad: int = 0,
    num_anchors: int = 4,
    extra_anchors: str = "",
    feature_width: int = NUM_FEATURES * HIDDEN,
    loss_prob: float = 0.7,
) -> DrafterInputs:
    """Documents of the given lengths packed in one row (plus ``pad`` padding tokens), anchors drawn
    with ``sample_anchors``; ``extra_anchors`` adds 'starts' (each document's first token) and/or
    'ends' (each document's last token, so the block runs past the document end)."""
    g = torch.Generator().manual_seed(seed)
    docs = [
        DocumentTensors(
            input_ids_T=torch.randint(0, VOCAB - 1, (n,), generator=g),
            features_TF=torch.randn(n, feature_width, generator=g),
            loss_mask_T=torch.rand(n, generator=g) < loss_prob,
        )
        for n in lengths
    ]
    row = pack_documents(docs, pad_to=sum(lengths) + pad)
    anchors = sample_anchors(row.loss_mask_T, row.doc_ids_T, num_anchors=num_anchors, generator=g)
    extra = []
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    if "starts" in extra_anchors:
        extra += starts.tolist()
    if "ends" in extra_anchors:
        extra += (starts + torch.tensor(lengths) - 1).tolist()
    if extra:
        anchors = torch.unique(torch.cat([anchors, torch.tensor(extra, dtype=torch.int64)]))
    row = replace(row, anchors_A=anchors, loss_rows_N=None)
    row.validate(check_values=True, feature_width=feature_width)
    return row


def brute_force_mask(row: DrafterInputs, block_size: int) -> torch.Tensor:
    """bool [A·B, T + A·B] from the rule, one (query, key) pair at a time, with plain Python ints."""
    docs = row.doc_ids_T.tolist()
    pos = row.positions_T.tolist()
    anchors = row.anchors_A.tolist()
    T, A, B = len(docs), len(anchors), block_size
    rows = []
    for j, a in enumerate(anchors):
        for _m in range(B):
            # context: same document, strictly before the anchor (by position); padding never
            ctx = [docs[c] == docs[a] and docs[c] >= 0 and pos[c] < pos[a] for c in range(T)]
            # block rows: own block only (bidirectional)
            blocks = [i == j for i in range(A) for _n in range(B)]
            rows.append(ctx + blocks)
    return torch.tensor(rows, dtype=torch.bool).reshape(A * B, T + A * B)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """float64 softmax attention, GQA by repeating KV heads; fully masked rows → 0."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v
