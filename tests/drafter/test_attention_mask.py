"""The training mask (dense SDPA and flex_attention) against a brute-force reference built position by
position from the rule of docs/drafter.md#attention-mask, on random packed rows; and the fully-masked-row
guard."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_offline.drafter.attention import (
    FLEX_BLOCK,
    TrainingAttention,
    build_attention_index,
    dense_mask,
    sdpa_attend,
)

from .helpers import brute_force_mask, random_row, reference_attention

ROW_CASES = [
    # (document lengths, padding, block size, anchors per doc, extra anchors, seed)
    ([7, 12, 5], 6, 4, 3, "starts,ends", 0),
    ([1, 3, 20], 0, 5, 4, "ends", 1),
    ([16], 3, 16, 5, "starts,ends", 2),
    ([2, 2, 2, 9, 4], 1, 2, 2, "starts", 3),
    ([30, 11], 0, 3, 6, "ends", 4),
]


@pytest.mark.parametrize(("lengths", "pad", "block_size", "per_doc", "extra", "seed"), ROW_CASES)
def test_dense_mask_matches_brute_force(lengths, pad, block_size, per_doc, extra, seed) -> None:
    row = random_row(lengths, seed=seed, pad=pad, num_anchors=per_doc, extra_anchors=extra)
    assert row.num_anchors > 0
    ref = brute_force_mask(row, block_size)
    for pad_to in (1, FLEX_BLOCK):
        index = build_attention_index(
            row.doc_ids_T, row.positions_T, row.anchors_A, block_size=block_size, pad_to=pad_to
        )
        Q, S = ref.shape
        dense = dense_mask(index)
        assert dense.shape[0] % pad_to == 0
        assert dense.shape[1] % pad_to == 0
        assert torch.equal(dense[:Q, :S], ref)
        # Real queries never see padded key slots; padded queries see only the dummy slot 0.
        assert not dense[:Q, S:].any()
        if dense.shape[0] > Q:
            assert torch.equal(dense[Q:].sum(-1), torch.ones(dense.shape[0] - Q, dtype=torch.int64))
            assert dense[Q:, 0].all()


def test_brute_force_rule_spot_checks() -> None:
    """The reference itself encodes the rule: anchor a sees c < a of its own document, not a."""
    row = replace(random_row([5, 6], seed=7, num_anchors=1), anchors_A=torch.tensor([2, 5, 8]))
    ref = brute_force_mask(row, 3)
    T = 11
    # block 0 (anchor 2, doc 0): context 0,1; not 2 (the anchor), not doc 1
    assert ref[0, :T].nonzero().flatten().tolist() == [0, 1]
    # block 1 (anchor 5 = start of doc 1): no context at all
    assert not ref[3, :T].any()
    # block 2 (anchor 8, doc 1 position 3): context 5, 6, 7
    assert ref[6, :T].nonzero().flatten().tolist() == [5, 6, 7]
    assert ref[6, T:].nonzero().flatten().tolist() == [6, 7, 8]


@pytest.mark.parametrize(("lengths", "pad", "block_size", "per_doc", "extra", "seed"), ROW_CASES)
def test_sdpa_and_cpu_flex_match_reference_attention(lengths, pad, block_size, per_doc, extra, seed) -> None:
    """Both backends (flex: forward-only on CPU) agree with brute-force attention."""
    row = random_row(lengths, seed=seed, pad=pad, num_anchors=per_doc, extra_anchors=extra)
    ref_mask = brute_force_mask(row, block_size)
    Q, S = ref_mask.shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, Q, 8, generator=g)
    k = torch.randn(1, 2, S, 8, generator=g)
    v = torch.randn(1, 2, S, 8, generator=g)
    expected = reference_attention(q, k, v, ref_mask)
    for backend, pad_to in (("sdpa", 1), ("sdpa", FLEX_BLOCK), ("flex", FLEX_BLOCK), ("flex", 1)):
        index = build_attention_index(
            row.doc_ids_T, row.positions_T, row.anchors_A, block_size=block_size, pad_to=pad_to
        )
        with torch.no_grad():
            out = TrainingAttention(index, backend)(q, k, v)  # type: ignore[arg-type]
        assert out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=f"{backend} {pad_to}")


def test_fully_masked_rows_give_zero_without_nan_forward_and_backward() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 9, 8, generator=g, requires_grad=True)
    mask = torch.rand(6, 9, generator=g) < 0.5
    mask[0] = True
    mask[2] = False
    mask[5] = False
    out = sdpa_attend(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    torch.testing.assert_close(out.double(), reference_attention(q.detach(), k.detach(), v.detach(), mask))
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None
        assert torch.isfinite(t.grad).all()
    # the fully masked query rows get no gradient, and no key/value gets one from them
    assert torch.equal(q.grad[:, :, 2], torch.zeros_like(q.grad[:, :, 2]))


def test_cpu_flex_fully_masked_row_is_zero() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_offline.drafter.attention import flex_attend

    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    bm = create_block_mask(lambda b, h, qi, ki: qi != 3, None, None, 5, 7, device="cpu")
    out = flex_attend(q, k, v, bm)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))


@pytest.mark.parametrize(
    ("lengths", "pad", "block_size", "per_doc", "extra", "seed"),
    [
        *ROW_CASES,
        ([300, 40, 500], 70, 16, 40, "ends", 5),  # full tiles of context and partial ones
        ([129, 1, 128], 0, 8, 60, "starts", 6),  # documents ending on and next to tile edges
        ([1000], 0, 16, 200, "starts,ends", 7),
    ],
)
def test_flex_block_mask_equals_create_block_mask(lengths, pad, block_size, per_doc, extra, seed) -> None:
    """The BlockMask classified from intervals is the one flex's create_block_mask evaluates from the
    mask_mod at every (query, key) pair: the same partial and full tiles, in the same order."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_offline.drafter.attention import flex_block_mask, make_mask_mod

    row = random_row(lengths, seed=seed, pad=pad, num_anchors=per_doc, extra_anchors=extra)
    full_tiles = 0
    for pad_to in (1, FLEX_BLOCK):
        index = build_attention_index(
            row.doc_ids_T, row.positions_T, row.anchors_A, block_size=block_size, pad_to=pad_to
        )
        ours = flex_block_mask(index)
        Qp, Sp = int(index.q_doc_Q.shape[0]), int(index.kv_doc_S.shape[0])
        reference = create_block_mask(make_mask_mod(index), None, None, Qp, Sp, device="cpu")
        assert ours.seq_lengths == reference.seq_lengths
        assert ours.BLOCK_SIZE == reference.BLOCK_SIZE
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
            "full_q_num_blocks",
            "full_q_indices",
        ):
            assert torch.equal(getattr(ours, name), getattr(reference, name)), (name, pad_to)
        full_tiles += int(ours.full_kv_num_blocks.sum())
    if sum(lengths) >= 800:
        assert full_tiles > 0  # the case exercises full tiles, not only partial ones
