"""Choosing the next token: greedy, or sampled with temperature / top-p from noise that depends only on the
request, never on the batch it runs in.

Legend: N rows, V vocabulary.

Sampling is the Gumbel-max trick: argmax(logits / T + g) with g = −log(−log u) draws a token from
softmax(logits / T) exactly. The uniforms u come from a counter-based hash of (seed, request key, index
of the token in the answer, vocabulary id), computed on the device with exact integer arithmetic (the
hash that makes the random presets' weights, ``target_model/presets.py``), so the same seed gives the same
answer whatever the batch size, the slot, or the other requests beside it, on the CPU and on CUDA, with
no random-generator state to carry (and nothing a CUDA graph could freeze). Top-p keeps the smallest set
of most likely tokens whose probability reaches p (the first always kept) and samples among them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_offline.errors import ConfigError
from dflash_offline.target_model.presets import mix32

_MASK32 = 0xFFFFFFFF


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
    """Two 32-bit words identifying a request in the sampling noise."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def uniform_noise(seed: int, keys_N2: Tensor, steps_N: Tensor, vocab: int) -> Tensor:
    """float32 [N, V] in (0, 1): the uniforms of each row's token ``steps_N`` (keys: int64 [N, 2])."""
    s = seed & _MASK32
    row_N = mix32(mix32(keys_N2[:, 0] ^ s) ^ keys_N2[:, 1])
    row_N = mix32(row_N ^ (steps_N & _MASK32))
    ids_V = torch.arange(vocab, dtype=torch.int64, device=keys_N2.device)
    h_NV = mix32(mix32(ids_V[None, :] ^ row_N[:, None]) ^ ((seed >> 32) & _MASK32))
    # Top 24 bits, centred in their interval: never exactly 0 or 1.
    return ((h_NV >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def top_p_filter(scaled_NV: Tensor, top_p: float) -> Tensor:
    """``scaled_NV`` with every token outside each row's nucleus set to −inf."""
    sorted_NV, order_NV = scaled_NV.sort(dim=-1, descending=True)
    probs_NV = sorted_NV.softmax(dim=-1)
    mass_before_NV = probs_NV.cumsum(dim=-1) - probs_NV
    sorted_NV = sorted_NV.masked_fill(mass_before_NV >= top_p, float("-inf"))
    return torch.empty_like(scaled_NV).scatter_(-1, order_NV, sorted_NV)


class Sampler:
    """``sampler(logits [N, V], keys [N, 2], steps [N]) -> int64 [N]``: the chosen tokens."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def __call__(self, logits_NV: Tensor, keys_N2: Tensor, steps_N: Tensor) -> Tensor:
        s = self.sampling
        if s.greedy:
            return logits_NV.argmax(dim=-1)
        scaled_NV = logits_NV.float() / s.temperature
        if s.top_p < 1:
            scaled_NV = top_p_filter(scaled_NV, s.top_p)
        u_NV = uniform_noise(s.seed, keys_N2, steps_N, scaled_NV.shape[-1])
        return (scaled_NV - torch.log(-torch.log(u_NV))).argmax(dim=-1)
