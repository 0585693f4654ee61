"""Lossy fp8 storage of features: float8 e4m3 codes with power-of-two scales, and exact outliers.

Shape legend: T = tokens, L = captured layers, H = hidden size, F = L * H, G = scale groups per layer,
K = outliers per (token, layer), W = stored bytes per token.

One stored row (uint8 [W], one per token; the feature array of an fp8 shard group is uint8 [R, W]):

    codes     L * H      float8_e4m3fn bits of x / 2^e (0 at the outlier dims)
    exponents L * G      int8 e of each (token, layer, group of H / G dims)
    outlier   L * K * 2  uint16 little-endian dim index of each (token, layer)'s K largest |x|
    values    L * K * 2  their exact bf16 bits

Why this shape (measured by ``bench/fp8_error.py`` on real SmolLM2-135M features, bench/RESULTS.md):
a few dims carry massive activations (|x| ≈ 24,800 at dims 507, 247, 17 in every layer); with one scale
per (token, layer) they set the scale and push every other dim into e4m3's subnormals. Storing the K
largest |x| of each (token, layer) apart, exactly, lets the scale fit the rest.

Scales are powers of two, the smallest 2^e with max |x| / 2^e ≤ 448 (e4m3's largest finite value):
then x / 2^e is exact in float32, the only rounding is e4m3's own (relative 2^-4 for normal codes),
and the decoded value code × 2^e is exactly representable in bf16, so decoding is exact arithmetic
that gives the same bits on every device (the CPU reader and the GPU prefetcher run the same
``decode_rows``). ``e`` is kept in [-100, 120] so that decoded values stay bf16 normals.

The K outliers are the K largest |x|, ties going to the lower dim: ``torch.topk`` breaks ties
differently on the CPU and on CUDA (on the CPU not by dim either), and bf16 features tie often (8
significant bits), so the encoder ranks unique integer keys instead and every device stores the same bytes.

Values must be finite: ``encode_rows`` refuses NaN/Inf, unless the caller has made them finite already
and says so with ``check_finite=False`` (generate's capture step encodes on the device, where the check
would wait for it; it counts the non-finite tokens of each sample first and stores none of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_offline.errors import SampleError

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
_E_MIN, _E_MAX = -100, 120


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Layout:
    """The byte layout of one stored fp8 row; fixed by the codec name and the fingerprint."""

    num_layers: int
    hidden_size: int
    group_dims: int
    """Dims sharing one scale (a divisor of hidden_size; hidden_size = one scale per (token, layer))."""
    num_outliers: int
    """K: largest-|x| dims of each (token, layer) stored exactly as bf16 (0 = none)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.group_dims:
            raise ValueError(
                f"fp8 scale groups of {self.group_dims} dims do not divide hidden size {self.hidden_size}"
            )
        if self.hidden_size > 65535 or self.num_outliers > self.hidden_size:
            raise ValueError(f"fp8 outliers: K={self.num_outliers} of hidden {self.hidden_size} unsupported")

    @property
    def num_features(self) -> int:
        return self.num_layers * self.hidden_size

    @property
    def num_groups(self) -> int:
        """Scale groups per layer (G)."""
        return self.hidden_size // self.group_dims

    @property
    def exponents_offset(self) -> int:
        return self.num_features

    @property
    def index_offset(self) -> int:
        return self.exponents_offset + self.num_layers * self.num_groups

    @property
    def values_offset(self) -> int:
        return self.index_offset + 2 * self.num_layers * self.num_outliers

    @property
    def row_bytes(self) -> int:
        """W: stored bytes per token."""
        return self.values_offset + 2 * self.num_layers * self.num_outliers

    def to_attributes(self) -> dict[str, int]:
        return {"group_dims": self.group_dims, "num_outliers": self.num_outliers}


def exp2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^e exactly, from the exponent bits (e an integer tensor within the dtype's normal range)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def pow2_exponents(amax: torch.Tensor, top: float = E4M3_MAX) -> torch.Tensor:
    """int32 e: the smallest with amax ≤ top · 2^e (0 where amax is 0), clamped to [-100, 120]."""
    amax = amax.to(torch.float64)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / top)).clamp_(_E_MIN - 1, _E_MAX + 1).to(torch.int32)
    # log2 is not exact: step e to the smallest valid exponent with exact float64 comparisons.
    e = torch.where(safe > top * exp2(e, torch.float64), e + 1, e)
    e = torch.where(safe <= top * exp2(e - 1, torch.float64), e - 1, e)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp_(_E_MIN, _E_MAX)


def top_outliers(bf16_TLH: torch.Tensor, K: int) -> torch.Tensor:
    """int64 [T, L, K]: the dims of the K largest |x| of each (token, layer), ascending, ties going to the
    lower dim on every device (module docstring)."""
    H = bf16_TLH.shape[-1]
    # Unique keys, |x|'s bf16 bits (the 15 below the sign: ordered like |x|) above the dim reversed
    # (16 bits), so that the top K is one set on every device. In place: building the key out of place
    # cost the CPU encode 17 % of its rate.
    dims_H = torch.arange(0xFFFF, 0xFFFF - H, -1, dtype=torch.int32, device=bf16_TLH.device)
    key_TLH = bf16_TLH.view(torch.int16).to(torch.int32)
    key_TLH.bitwise_and_(0x7FFF).bitwise_left_shift_(16).bitwise_or_(dims_H)
    return key_TLH.topk(K, dim=-1).indices.sort(dim=-1).values


