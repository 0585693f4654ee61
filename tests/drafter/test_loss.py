"""Labels (unshifted), decay weights, the decayed cross-entropy by hand, the chunked LM-head loss
against plain autograd, and the simulated acceptance length."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_offline.drafter.loss import (
    block_labels,
    decay_weights,
    decayed_cross_entropy,
    linear_cross_entropy,
    position_accuracy,
    simulated_acceptance_length,
)


def test_decay_weights() -> None:
    w = decay_weights(5, 7.0)
    expected = [0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7), math.exp(-3 / 7)]
    assert w.tolist() == pytest.approx(expected, rel=1e-6)


def test_labels_are_unshifted_and_masked() -> None:
    ids = torch.tensor([10, 11, 12, 13, 20, 21])
    docs = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.bool)
    labels = block_labels(ids, loss_mask, docs, torch.tensor([1, 2, 4]), 3)
    # position k of the block at a predicts x[a + k]
    assert labels.label_ids_AB[:, :2].tolist() == [[11, 12], [12, 13], [20, 21]]
    assert labels.label_ids_AB[:2, 2].tolist() == [13, 20]
    assert labels.valid_AB.tolist() == [
        [False, True, False],  # k=0 never; x[3] has loss_mask 0
        [False, False, False],  # x[3] loss_mask 0; x[4] is another document
        [False, True, False],  # x[6] is past the row end
    ]


def test_decayed_cross_entropy_by_hand() -> None:
    gamma = 2.0
    logits = torch.tensor([[[5.0, 5.0, 5.0], [2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # [A=1, B=3, V=3]
    labels = torch.tensor([[1, 0, 2]])
    ce1 = math.log(1 + 2 * math.exp(-2))  # -log softmax([2,0,0])[0]
    ce2 = math.log(2 + math.e)  # -log softmax([0,1,0])[2]
    w2 = math.exp(-1 / gamma)
    valid = torch.tensor([[True, True, True]])  # position 0 is dropped by its zero weight anyway
    got = decayed_cross_entropy(logits, labels, valid, gamma=gamma)
    assert got.item() == pytest.approx((ce1 + w2 * ce2) / (1 + w2), rel=1e-6)
    only_first = decayed_cross_entropy(logits, labels, torch.tensor([[False, True, False]]), gamma=gamma)
    assert only_first.item() == pytest.approx(ce1, rel=1e-6)
    nothing = decayed_cross_entropy(logits, labels, torch.zeros(1, 3, dtype=torch.bool), gamma=gamma)
    assert nothing.item() == 0.0


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])
def test_chunked_linear_cross_entropy_matches_autograd(chunk_rows: int) -> None:
    g = torch.Generator().manual_seed(chunk_rows)
    N, H, V = 11, 16, 37
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    weights = torch.rand(N, generator=g)
    total, preds = linear_cross_entropy(hidden, head, labels, weights, chunk_rows=chunk_rows)
    (total * 0.37).backward()
    grad = hidden.grad.clone()

    ref_hidden = hidden.detach().clone().requires_grad_(True)
    logits = ref_hidden @ head.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    (ref * 0.37).backward()
    torch.testing.assert_close(total, ref.detach())
    torch.testing.assert_close(grad, ref_hidden.grad)
    assert torch.equal(preds, logits.argmax(-1))


def test_chunked_linear_cross_entropy_with_bf16_head() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g, requires_grad=True)
    head = torch.randn(37, 16, generator=g).bfloat16()
    labels = torch.randint(0, 37, (9,), generator=g)
    weights = torch.rand(9, generator=g)
    total, _ = linear_cross_entropy(hidden, head, labels, weights, chunk_rows=4)
    total.backward()
    logits = (hidden.detach().bfloat16() @ head.T).float()
    ref = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    torch.testing.assert_close(total, ref, rtol=1e-4, atol=1e-4)
    assert hidden.grad is not None
    assert hidden.grad.dtype == torch.float32
    assert torch.isfinite(hidden.grad).all()


def test_no_gradient_is_formed_without_grad() -> None:
    hidden = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        total, _ = linear_cross_entropy(
            hidden, torch.randn(5, 8), torch.zeros(4, dtype=torch.int64), torch.ones(4)
        )
    assert total.grad_fn is None


def test_simulated_acceptance_length() -> None:
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_acceptance_length([0.5, 0.5], include_bonus=False) == pytest.approx(0.75)
    assert simulated_acceptance_length(torch.tensor([0.0, 1.0])) == pytest.approx(1.0)
    assert simulated_acceptance_length([0.5, float("nan"), 1.0]) == pytest.approx(1.5)


def test_position_accuracy() -> None:
    acc = position_accuracy(torch.tensor([3, 0, 0]), torch.tensor([4, 2, 0]))
    assert acc[:2].tolist() == [0.75, 0.0]
    assert math.isnan(acc[2].item())
    assert simulated_acceptance_length(acc) == pytest.approx(1.75)
