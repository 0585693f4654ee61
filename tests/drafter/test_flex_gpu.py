"""flex_attention on CUDA (compiled kernel, forward and backward) against dense SDPA and brute force."""

from __future__ import annotations

import pytest
import torch

from dflash_offline.drafter.attention import FLEX_BLOCK, TrainingAttention, build_attention_index

from .helpers import brute_force_mask, random_row, reference_attention, tiny_config, tiny_drafter

pytestmark = pytest.mark.gpu


def test_flex_matches_brute_force_forward_and_backward_on_cuda() -> None:
    row = random_row([37, 90, 12, 150], seed=0, pad=9, num_anchors=8, extra_anchors="starts,ends").to("cuda")
    B = 16
    ref_mask = brute_force_mask(row.to("cpu"), B).cuda()
    Q, S = ref_mask.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 4, Q, 64, generator=g, device="cuda", requires_grad=True)
    k = torch.randn(1, 2, S, 64, generator=g, device="cuda", requires_grad=True)
    v = torch.randn(1, 2, S, 64, generator=g, device="cuda", requires_grad=True)
    grad_out = torch.randn(1, 4, Q, 64, generator=g, device="cuda")
    expected = reference_attention(q.detach(), k.detach(), v.detach(), ref_mask)
    grads = {}
    for backend in ("flex", "sdpa"):
        index = build_attention_index(
            row.doc_ids_T, row.positions_T, row.anchors_A, block_size=B, pad_to=FLEX_BLOCK
        )
        out = TrainingAttention(index, backend)(q, k, v)  # type: ignore[arg-type]
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
        q.grad = k.grad = v.grad = None
        (out * grad_out).sum().backward()
        grads[backend] = [t.grad.clone() for t in (q, k, v)]
        assert all(torch.isfinite(t).all() for t in grads[backend])
    for a, b in zip(grads["flex"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_forward_train_flex_equals_sdpa_on_cuda_under_bf16_autocast() -> None:
    model = tiny_drafter(tiny_config(block_size=16, head_dim=16), seed=0).cuda()
    row = random_row([60, 130, 40], seed=1, pad=20, num_anchors=6, extra_anchors="starts,ends").to("cuda")
    results = {}
    for backend in ("flex", "sdpa"):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.forward_train(row, attention=backend)
        out.loss.backward()
        results[backend] = (out.loss.detach(), [p.grad.clone() for p in model.parameters()])
        assert torch.isfinite(out.loss)
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], atol=2e-2, rtol=2e-2)
    for a, b in zip(results["flex"][1], results["sdpa"][1]):
        assert (a - b).norm() <= 3e-2 * b.norm() + 1e-6  # bf16 kernels differ in rounding only
