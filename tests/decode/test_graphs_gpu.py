"""CUDA graphs of the decode engine across a ``clear()`` (the eval loops clear them when the block size
changes: target-only, then speculative)."""

from __future__ import annotations

import pytest
import torch

from dflash_offline.decode.graphs import StepGraphs

pytestmark = pytest.mark.gpu


def test_a_capture_after_clear_while_outputs_of_the_old_graphs_live() -> None:
    """A graph's outputs can outlive it (the static buffers its step wrote); a capture into the cleared
    graphs' pool then failed PyTorch's allocator assert (`use_count > 0`) in dflash eval on the H200."""
    graphs = StepGraphs(torch.device("cuda"), enabled=True)
    x = torch.randn(64, device="cuda")
    held: list[torch.Tensor] = []

    def step() -> None:
        held.append(x * 2)  # allocated inside the capture: from the graphs' private pool

    graphs.run("a", step, [])
    graphs.clear()
    out = torch.empty(64, device="cuda")
    graphs.run("b", lambda: out.copy_(x + 1), [])
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x + 1)
    assert graphs.num_captured == 1
