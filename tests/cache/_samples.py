"""Deterministic test samples for the cache tests (also imported by the crash-test subprocess).

Shape legend: T = tokens of one sample, F = features per token.
Features are uniformly random uint16 bit patterns (so every class of bf16 value occurs: NaNs with
payloads, ±inf, subnormals, ±0), with the special patterns planted explicitly as well; the expected
values are regenerated from (seed, index) alone, independently of which session wrote a sample.
"""

from __future__ import annotations

import bisect
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.manifest import PartName
from dflash_offline.cache.rows import CachedSample, SampleToWrite

# Tiny geometry: F = 16 features (32 B a row), 8-row inner chunks, 64-row shards, so a few dozen
# samples cross many chunk and shard boundaries.
TINY = dict(chunk_bytes=256, shard_bytes=2048)

SPECIAL_BF16_BITS = np.array(
    [
        0x7FC1,  # quiet NaN with a payload
        0xFFC1,  # negative quiet NaN with a payload
        0x7F81,  # signalling NaN payload
        0x7FFF,
        0xFFFF,
        0x7F80,  # +inf
        0xFF80,  # -inf
        0x0000,
        0x8000,  # -0
        0x0001,  # smallest subnormal
        0x807F,
    ],
    dtype=np.uint16,
)


def make_fingerprint(
    *, codec: str = "blosc-zstd-1-shuffle", hidden_size: int = 8, **changes: object
) -> CacheFingerprint:
    fields: dict[str, object] = dict(
        target_id="random:tiny",
        weights_hash="0123abcd",
        num_target_layers=4,
        layer_ids=(1, 2),
        hidden_size=hidden_size,
        storage_dtype="bfloat16",
        codec=codec,
        tokenizer_hash="tok",
        chat_template_hash="tpl",
        max_length=64,
        too_long="skip",
        bucket_edges=(4, 8, 16, 32),
        data_source="unit-test",
        compute_dtype="float32",
    )
    fields.update(changes)
    return CacheFingerprint(**fields)  # type: ignore[arg-type]


def make_sample(
    fingerprint: CacheFingerprint, index: int, *, seed: int = 0, num_tokens: int | None = None
) -> SampleToWrite:
    rng = np.random.default_rng([seed, index])
    T = int(num_tokens if num_tokens is not None else rng.integers(1, 48))
    F = fingerprint.feature_width
    bits_TF = rng.integers(0, 1 << 16, size=(T, F), dtype=np.uint16)
    flat = bits_TF.reshape(-1)
    where = rng.choice(flat.size, size=min(flat.size, len(SPECIAL_BF16_BITS)), replace=False)
    flat[where] = SPECIAL_BF16_BITS[: len(where)]
    features_TF = torch.from_numpy(bits_TF.view(np.int16)).view(torch.bfloat16)
    return SampleToWrite(
        sample_id=f"s{seed}-{index:05d}",
        source_index=index,
        input_ids_T=rng.integers(0, 50_000, size=T, dtype=np.int32),
        loss_mask_T=rng.integers(0, 2, size=T).astype(np.uint8),
        features_TF=features_TF,
        bucket_id=bisect.bisect_left(fingerprint.bucket_edges, T),
    )


def make_samples(
    fingerprint: CacheFingerprint, indices: Iterable[int], *, seed: int = 0
) -> list[SampleToWrite]:
    return [make_sample(fingerprint, i, seed=seed) for i in indices]


def bits(features_TF: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a bf16 tensor (NaN-safe comparison)."""
    return features_TF.view(torch.int16).numpy().view(np.uint16)


def assert_same(got: CachedSample, want: SampleToWrite) -> None:
    assert got.sample_id == want.sample_id
    assert got.features_TF.dtype == torch.bfloat16
    assert got.features_TF.shape == want.features_TF.shape
    np.testing.assert_array_equal(bits(got.features_TF), bits(want.features_TF))
    np.testing.assert_array_equal(got.input_ids_T.numpy(), want.input_ids_T)
    assert got.input_ids_T.dtype == torch.int32
    np.testing.assert_array_equal(got.loss_mask_T.numpy(), want.loss_mask_T)
    assert got.loss_mask_T.dtype == torch.uint8
    assert got.bucket_id == want.bucket_id


def copy_part(part: Path, stem: str) -> Path:
    """A byte copy of a manifest part under another stem, named as the writer names parts (with the
    sha256 of its bytes): what a second commit of the same rows looks like."""
    digest = PartName.parse(part).digest
    copy = part.with_name(f"{stem}.{digest}.parquet" if digest else f"{stem}.parquet")
    shutil.copy(part, copy)
    return copy
