"""Qwen3-style building blocks of the drafter: RMSNorm, RoPE, SwiGLU MLP, the DFlash attention layer.

Legend: Q block queries (A·B in training, B at inference), S key slots, C context tokens,
H hidden, D head dim, Hq query heads, Hk key/value heads.

Module and parameter names follow z-lab's DFlash checkpoints (``layers.N.self_attn.q_proj.weight``,
``...k_norm.weight``, ``...mlp.gate_proj.weight``, ``...input_layernorm.weight``) so that a state dict
is the exported layout without renaming.

DFlash attention (docs/drafter.md#architecture): queries come from the block tokens only; keys/values
come from [context ; block] through the same k_proj / v_proj, with k_norm on both parts and q_norm on the
queries. The context is ``hidden_norm(fc(features))``, computed once and shared by every layer; it does
not go through the layer's input_layernorm (as in the reference implementation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_offline.drafter.config import DrafterConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; the output has the input's dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """float32 cos, sin [N, D] for integer ``positions`` [N] (default RoPE, halves layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_HND: Tensor, cos_ND: Tensor, sin_ND: Tensor) -> Tensor:
    """Rotate ``x`` [heads, N, D] by the angles of its N positions (computed in float32)."""
    x32 = x_HND.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos_ND + rotated * sin_ND).to(x_HND.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# attend(q [1, Hq, Q, D], k [1, Hk, S, D], v [1, Hk, S, D]) -> [1, Hq, Q, D]; it owns the mask.
AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class DFlashAttention(nn.Module):
    """One layer's attention: block queries over [context ; block] keys and values."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = D
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def keys_values(self, x_NH: Tensor, cos_ND: Tensor, sin_ND: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated, normed keys and values [Hk, N, D] of N tokens (context rows or block rows)."""
        N = x_NH.shape[0]
        k = self.k_norm(self.k_proj(x_NH).view(N, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x_NH).view(N, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(k, cos_ND, sin_ND), v

    def forward(
        self,
        x_QH: Tensor,
        cos_QD: Tensor,
        sin_QD: Tensor,
        ctx_k_HCD: Tensor,
        ctx_v_HCD: Tensor,
        attend: AttendFn,
    ) -> Tensor:
        """Attention output [Q, H] of the (already input-normed) block rows ``x_QH``."""
        return self.output(attend(*self.attention_inputs(x_QH, cos_QD, sin_QD, ctx_k_HCD, ctx_v_HCD)))

    def attention_inputs(
        self, x_QH: Tensor, cos_QD: Tensor, sin_QD: Tensor, ctx_k_HCD: Tensor, ctx_v_HCD: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [1, Hq, Q, D] and k, v [1, Hk, C+Q, D] ([context ; block]) as the attend function takes them."""
        Q = x_QH.shape[0]
        q = self.q_norm(self.q_proj(x_QH).view(Q, self.num_heads, self.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos_QD, sin_QD)
        blk_k, blk_v = self.keys_values(x_QH, cos_QD, sin_QD)
        k = torch.cat([ctx_k_HCD.to(blk_k.dtype), blk_k], dim=1)
        v = torch.cat([ctx_v_HCD.to(blk_v.dtype), blk_v], dim=1)
        # One dtype for the kernel (RMSNorm keeps its input dtype, so under autocast all are bf16).
        dtype = v.dtype
        return q.to(dtype)[None], k.to(dtype)[None], v[None]

    def output(self, attended_1HQD: Tensor) -> Tensor:
        """o_proj of the attend function's output [1, Hq, Q, D] → [Q, H]."""
        out = attended_1HQD[0]
        Q = out.shape[1]
        return self.o_proj(out.transpose(0, 1).reshape(Q, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: x + attn(norm(x), ctx); x + mlp(norm(x))."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x_QH: Tensor,
        cos_QD: Tensor,
        sin_QD: Tensor,
        ctx_k_HCD: Tensor,
        ctx_v_HCD: Tensor,
        attend: AttendFn,
    ) -> Tensor:
        return self.finish(x_QH, attend(*self.attention_inputs(x_QH, cos_QD, sin_QD, ctx_k_HCD, ctx_v_HCD)))

    # The layer in two halves around the attend call, so that ``--compile`` can compile each half
    # (norms, projections, RoPE, the MLP: many small kernels) and leave attention (flex's own compiled
    # kernel, or SDPA with a mask) as it is. forward is exactly their composition.

    def attention_inputs(
        self, x_QH: Tensor, cos_QD: Tensor, sin_QD: Tensor, ctx_k_HCD: Tensor, ctx_v_HCD: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v for the attend function (``DFlashAttention.attention_inputs`` of the normed rows)."""
        return self.self_attn.attention_inputs(
            self.input_layernorm(x_QH), cos_QD, sin_QD, ctx_k_HCD, ctx_v_HCD
        )

    def finish(self, x_QH: Tensor, attended_1HQD: Tensor) -> Tensor:
        """The layer's output [Q, H] from its input and the attend function's output."""
        x_QH = x_QH + self.self_attn.output(attended_1HQD)
        return x_QH + self.mlp(self.post_attention_layernorm(x_QH))
