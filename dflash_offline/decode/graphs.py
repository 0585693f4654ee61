"""Replaying a step as a CUDA graph, one per static shape, captured the first time that shape runs.

A captured step reads and writes only tensors that outlive it (the slot cache, the per-slot state, the
output buffers), so a replay is the whole step in one launch: batch-1 decoding is bound by kernel
launches otherwise (24 ms a step eager against 3.3 ms replayed, measured on an H200). Before capture the
step runs a few times on a side stream (kernel selection, cuBLAS/cuDNN workspaces) with the state it
mutates restored after each run, so the warm-up changes nothing the real step will not overwrite with the
same values. On the CPU, or with graphs off, the step just runs: the same code either way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

WARMUP_RUNS = 2


class StepGraphs:
    """Runs step functions, through a CUDA graph per key when enabled."""

    def __init__(self, device: torch.device, *, enabled: bool) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, step: Callable[[], None], mutated: Sequence[Tensor]) -> None:
        """Run ``step`` (graph ``key``: every tensor shape inside it is fixed by the key). ``mutated`` are
        the persistent tensors it changes other than by idempotent writes (restored after warm-up)."""
        if not self.enabled:
            step()
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(step, mutated)
            self._graphs[key] = graph
        graph.replay()

    def capture(self, key: Hashable, step: Callable[[], None], mutated: Sequence[Tensor]) -> None:
        """Capture graph ``key`` now if it is not yet (so that a timed loop never pays for a capture)."""
        if self.enabled and key not in self._graphs:
            self._graphs[key] = self._capture(step, mutated)

    def _capture(self, step: Callable[[], None], mutated: Sequence[Tensor]) -> torch.cuda.CUDAGraph:
        saved = [t.clone() for t in mutated]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step()
                for t, s in zip(mutated, saved, strict=True):
                    t.copy_(s)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()  # recorded, not run: the state is still the restored one
        return graph

    def clear(self) -> None:
        self._graphs.clear()
        # The graphs were the pool's only users: PyTorch frees it with them, and a capture into a freed
        # pool's handle fails an internal assert (seen on the H200 in dflash eval). A new pool, then.
        if self.enabled:
            self._pool = torch.cuda.graph_pool_handle()
