"""Choosing the next token: greedy, or sampled with temperature / top-p from a uniform that depends only on
the request, never on the batch it runs in.

Legend: N rows, V vocabulary.

Sampling is by the inverse of the distribution function: one uniform u per row, and the token at the
first position where the cumulative probability (in the nucleus's order with top-p: most likely first,
equal ones in vocabulary order; else in vocabulary order) reaches u times the mass kept. The uniform
comes from a counter-based hash of (seed, request key, index of the token in the answer), computed on
the device with exact integer arithmetic (the hash that makes the random presets' weights,
``target_model/presets.py``), so the same seed gives the same answer whatever the batch size, the slot,
or the other requests beside it, with no random-generator state to carry (and nothing a CUDA graph could
freeze). Top-p keeps the smallest set of most likely tokens
whose probability reaches p (the first always kept) and samples among them, renormalised.

It replaced a Gumbel-max sampler (argmax of logits / T plus noise hashed for every vocabulary entry),
which drew from the same distribution but wrote and read about twenty [N, V] int64 tensors a step for the
noise; here the only [N, V] work is the softmax, the cumulative sum and, with top-p, the sort. The two
draw different tokens for the same seed, so answers record ``SAMPLER`` and a resume checks it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_offline.errors import ConfigError
from dflash_offline.target_model.presets import mix32

_MASK32 = 0xFFFFFFFF

SAMPLER = "inverse-cdf"
"""The sampling algorithm, recorded in sampled answers' ``regenerated_by`` (answers written before it was
recorded were drawn by the Gumbel-max sampler this one replaced)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    """How the next token is chosen (the same for every request of an engine)."""

    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus: sample only among the most likely tokens whose probability adds up to top_p (1: all)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p {self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_key_hash(key: str) -> tuple[int, int]:
    """Two 32-bit words identifying a request in its sampling uniforms."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def row_uniform(seed: int, keys_N2: Tensor, steps_N: Tensor) -> Tensor:
    """float32 [N] in (0, 1): each row's uniform for its token ``steps_N`` (keys: int64 [N, 2])."""
    s = seed & _MASK32
    h_N = mix32(mix32(keys_N2[:, 0] ^ s) ^ keys_N2[:, 1])
    h_N = mix32(mix32(h_N ^ (steps_N & _MASK32)) ^ ((seed >> 32) & _MASK32))
    # Top 24 bits, centred in their interval: never exactly 0 or 1.
    return ((h_N >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


class Sampler:
    """``sampler(logits [N, V], keys [N, 2], steps [N]) -> int64 [N]``: the chosen tokens."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def __call__(self, logits_NV: Tensor, keys_N2: Tensor, steps_N: Tensor) -> Tensor:
        s = self.sampling
        if s.greedy:
            return logits_NV.argmax(dim=-1)
        scaled_NV = logits_NV.float() / s.temperature
        order_NV = None
        if s.top_p < 1:
            # Stable: bf16 logits tie often (about 2,400 distinct values in a row of 49,152), and equal
            # tokens then keep their vocabulary order on every device and in every batch.
            scaled_NV, order_NV = scaled_NV.sort(dim=-1, descending=True, stable=True)
        probs_NV = scaled_NV.softmax(dim=-1)
        cum_NV = probs_NV.cumsum(dim=-1)
        if order_NV is None:
            last_N = torch.full_like(steps_N, scaled_NV.shape[-1] - 1)
        else:  # the nucleus: the positions whose mass before them is below top_p (the first always; a NaN
            # row, which an idle slot may hold, counts none, so it is clamped to stay a valid index on CUDA)
            last_N = (((cum_NV - probs_NV) < s.top_p).sum(dim=-1) - 1).clamp_(min=0)
        mass_N = cum_NV.gather(-1, last_N[:, None])
        target_N1 = row_uniform(s.seed, keys_N2, steps_N)[:, None] * mass_N
        # The first position whose cumulative probability reaches the target: a count, not a binary search,
        # so a cumulative sum that rounding made dip by an ulp still gives one well-defined answer.
        pos_N = torch.minimum((cum_NV < target_N1).sum(dim=-1), last_N)
        return pos_N if order_NV is None else order_NV.gather(-1, pos_N[:, None])[:, 0]
