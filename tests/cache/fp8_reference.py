"""An independent numpy reference of the fp8 feature codec, and bf16 test features for it.

Shape legend: T = tokens, L = layers, H = hidden size, K = outliers, W = stored bytes per token.
The reference re-derives e4m3 from its definition (sign, 4 exponent bits with bias 7, 3 mantissa
bits, subnormals at exponent 0, 0x7F/0xFF NaN), rounds to nearest-even by searching the value grid,
and lays out the row as cache/fp8.py documents it; it shares no code with the production functions.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dflash_offline.cache.codecs import FP8_SCHEME

HIDDEN, LAYERS, K = 16, 2, 4
CODEC_K = FP8_SCHEME.num_outliers
"""Outliers of the ``fp8`` codecs (the planted test data has K ≥ CODEC_K of distinct size)."""


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


POSITIVE_CODES = np.arange(0x7F)  # 0x00 .. 0x7E: every finite non-negative value, ascending
GRID = np.array([e4m3_value(int(c)) for c in POSITIVE_CODES])


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """uint8 e4m3 codes of float64 values within ±448, rounded to nearest, ties to the even code."""
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(GRID, mag), 1, len(GRID) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - GRID[lo], GRID[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(mag == GRID[hi], hi, pick)
    return (pick | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def ref_encode(
    x_TF: np.ndarray, group: int, k: int, *, layers: int = LAYERS, hidden: int = HIDDEN
) -> np.ndarray:
    """uint8 [T, W] rows of float64 (bf16-valued) features, as cache/fp8.py documents them."""
    T = x_TF.shape[0]
    x = x_TF.reshape(T, layers, hidden).copy()
    G = hidden // group
    codes = np.zeros((T, layers, hidden), np.uint8)
    exps = np.zeros((T, layers, G), np.int8)
    idx = np.zeros((T, layers, k), np.uint16)
    vals = np.zeros((T, layers, k), np.float64)
    for t in range(T):
        for layer in range(layers):
            row = x[t, layer]
            top = np.sort(np.argsort(-np.abs(row), kind="stable")[:k])
            idx[t, layer], vals[t, layer] = top, row[top]
            rest = row.copy()
            rest[top] = 0.0
            for g in range(G):
                part = rest[g * group : (g + 1) * group]
                amax = float(np.abs(part).max())
                e = 0
                if amax > 0:
                    e = math.ceil(math.log2(amax / 448))
                    while amax > 448 * 2.0**e:
                        e += 1
                    while amax <= 448 * 2.0 ** (e - 1):
                        e -= 1
                exps[t, layer, g] = e
                codes[t, layer, g * group : (g + 1) * group] = round_e4m3(part / 2.0**e)
    vals_bits = (vals.astype(np.float32).view(np.uint32) >> 16).astype("<u2")  # exact: bf16 values
    return np.concatenate(
        [
            codes.reshape(T, -1),
            exps.reshape(T, -1).view(np.uint8),
            idx.astype("<u2").reshape(T, -1).view(np.uint8),
            vals_bits.reshape(T, -1).view(np.uint8),
        ],
        axis=1,
    )


def ref_decode(stored_TW: np.ndarray, group: int, k: int) -> np.ndarray:
    """float64 [T, F] of stored rows."""
    T = stored_TW.shape[0]
    F, G = LAYERS * HIDDEN, HIDDEN // group
    codes = stored_TW[:, :F]
    value = np.vectorize(e4m3_value)(codes.astype(np.int64)).reshape(T, LAYERS, G, group)
    exps = stored_TW[:, F : F + LAYERS * G].copy().view(np.int8).reshape(T, LAYERS, G, 1)
    out = (value * np.exp2(exps.astype(np.float64))).reshape(T, LAYERS, HIDDEN)
    if k:
        a = F + LAYERS * G
        idx = stored_TW[:, a : a + 2 * LAYERS * k].copy().view("<u2").reshape(T, LAYERS, k)
        vals = bf16_to_f64(stored_TW[:, a + 2 * LAYERS * k :].copy().view("<u2")).reshape(T, LAYERS, k)
        np.put_along_axis(out, idx.astype(np.int64), vals, axis=-1)
    return out.reshape(T, F)


def features(T: int, seed: int, *, outliers: bool) -> torch.Tensor:
    """bf16 [T, F]: Gaussian dims of mixed scale, and (``outliers``) K massive activations of distinct
    size per (token, layer), so that the K largest |x| are unambiguous."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, LAYERS, HIDDEN)) * np.exp2(rng.integers(-12, 6, size=(1, LAYERS, HIDDEN)))
    x[:, :, 3] = 0.0  # exact zeros
    if outliers:
        for j, dim in enumerate((5, 11, 0, 14)[:K]):
            x[:, :, dim] = rng.choice([-1, 1], size=(T, LAYERS)) * 1000.0 * (j + 2)
    return torch.from_numpy(x.reshape(T, -1).astype(np.float32)).to(torch.bfloat16)


def as_f64(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float64).numpy()
