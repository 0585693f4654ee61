"""Lossy 4-bit storage of features: NF4 codes, a power-of-two scale per group of dims, exact outliers.

Shape legend: T = tokens, L = captured layers, H = hidden size, F = L * H, G = scale groups per layer,
K = outliers per (token, layer), W = stored bytes per token.

One stored row (uint8 [W], one per token; the feature array of an nf4 shard group is uint8 [R, W]):

    codes     L * H / 2  4-bit codes c of x / 2^e, two a byte: dim 2i in the low nibble, dim 2i + 1
                         in the high one (code 7, the level 0, at the outlier dims)
    exponents L * G      int8 e of each (token, layer, group of H / G dims)
    outlier   L * K * 2  uint16 little-endian dim index of each (token, layer)'s K largest |x|
    values    L * K * 2  their exact bf16 bits

A code c stands for ``LEVELS[c]`` × 2^e: the 16 NF4 levels (the normal distribution's quantiles scaled
to [-1, 1], QLoRA's data type) rounded to bf16. The outliers are those of the fp8 codec (``fp8.py``: the
massive activations, ties to the lower dim on every device), and so is the scale rule, with 1 where
fp8 has 448: e is the smallest with max |x| / 2^e ≤ 1 over the group's other dims. x / 2^e is exact in
float32; its code is that of the nearest level, found by exact comparisons with the float32 midpoints
of adjacent levels (a value on a midpoint takes the lower level), the same on every device. So every
non-outlier element decodes within half the gap between the two levels around x / 2^e, times 2^e (at
most 0.153 × 2^e, 2^e < 2 max |x| of its group). Decoding ``LEVELS[c]`` × 2^e is exact in bf16 (e in
[-100, 120]), so the CPU reader and the GPU prefetcher give the same bits.

Why this format (``bench/fp8_error.py --format nf4`` on 54.8k tokens of real SmolLM2-135M features):
under the same power-of-two scales per 32 dims and 2 outliers, NF4 codes lose less than fp4 (e2m1)
and uniform int4 codes on every captured layer (relative error, layers 1/8/14/20/27: NF4 .111 .096 .019
.025 .042; e2m1 .117 .098 .023 .028 .044; int4 .150 .129 .026 .036 .056); groups of 32 dims and 2
outliers keep the row within 0.28 of bf16's bytes at hidden sizes 576 (0.273) and 4,096 (0.267).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_offline.cache.fp8 import exp2, pow2_exponents, restore_outliers, store_outliers
from dflash_offline.errors import SampleError

NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
"""The NF4 levels (QLoRA): code c stands for the bf16 rounding of ``NF4_LEVELS[c]``, times 2^e."""
ZERO_CODE = 7
"""The code of the level 0."""


def levels(device: torch.device) -> torch.Tensor:
    """bf16 [16]: the stored levels, ascending."""
    return torch.tensor(NF4_LEVELS, dtype=torch.float32).to(torch.bfloat16).to(device)


def midpoints(device: torch.device) -> torch.Tensor:
    """float32 [15]: the midpoints of adjacent bf16 levels, exact (a sum of two bf16 values is exact in
    float32)."""
    lv = levels(device).to(torch.float32)
    return (lv[1:] + lv[:-1]) / 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Nf4Layout:
    """The byte layout of one stored nf4 row; fixed by the codec name and the fingerprint."""

    num_layers: int
    hidden_size: int
    group_dims: int
    """Dims sharing one scale (an even divisor of hidden_size)."""
    num_outliers: int
    """K: largest-|x| dims of each (token, layer) stored exactly as bf16 (0 = none)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.group_dims or self.group_dims % 2:
            raise ValueError(
                f"nf4 scale groups of {self.group_dims} dims: need an even divisor of hidden size "
                f"{self.hidden_size}"
            )
        if self.hidden_size > 65535 or self.num_outliers > self.hidden_size:
            raise ValueError(f"nf4 outliers: K={self.num_outliers} of hidden {self.hidden_size} unsupported")

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
    features_TF: torch.Tensor, layout: Nf4Layout, *, where: str = "features", check_finite: bool = True
) -> torch.Tensor:
    """uint8 [T, W] stored rows of bf16 (or float32) features [T, F], on the features' device.

    ``check_finite=False`` skips the NaN/Inf check, which waits for the device: only for features the
    caller has made finite (as ``fp8.encode_rows``)."""
    T = features_TF.shape[0]
    L, H, G, K = layout.num_layers, layout.hidden_size, layout.num_groups, layout.num_outliers
    if tuple(features_TF.shape) != (T, layout.num_features):
        raise SampleError(f"{where}: shape {tuple(features_TF.shape)}, the nf4 layout needs [T, {L * H}]")
    bf16_TLH = features_TF.to(torch.bfloat16).reshape(T, L, H)
    x_TLH = bf16_TLH.to(torch.float32)
    if check_finite and not bool(torch.isfinite(x_TLH).all()):
        raise SampleError(f"{where}: NaN or Inf in the features; the nf4 codec stores finite values only")
    out_TW = torch.empty((T, layout.row_bytes), dtype=torch.uint8, device=features_TF.device)
    if K:
        x_TLH = store_outliers(bf16_TLH, x_TLH, K, out_TW[:, layout.index_offset :])
    x_TLGg = x_TLH.reshape(T, L, G, H // G)
    e_TLG = pow2_exponents(x_TLGg.abs().amax(dim=-1), 1.0)
    v_TLGg = x_TLGg * exp2(-e_TLG, torch.float32).unsqueeze(-1)
    # Nearest level: the count of midpoints below v (v on a midpoint: the lower level).
    codes = torch.bucketize(v_TLGg, midpoints(features_TF.device)).to(torch.int16)
    nibbles_TP2 = codes.reshape(T, L * H // 2, 2)
    packed = nibbles_TP2[..., 0].bitwise_or(nibbles_TP2[..., 1].bitwise_left_shift(4))
    out_TW[:, : layout.exponents_offset] = packed.to(torch.uint8)
    out_TW[:, layout.exponents_offset : layout.index_offset] = (
        e_TLG.to(torch.int8).reshape(T, L * G).view(torch.uint8)
    )
    return out_TW


def decode_rows(stored_TW: torch.Tensor, layout: Nf4Layout, out_TF: torch.Tensor) -> torch.Tensor:
    """Decode uint8 [T, W] stored rows into bf16 ``out_TF`` [T, F] (same device), in place; returns it.

    Exact arithmetic (a level × 2^e is a bf16 value), so every device gives the same bits."""
    T = stored_TW.shape[0]
    L, H, G, K = layout.num_layers, layout.hidden_size, layout.num_groups, layout.num_outliers
    assert stored_TW.dtype == torch.uint8, stored_TW.dtype
    assert tuple(stored_TW.shape) == (T, layout.row_bytes), stored_TW.shape
    assert out_TF.dtype == torch.bfloat16, out_TF.dtype
    assert tuple(out_TF.shape) == (T, L * H), out_TF.shape
    packed_TP = stored_TW[:, : layout.exponents_offset].to(torch.int64)
    lv = levels(stored_TW.device)
    pairs_TP2 = out_TF.view(T, L * H // 2, 2)
    pairs_TP2[..., 0].copy_(lv[packed_TP.bitwise_and(0xF)])
    pairs_TP2[..., 1].copy_(lv[packed_TP.bitwise_right_shift_(4)])
    e_TLG = stored_TW[:, layout.exponents_offset : layout.index_offset].view(torch.int8).to(torch.int16)
    # 2^e as bf16 bits: biased exponent e + 127 in bits 7..14 (e in [-100, 120]: always a normal).
    scale_TLG = ((e_TLG + 127) << 7).view(torch.bfloat16).view(T, L, G, 1)
    out_TF.view(T, L, G, H // G).mul_(scale_TLG)
    if K:
        restore_outliers(stored_TW[:, layout.index_offset :], out_TF.view(T, L, H), K)
    return out_TF
