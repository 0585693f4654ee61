"""The lossy row codecs behind one pair of calls: a cache's ``FeatureStorage.lossy`` layout says which.

Shape legend: T = tokens, F = features per token, W = stored bytes per token (``layout.row_bytes``).
Every lossy codec stores a token as one uint8 row of W bytes whose decode is exact arithmetic, the same
bits on every device (``fp8.py``, ``nf4.py``): the writer, generate's capture step, the CPU reader and
the training prefetcher call these two and never the codec modules themselves.
"""

from __future__ import annotations

import torch

from dflash_offline.cache import fp8, nf4
from dflash_offline.cache.fp8 import Fp8Layout
from dflash_offline.cache.nf4 import Nf4Layout

LossyLayout = Fp8Layout | Nf4Layout
"""The row layout of a lossy codec."""


def encode_rows(
    features_TF: torch.Tensor, layout: LossyLayout, *, where: str = "features", check_finite: bool = True
) -> torch.Tensor:
    """uint8 [T, W] stored rows of bf16 (or float32) features [T, F], on the features' device."""
    if isinstance(layout, Nf4Layout):
        return nf4.encode_rows(features_TF, layout, where=where, check_finite=check_finite)
    return fp8.encode_rows(features_TF, layout, where=where, check_finite=check_finite)


def decode_rows(stored_TW: torch.Tensor, layout: LossyLayout, out_TF: torch.Tensor) -> torch.Tensor:
    """Decode uint8 [T, W] stored rows into bf16 ``out_TF`` [T, F] (same device), in place; returns it."""
    if isinstance(layout, Nf4Layout):
        return nf4.decode_rows(stored_TW, layout, out_TF)
    return fp8.decode_rows(stored_TW, layout, out_TF)
