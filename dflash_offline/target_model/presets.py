"""Random-weight targets of named shapes (``random:<preset>``), for tests and GPU benchmarks.

Weights come from a counter-based hash of (preset seed, parameter name, element index), computed with
exact 64-bit integer arithmetic in torch on the target device and mapped to float32 by exact
operations, so they are bit-identical on CPU and CUDA, independent of the number of layers built,
and fast to make even for the 8B shape (a few element-wise kernels per tensor, no RNG state). The head
loader (``target.head``) regenerates the embedding and LM head alone from the same function.

Values: linear and embedding weights ~ U(-a, a) with a = std·√3 (std 0.02, HF's initializer range);
norm weights 1; biases 0.

Shape legend: N = elements of one parameter (flattened).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

WEIGHT_INIT_VERSION = 1
"""Bump when the value function changes: it is part of every random target's weights hash."""

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows.
_MUL1 = 0x7FEB352D
_MUL2 = 0x5BD1E995
_CHUNK = 1 << 24  # elements per kernel launch (bounds the int64 temporaries to ~128 MiB each)


@dataclass(frozen=True, kw_only=True, slots=True)
class RandomPreset:
    """The shape and seed of a random-weight target."""

    name: str
    model_type: Literal["llama", "qwen3"]
    """HF architecture family; qwen3 has per-head q_norm/k_norm."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """Embedding rows; at least the tokenizer's vocabulary (the embedded SmolLM2 tokenizer has 49152)."""
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    seed: int
    init_std: float = 0.02

    def hf_config(self, *, num_layers: int | None = None) -> Any:
        """A transformers config of this shape (with ``num_layers`` decoder layers when given)."""
        from transformers import LlamaConfig, Qwen3Config

        common: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers if num_layers is None else num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.init_std,
            "attention_bias": False,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            # Token ids of the embedded SmolLM2 tokenizer that random presets use.
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
        }
        if self.model_type == "qwen3":
            return Qwen3Config(**common)
        return LlamaConfig(**common, mlp_bias=False)

    def weights_hash(self) -> str:
        """Identifies the weights: the full preset record plus the value-function version."""
        payload = json.dumps({**asdict(self), "init": WEIGHT_INIT_VERSION}, sort_keys=True)
        return "preset-sha256:" + hashlib.sha256(payload.encode()).hexdigest()


RANDOM_PRESETS: dict[str, RandomPreset] = {
    p.name: p
    for p in (
        # Qwen3-style (q_norm/k_norm), untied, so tests see a separate LM head.
        RandomPreset(
            name="tiny",
            model_type="qwen3",
            num_layers=4,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=49152,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            seed=0,
        ),
        # Llama-style and tied, like SmolLM2: the other code path at the same tiny cost.
        RandomPreset(
            name="tiny-llama",
            model_type="llama",
            num_layers=4,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=49152,
            rope_theta=100_000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            seed=1,
        ),
        RandomPreset(
            name="smollm2-135m",
            model_type="llama",
            num_layers=30,
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            rope_theta=100_000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            seed=2,
        ),
        RandomPreset(
            name="qwen3-8b",
            model_type="qwen3",
            num_layers=36,
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            seed=3,
        ),
    )
}


def canonical_param_name(name: str) -> str:
    """The parameter's name relative to the decoder backbone: ``model.layers.0.x`` -> ``layers.0.x``.

    A CausalLM and its bare backbone name the same tensor differently; the weights must not depend on
    which of the two was built."""
    return name.removeprefix("model.")


def _param_key(seed: int, name: str) -> tuple[int, int]:
    digest = hashlib.sha256(f"{seed}\x00{canonical_param_name(name)}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def mix32(x_N: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply) on int64 tensors holding values in [0, 2**32)."""
    x_N = x_N ^ (x_N >> 16)
    x_N = (x_N * _MUL1) & _MASK32
    x_N = x_N ^ (x_N >> 15)
    x_N = (x_N * _MUL2) & _MASK32
    return x_N ^ (x_N >> 16)


def uniform_values(seed: int, name: str, numel: int, *, device: torch.device) -> torch.Tensor:
    """float32 [numel] in [-1, 1): the deterministic pseudo-random values of parameter ``name``."""
    assert numel < 2**32, numel
    k1, k2 = _param_key(seed, name)
    out_N = torch.empty(numel, dtype=torch.float32, device=device)
    for start in range(0, numel, _CHUNK):
        stop = min(start + _CHUNK, numel)
        idx_N = torch.arange(start, stop, dtype=torch.int64, device=device)
        h_N = mix32(mix32(idx_N ^ k1) ^ k2)
        # Top 24 bits -> exactly representable float32 in [0, 1), then exact affine map to [-1, 1).
        out_N[start:stop] = (h_N >> 8).to(torch.float32) * (2.0 / (1 << 24)) - 1.0
    return out_N


def param_values(preset: RandomPreset, name: str, shape: torch.Size, *, device: torch.device) -> torch.Tensor:
    """float32 tensor of ``shape``: the value of parameter ``name`` in ``preset``."""
    canonical = canonical_param_name(name)
    if canonical.endswith("norm.weight"):  # input/post-attention/final norms and qwen3's q_norm/k_norm
        return torch.ones(shape, dtype=torch.float32, device=device)
    if canonical.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    scale = preset.init_std * 3.0**0.5  # U(-a, a) has std a/√3
    return (uniform_values(preset.seed, canonical, shape.numel(), device=device) * scale).view(shape)


@torch.no_grad()
def fill_random_weights(model: torch.nn.Module, preset: RandomPreset) -> None:
    """Overwrite every parameter of ``model`` (a CausalLM or its backbone) with the preset's values."""
    for name, param in model.named_parameters():
        param.copy_(param_values(preset, name, param.shape, device=param.device))
