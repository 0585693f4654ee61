"""Anchor sampling: eligibility rule, per-document cap, uniformity, determinism."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dflash_offline.drafter.anchors import eligible_anchor_mask, sample_anchors
from dflash_offline.errors import ConfigError

from .helpers import random_row


def brute_eligible(loss_mask: list[bool], docs: list[int]) -> set[int]:
    return {
        a
        for a in range(len(docs) - 1)
        if loss_mask[a] and loss_mask[a + 1] and docs[a] == docs[a + 1] and docs[a] >= 0
    }


@pytest.mark.parametrize("seed", range(5))
def test_eligible_positions_match_brute_force(seed: int) -> None:
    row = random_row([3, 9, 1, 14, 6], seed=seed, pad=4, loss_prob=0.6)
    mask = eligible_anchor_mask(row.loss_mask_T, row.doc_ids_T)
    got = set(torch.nonzero(mask).flatten().tolist())
    assert got == brute_eligible(row.loss_mask_T.tolist(), row.doc_ids_T.tolist())


@pytest.mark.parametrize(("seed", "per_doc"), [(0, 1), (1, 3), (2, 100)])
def test_sampled_anchors_are_eligible_unique_sorted_and_capped_per_document(seed: int, per_doc: int) -> None:
    row = random_row([3, 9, 1, 14, 6, 25], seed=seed, pad=4, loss_prob=0.6)
    eligible = brute_eligible(row.loss_mask_T.tolist(), row.doc_ids_T.tolist())
    anchors = sample_anchors(
        row.loss_mask_T, row.doc_ids_T, num_anchors=per_doc, generator=torch.Generator().manual_seed(seed)
    )
    assert anchors.dtype == torch.int64
    values = anchors.tolist()
    assert values == sorted(set(values))
    assert set(values) <= eligible
    docs = row.doc_ids_T.tolist()
    per_doc_count = Counter(docs[a] for a in values)
    eligible_count = Counter(docs[a] for a in eligible)
    for d, n in eligible_count.items():
        assert per_doc_count[d] == min(n, per_doc)
    # the block's first draft token x[a+1] is a trained token of the same document
    for a in values:
        assert docs[a + 1] == docs[a]
        assert bool(row.loss_mask_T[a + 1])


def test_sampling_is_deterministic_given_the_generator() -> None:
    row = random_row([40, 30], seed=0, loss_prob=0.9)

    def draw(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return sample_anchors(row.loss_mask_T, row.doc_ids_T, num_anchors=5, generator=g).tolist()

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_sampling_is_uniform_without_replacement() -> None:
    """2 of 6 eligible positions: each position is chosen with probability 1/3."""
    loss_mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)  # eligible 0..5
    g = torch.Generator().manual_seed(0)
    counts: Counter[int] = Counter()
    draws = 3000
    for _ in range(draws):
        anchors = sample_anchors(loss_mask, num_anchors=2, generator=g).tolist()
        assert len(set(anchors)) == 2
        counts.update(anchors)
    assert set(counts) == set(range(6))
    for a in range(6):
        assert abs(counts[a] - draws / 3) < 120, counts  # ≈ 4.7 σ


def test_no_eligible_position_gives_no_anchor() -> None:
    loss_mask = torch.tensor([1, 0, 1, 0, 1], dtype=torch.bool)
    anchors = sample_anchors(loss_mask, num_anchors=4, generator=torch.Generator())
    assert anchors.numel() == 0
    assert anchors.dtype == torch.int64
    # two trained tokens split across a document boundary are not a pair
    docs = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    loss_mask = torch.tensor([0, 1, 1, 0, 0], dtype=torch.bool)
    assert sample_anchors(loss_mask, docs, num_anchors=4, generator=torch.Generator()).numel() == 0


def test_num_anchors_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        sample_anchors(torch.ones(4, dtype=torch.bool), num_anchors=0, generator=torch.Generator())


def test_row_cap_subsamples_the_per_document_draw() -> None:
    row = random_row([20, 20, 20, 20], seed=1, loss_prob=1.0)
    g = torch.Generator().manual_seed(0)
    full = sample_anchors(row.loss_mask_T, row.doc_ids_T, num_anchors=5, generator=g)
    assert full.numel() == 20
    capped = sample_anchors(
        row.loss_mask_T, row.doc_ids_T, num_anchors=5, generator=torch.Generator().manual_seed(0), max_total=7
    )
    assert capped.numel() == 7
    assert set(capped.tolist()) <= set(full.tolist())  # same per-document draw, then subsampled
    assert capped.tolist() == sorted(capped.tolist())
