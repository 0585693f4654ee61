"""A DFlash drafter proposing blocks from a preallocated context cache, with no host sync (graph-safe).

Legend: C context rows, B block size, K = B − 1 drafted tokens, F feature width, Hk key/value heads,
D head dim, L capacity (positions), Lb attended context positions, V vocabulary.

``DFlashDrafter.draft`` grows its context keys/values by concatenation and takes the anchor as a Python
int; here both live on the device: per drafter layer K and V are ``[Hk, L, D]`` allocated once, context
rows are written at their positions with ``index_copy_``, and the anchor token and position are device
tensors. The drafter's own layers run unchanged (``DecoderLayer`` with an ``attend`` that masks the
context to positions < anchor): every query sees the context before the anchor and its whole block.

The speculative cycle feeds it the target's features of the previous verify block (all B rows, written at
positions prev_anchor..prev_anchor+B−1): the rows past the accepted ones land at or after the new anchor,
which the mask hides and the next cycle overwrites. So a rollback is again a position, never a copy.

With ``compile_backend`` (``dflash eval --compile``) each layer's work around attention runs through
``torch.compile`` (``DFlashDrafter.layer_steps``: the norms, projections, RoPE and MLP as a few fused
kernels; the context length is a dynamic dimension, so one compile serves every attended-length bucket).
A batch-1 cycle does little arithmetic, so its time should follow its kernel count: on the CPU a cycle of
the SmolLM2-135M shape with the default drafter runs 1,417 operators instead of 1,639, a target decode
step 1,221 (bench/spec_cycle.py). A compile that fails leaves the drafter eager, with a
``DrafterCompileWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflash_offline.decode.attention import attend
from dflash_offline.drafter.layers import rope_cos_sin
from dflash_offline.drafter.model import DFlashDrafter, LayerSteps


class DrafterCompileWarning(RuntimeWarning):
    """``torch.compile`` of the drafter's layers failed; it drafts eagerly (slower, the answers the same)."""


class StaticDrafter:
    """``model``'s context keys/values for one sequence of up to ``capacity`` positions (a ``Drafter`` of
    ``decode/speculative.py``)."""

    capturable = True
    """No host sync: the speculative cycle runs it inside its CUDA graphs."""

    def __init__(self, model: DFlashDrafter, capacity: int, *, compile_backend: str | None = None) -> None:
        cfg = model.config
        weight = model.fc.weight
        self.model = model
        self.capacity = capacity
        self.block_size = cfg.block_size
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        dims = (cfg.num_key_value_heads, capacity, cfg.head_dim)
        device, dtype = weight.device, weight.dtype
        self.keys = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self._mask_ids_K = torch.full(
            (cfg.block_size - 1,), cfg.mask_token_id, dtype=torch.int64, device=device
        )
        self._offsets_B = torch.arange(cfg.block_size, device=device)
        self.steps: list[LayerSteps] = model.layer_steps()
        self.compiled = False
        """Whether the layer steps run compiled (asked for, and no compiled step has failed)."""
        if compile_backend is not None:
            self._compile(compile_backend)

    @torch.inference_mode()
    def _compile(self, backend: str) -> None:
        """Compiled layer steps, each falling back to the eager one for good at the first failure (with a
        ``DrafterCompileWarning``), and tried once here on a block's shapes: the first compile happens now,
        outside any CUDA graph capture."""
        eager, compiled = self.steps, self.model.layer_steps(compile_backend=backend)
        self.steps = [
            LayerSteps(
                keys_values=self._guarded(c.keys_values, e.keys_values),
                attention_inputs=self._guarded(c.attention_inputs, e.attention_inputs),
                finish=self._guarded(c.finish, e.finish),
            )
            for c, e in zip(compiled, eager, strict=True)
        ]
        self.compiled = True
        B = self.block_size
        zero_1 = torch.zeros(1, dtype=torch.int64, device=self._offsets_B.device)
        width = self.model.config.feature_width
        self.ingest(torch.zeros((B, width), dtype=self.keys[0].dtype, device=zero_1.device), zero_1)
        context = min(self.capacity, 2 * B)
        self.draft(zero_1, zero_1 + context // 2, context)
        for cache in (*self.keys, *self.values):
            cache[:, :B].zero_()  # the trial's rows: not any prompt's context

    def _guarded(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Tensor) -> Any:
            if self.compiled:
                try:
                    return compiled(*args)
                except Exception as exc:  # a compiler or Triton failure must not end the eval
                    self.compiled = False
                    warnings.warn(
                        DrafterCompileWarning(
                            f"torch.compile of the drafter failed ({type(exc).__name__}: {str(exc)[:300]}); "
                            "it drafts eagerly from now on (slower; its proposals never change the answers)"
                        ),
                        stacklevel=2,
                    )
            return eager(*args)

        return step

    def ingest(self, features_CF: Tensor, start_1: Tensor) -> None:
        """Write the context keys/values of positions start..start+C−1 (``start``: int64 [1])."""
        C = int(features_CF.shape[0])
        positions_C = start_1 + torch.arange(C, device=start_1.device)
        ctx_CH = self.model.context(features_CF)
        cos, sin = rope_cos_sin(positions_C, self.head_dim, self.rope_theta)
        for i, step in enumerate(self.steps):
            k, v = step.keys_values(ctx_CH, cos, sin)
            self.keys[i].index_copy_(1, positions_C, k)
            self.values[i].index_copy_(1, positions_C, v)

    def draft(self, anchor_1: Tensor, anchor_position_1: Tensor, attend_len: int) -> Tensor:
        """Greedy int64 [K] for positions anchor+1..anchor+K, from the context at positions < anchor
        (all below ``attend_len``) and the block [anchor, MASK × K]."""
        return self.draft_logits(anchor_1, anchor_position_1, attend_len).argmax(dim=-1)

    def draft_logits(self, anchor_1: Tensor, anchor_position_1: Tensor, attend_len: int) -> Tensor:
        """[K, V]: the logits ``draft`` takes its proposals from."""
        model, B = self.model, self.block_size
        x_BH = model.embed_ids(torch.cat([anchor_1, self._mask_ids_K]))
        q_cos, q_sin = rope_cos_sin(anchor_position_1 + self._offsets_B, self.head_dim, self.rope_theta)
        visible = torch.arange(attend_len, device=anchor_1.device) < anchor_position_1
        keys_seen = torch.cat([visible, torch.ones(B, dtype=torch.bool, device=anchor_1.device)])
        mask_11BL = keys_seen[None, None, None, :].expand(1, 1, B, attend_len + B).contiguous()
        for i, step in enumerate(self.steps):
            # DecoderLayer.forward, through the (maybe compiled) steps around its attention.
            ctx_k, ctx_v = self.keys[i][:, :attend_len], self.values[i][:, :attend_len]
            q, k, v = step.attention_inputs(x_BH, q_cos, q_sin, ctx_k, ctx_v)
            x_BH = step.finish(x_BH, attend(q, k, v, mask_11BL))
        hidden_KH = model.norm(x_BH)[1:]
        head_VH = model.lm_head_VH
        return hidden_KH.to(head_VH.dtype) @ head_VH.T
