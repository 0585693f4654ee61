"""``DFlashDrafter.compile_training``: the compiled per-layer steps give the eager forward and gradients,
for rows of every shape without compiling again (dynamic shapes). The CPU test compiles with the
``aot_eager`` backend (tracing and autograd as inductor sees them, without generating kernels: seconds,
not minutes, on two cores); bench/train_step.py measures inductor on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from .helpers import random_row, tiny_config, tiny_drafter


@pytest.mark.slow
def test_compiled_training_forward_matches_eager_for_every_shape() -> None:
    torch._dynamo.reset()
    eager = tiny_drafter(tiny_config(block_size=4, num_layers=2))
    compiled = copy.deepcopy(eager)
    compiled.compile_training(backend="aot_eager")
    graphs = []
    for i, lengths in enumerate(([20, 9, 31], [50], [7, 7, 7, 40, 3], [64, 64])):
        row = random_row(lengths, seed=i, pad=i, num_anchors=5, extra_anchors="ends")
        eager.zero_grad()
        compiled.zero_grad()
        want = eager.forward_train(row, attention="sdpa")
        got = compiled.forward_train(row, attention="sdpa")
        want.loss.backward()
        got.loss.backward()
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
        assert torch.equal(got.correct_K, want.correct_K)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert p.grad is not None
            assert q.grad is not None
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0  # the layers did go through the compiler
    # Dynamic shapes: the second shape may specialise once, later shapes reuse those graphs.
    assert graphs[2:] == [graphs[1]] * (len(graphs) - 2), graphs