def store_outliers(
    bf16_TLH: torch.Tensor, x_TLH: torch.Tensor, K: int, tail_TB: torch.Tensor
) -> torch.Tensor:
    """Write the K outliers of each (token, layer) into ``tail_TB`` (the row's last 4 · L · K bytes:
    uint16 dim indices, then their bf16 bits) and return ``x_TLH`` with those dims zeroed."""
    T, L, _ = bf16_TLH.shape
    idx_TLK = top_outliers(bf16_TLH, K)
    values_TLK = x_TLH.gather(-1, idx_TLK)
    tail_TB[:, : 2 * L * K] = idx_TLK.to(torch.int32).to(torch.int16).reshape(T, L * K).view(torch.uint8)
    tail_TB[:, 2 * L * K :] = values_TLK.to(torch.bfloat16).reshape(T, L * K).view(torch.uint8)
    return x_TLH.scatter(-1, idx_TLK, 0.0)


def restore_outliers(tail_TB: torch.Tensor, out_TLH: torch.Tensor, K: int) -> None:
    """Scatter the exact outliers of ``tail_TB`` (as ``store_outliers`` wrote them) into ``out_TLH``."""
    T, L, _ = out_TLH.shape
    idx = tail_TB[:, : 2 * L * K].contiguous().view(torch.int16)
    idx_TLK = (idx.to(torch.int64) & 0xFFFF).view(T, L, K)
    values = tail_TB[:, 2 * L * K :].contiguous().view(torch.bfloat16).view(T, L, K)
    out_TLH.scatter_(-1, idx_TLK, values)


def encode_rows(
    features_TF: torch.Tensor, layout: Fp8Layout, *, where: str = "features", check_finite: bool = True
) -> torch.Tensor:
    """uint8 [T, W] stored rows of bf16 (or float32) features [T, F], on the features' device.

    ``check_finite=False`` skips the NaN/Inf check, which waits for the device (a ``bool`` of a device
    value): only for features the caller has made finite, since non-finite values give garbage rows."""
    T = features_TF.shape[0]
    L, H, G, K = layout.num_layers, layout.hidden_size, layout.num_groups, layout.num_outliers
    if tuple(features_TF.shape) != (T, layout.num_features):
        raise SampleError(f"{where}: shape {tuple(features_TF.shape)}, the fp8 layout needs [T, {L * H}]")
    bf16_TLH = features_TF.to(torch.bfloat16).reshape(T, L, H)
    x_TLH = bf16_TLH.to(torch.float32)
    if check_finite and not bool(torch.isfinite(x_TLH).all()):
        raise SampleError(f"{where}: NaN or Inf in the features; the fp8 codec stores finite values only")
    out_TW = torch.empty((T, layout.row_bytes), dtype=torch.uint8, device=features_TF.device)
    if K:
        x_TLH = store_outliers(bf16_TLH, x_TLH, K, out_TW[:, layout.index_offset :])
    x_TLGg = x_TLH.reshape(T, L, G, H // G)
    e_TLG = pow2_exponents(x_TLGg.abs().amax(dim=-1))
    scaled = (x_TLGg * exp2(-e_TLG, torch.float32).unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
    out_TW[:, : L * H] = scaled.to(torch.float8_e4m3fn).reshape(T, L * H).view(torch.uint8)
    out_TW[:, layout.exponents_offset : layout.index_offset] = (
        e_TLG.to(torch.int8).reshape(T, L * G).view(torch.uint8)
    )
    return out_TW


def decode_rows(stored_TW: torch.Tensor, layout: Fp8Layout, out_TF: torch.Tensor) -> torch.Tensor:
    """Decode uint8 [T, W] stored rows into bf16 ``out_TF`` [T, F] (same device), in place; returns it.

    Exact arithmetic (code × 2^e is a bf16 value), so every device gives the same bits."""
    T = stored_TW.shape[0]
    L, H, G, K = layout.num_layers, layout.hidden_size, layout.num_groups, layout.num_outliers
    assert stored_TW.dtype == torch.uint8, stored_TW.dtype
    assert tuple(stored_TW.shape) == (T, layout.row_bytes), stored_TW.shape
    assert out_TF.dtype == torch.bfloat16, out_TF.dtype
    assert tuple(out_TF.shape) == (T, L * H), out_TF.shape
    out_TLGg = out_TF.view(T, L, G, H // G)
    out_TLGg.copy_(stored_TW[:, : L * H].view(torch.float8_e4m3fn).view(T, L, G, H // G))
    e_TLG = stored_TW[:, layout.exponents_offset : layout.index_offset].view(torch.int8).to(torch.int16)
    # 2^e as bf16 bits: biased exponent e + 127 in bits 7..14 (e in [-100, 120]: always a normal).
    scale_TLG = ((e_TLG + 127) << 7).view(torch.bfloat16).view(T, L, G, 1)
    out_TLGg.mul_(scale_TLG)
    if K:
        restore_outliers(stored_TW[:, layout.index_offset :], out_TF.view(T, L, H), K)
    return out_TF
