"""Lossy 4-bit storage of features: int4 codes, a power-of-two scale per group of dims, exact outliers.

Shape legend: T = tokens, L = captured layers, H = hidden size, F = L * H, G = scale groups per layer,
K = outliers per (token, layer), W = stored bytes per token.

One stored row (uint8 [W], one per token; the feature array of an int4 shard group is uint8 [R, W]):

    codes     L * H / 2  two's-complement int4 codes q of x / 2^e, two a byte: dim 2i in the low
                         nibble, dim 2i + 1 in the high one (0 at the outlier dims)
    exponents L * G      int8 e of each (token, layer, group of H / G dims)
    outlier   L * K * 2  uint16 little-endian dim index of each (token, layer)'s K largest |x|
    values    L * K * 2  their exact bf16 bits

The outliers are those of the fp8 codec (``fp8.py``: the massive activations, ties to the lower dim on
every device), and so is the scale rule, with 7.5 where fp8 has 448: e is the smallest with
max |x| / 2^e ≤ 7.5 over the group's other dims. x / 2^e is exact in float32, and ``round`` (half to
even, the same on every device) then clamping to [-8, 7] moves it by at most 1/2: every non-outlier
element decodes within 2^e / 2 of x, where 2^e < max |x| / 3.75 of its group. Decoding q × 2^e is exact
in bf16 (|q| ≤ 8, e in [-100, 120]), so the CPU reader and the GPU prefetcher give the same bits.

Why this format (``bench/codec_error.py`` on real SmolLM2-135M features): uniform int4 codes under a
power-of-two scale beat NF4 and fp4 (e2m1) codes under the same scale in relative error on every
captured layer; groups of 32 dims and 2 outliers keep the row within 0.28 of bf16's bytes at hidden
sizes 576 (0.273) and 4,096 (0.267).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_offline.cache.fp8 import exp2, pow2_exponents, restore_outliers, store_outliers
from dflash_offline.errors import SampleError

INT4_TOP = 7.5
"""Largest max |x| / 2^e of a group: x / 2^e rounds into [-8, 7] within 1/2 (7.5 clamps to 7)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Int4Layout:
    """The byte layout of one stored int4 row; fixed by the codec name and the fingerprint."""

    num_layers: int
    hidden_size: int
    group_dims: int
    """Dims sharing one scale (an even divisor of hidden_size)."""
    num_outliers: int
    """K: largest-|x| dims of each (token, layer) stored exactly as bf16 (0 = none)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.group_dims or self.group_dims % 2:
            raise ValueError(
                f"int4 scale groups of {self.group_dims} dims: need an even divisor of hidden size "
                f"{self.hidden_size}"
            )
        if self.hidden_size > 65535 or self.num_outliers > self.hidden_size:
            raise ValueError(f"int4 outliers: K={self.num_outliers} of hidden {self.hidden_size} unsupported")

    @property
    def num_features(self) -> int:
        return self.num_layers * self.hidden_size

    @property
    def num_groups(self) -> int:
        """Scale groups per layer (G)."""
        return self.hidden_size // self.group_dims

    @property
    def exponents_offset(self) -> int:
        return self.num_features // 2

    @property
    def index_offset(self) -> int:
        return self.exponents_offset + self.num_layers * self.num_groups

    @property
    def row_bytes(self) -> int:
        """W: stored bytes per token."""
        return self.index_offset + 4 * self.num_layers * self.num_outliers

    def to_attributes(self) -> dict[str, int]:
        return {"group_dims": self.group_dims, "num_outliers": self.num_outliers}


def encode_rows(
    features_TF: torch.Tensor, layout: Int4Layout, *, where: str = "features", check_finite: bool = True
) -> torch.Tensor:
    """uint8 [T, W] stored rows of bf16 (or float32) features [T, F], on the features' device.

    ``check_finite=False`` skips the NaN/Inf check, which waits for the device: only for features the
    caller has made finite (as ``fp8.encode_rows``)."""
    T = features_TF.shape[0]
    L, H, G, K = layout.num_layers, layout.hidden_size, layout.num_groups, layout.num_outliers
    if tuple(features_TF.shape) != (T, layout.num_features):
        raise SampleError(f"{where}: shape {tuple(features_TF.shape)}, the int4 layout needs [T, {L * H}]")
    bf16_TLH = features_TF.to(torch.bfloat16).reshape(T, L, H)
    x_TLH = bf16_TLH.to(torch.float32)
    if check_finite and not bool(torch.isfinite(x_TLH).all()):
        raise SampleError(f"{where}: NaN or Inf in the features; the int4 codec stores finite values only")
    out_TW = torch.empty((T, layout.row_bytes), dtype=torch.uint8, device=features_TF.device)
    if K:
        x_TLH = store_outliers(bf16_TLH, x_TLH, K, out_TW[:, layout.index_offset :])
    x_TLGg = x_TLH.reshape(T, L, G, H // G)
    e_TLG = pow2_exponents(x_TLGg.abs().amax(dim=-1), INT4_TOP)
    q = (x_TLGg * exp2(-e_TLG, torch.float32).unsqueeze(-1)).round_().clamp_(-8, 7).to(torch.int16)
    nibbles_TP2 = q.reshape(T, L * H // 2, 2).bitwise_and_(0xF)
    packed = nibbles_TP2[..., 0].bitwise_or_(nibbles_TP2[..., 1].bitwise_left_shift(4))
    out_TW[:, : layout.exponents_offset] = packed.to(torch.uint8)
    out_TW[:, layout.exponents_offset : layout.index_offset] = (
        e_TLG.to(torch.int8).reshape(T, L * G).view(torch.uint8)
    )
    return out_TW


def decode_rows(stored_TW: torch.Tensor, layout: Int4Layout, out_TF: torch.Tensor) -> torch.Tensor:
    """Decode uint8 [T, W] stored rows into bf16 ``out_TF`` [T, F] (same device), in place; returns it.

    Exact arithmetic (q × 2^e is a bf16 value), so every device gives the same bits."""
    T = stored_TW.shape[0]
    L, H, G, K = layout.num_layers, layout.hidden_size, layout.num_groups, layout.num_outliers
    assert stored_TW.dtype == torch.uint8, stored_TW.dtype
    assert tuple(stored_TW.shape) == (T, layout.row_bytes), stored_TW.shape
    assert out_TF.dtype == torch.bfloat16, out_TF.dtype
    assert tuple(out_TF.shape) == (T, L * H), out_TF.shape
    packed_TP = stored_TW[:, : layout.exponents_offset].to(torch.int16)
    pairs_TP2 = out_TF.view(T, L * H // 2, 2)
    # Sign-extend each nibble n: (n ^ 8) - 8 maps 0..7 to 0..7 and 8..15 to -8..-1.
    pairs_TP2[..., 0].copy_(packed_TP.bitwise_and(0xF).bitwise_xor_(8).sub_(8))
    pairs_TP2[..., 1].copy_(packed_TP.bitwise_right_shift_(4).bitwise_xor_(8).sub_(8))
    e_TLG = stored_TW[:, layout.exponents_offset : layout.index_offset].view(torch.int8).to(torch.int16)
    # 2^e as bf16 bits: biased exponent e + 127 in bits 7..14 (e in [-100, 120]: always a normal).
    scale_TLG = ((e_TLG + 127) << 7).view(torch.bfloat16).view(T, L, G, 1)
    out_TF.view(T, L, G, H // G).mul_(scale_TLG)
    if K:
        restore_outliers(stored_TW[:, layout.index_offset :], out_TF.view(T, L, H), K)
    return out_TF
