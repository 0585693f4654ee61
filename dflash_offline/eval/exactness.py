"""Is the speculative output the target's greedy output? Identical, a rounding near-tie, or a real mismatch.

Every token the speculative loop emits is the target's argmax given the tokens before it, but computed
by a B-token verify forward instead of a one-token decode step. Both are exact in exact arithmetic; in
floating point they round differently (other GEMM shapes, other kernels), so where the target's two best
logits nearly tie the argmax can flip, and from there on the texts differ. That is not a bug; a flip
where the two tokens are far apart is.

The rule, at the first new-token index j where the speculative output s and the target-only output r
differ (prefix = prompt + r[:j] = prompt + s[:j]): run ONE full forward of the target over the prefix,
without a KV cache, in the eval dtype, and read its last logits ℓ (a third, independent computation).
With ℓ* = max ℓ and ulp(x) = eps(dtype) · 2^⌊log2 |x|⌋ (the spacing of the dtype at the logit's
magnitude: 2^−7 relative for bfloat16, 2^−23 for float32), the divergence is a **near-tie** when both
candidates lie within ``tie_ulps`` · ulp(ℓ*) of the top, i.e. ℓ* − ℓ[r_j] ≤ tol and ℓ* − ℓ[s_j] ≤ tol;
anything else (a candidate further from the top, or outputs of different length over a common prefix)
is a **mismatch**, and ``dflash eval`` exits non-zero naming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from dflash_offline.eval.config import DEFAULT_TIE_ULPS

DivergenceKind = Literal["identical", "near_tie", "mismatch"]


EXACTNESS_RULE = (
    "at the first new token j where speculative s and target-only r differ, one full forward of the target "
    "over prompt + r[:j] in the eval dtype gives logits l; near-tie iff max(l) - l[r_j] <= tol and "
    "max(l) - l[s_j] <= tol with tol = tie_ulps * eps(dtype) * 2^floor(log2 |max(l)|); else mismatch"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Divergence:
    """How one speculative output compares with the target-only greedy output of the same prompt."""

    kind: DivergenceKind
    position: int | None
    """First differing new-token index j (None when identical)."""
    target_token: int | None
    """r_j, the target-only token at j (None when identical or when r ended first)."""
    spec_token: int | None
    """s_j, the speculative token at j (None when identical or when s ended first)."""
    top_logit: float | None
    """ℓ*: the largest logit of the full forward over the prefix."""
    target_token_gap: float | None
    """ℓ* − ℓ[r_j]."""
    spec_token_gap: float | None
    """ℓ* − ℓ[s_j]."""
    top2_gap: float | None
    """ℓ* minus the second largest logit."""
    tolerance: float | None
    """tie_ulps · ulp(ℓ*) in the eval dtype."""
    dtype: str


def ulp(x: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` at magnitude |x| (its epsilon times the power of two below |x|)."""
    eps = torch.finfo(dtype).eps
    magnitude = abs(x)
    if magnitude == 0 or not math.isfinite(magnitude):
        return eps
    return eps * 2.0 ** math.floor(math.log2(magnitude))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first difference of two token sequences (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def last_logits(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """float32 logits [V] of the last position of one full forward over ``ids`` (no KV cache)."""
    device = next(model.parameters()).device
    ids_1S = torch.tensor([list(ids)], dtype=torch.int64, device=device)
    return model(input_ids=ids_1S, use_cache=False).logits[0, -1].float().cpu()


def classify(
    *,
    model: nn.Module,
    prompt_ids: Sequence[int],
    target_tokens: Sequence[int],
    spec_tokens: Sequence[int],
    tie_ulps: float = DEFAULT_TIE_ULPS,
) -> Divergence:
    """Compare the two outputs by the rule of the module docstring."""
    dtype = next(model.parameters()).dtype
    name = str(dtype).removeprefix("torch.")
    j = first_divergence(spec_tokens, target_tokens)
    if j is None:
        return Divergence(
            kind="identical", position=None, target_token=None, spec_token=None, top_logit=None,
            target_token_gap=None, spec_token_gap=None, top2_gap=None, tolerance=None, dtype=name,
        )  # fmt: skip
    if j >= len(spec_tokens) or j >= len(target_tokens):
        # Same tokens, different lengths: both decodes stop by the same rule, so no rounding explains it.
        return Divergence(
            kind="mismatch", position=j,
            target_token=target_tokens[j] if j < len(target_tokens) else None,
            spec_token=spec_tokens[j] if j < len(spec_tokens) else None, top_logit=None,
            target_token_gap=None, spec_token_gap=None, top2_gap=None, tolerance=None, dtype=name,
        )  # fmt: skip
    logits_V = last_logits(model, [*prompt_ids, *target_tokens[:j]])
    top2 = logits_V.topk(2).values.tolist()
    top = top2[0]
    r, s = int(target_tokens[j]), int(spec_tokens[j])
    r_gap, s_gap = top - float(logits_V[r]), top - float(logits_V[s])
    tolerance = tie_ulps * ulp(top, dtype)
    return Divergence(
        kind="near_tie" if max(r_gap, s_gap) <= tolerance else "mismatch",
        position=j,
        target_token=r,
        spec_token=s,
        top_logit=top,
        target_token_gap=r_gap,
        spec_token_gap=s_gap,
        top2_gap=top - top2[1],
        tolerance=tolerance,
        dtype=name,
    )


def describe(d: Divergence) -> str:
    """One line about a divergence, for the table and the error message."""
    if d.kind == "identical":
        return "identical"
    if d.top_logit is None:
        return f"{d.kind} at new token {d.position}: same tokens, different lengths"
    return (
        f"{d.kind} at new token {d.position}: target-only {d.target_token} vs speculative {d.spec_token}, "
        f"their distance from the top logit {d.top_logit:.4g} is {d.target_token_gap:.3g} and "
        f"{d.spec_token_gap:.3g} (tolerance {d.tolerance:.3g} in {d.dtype})"
    )
