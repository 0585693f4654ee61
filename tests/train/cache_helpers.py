"""Tiny real caches for the training data path tests, written through ``ShardWriter``.

Every sample's source arrays are kept in memory so that tests compare what the prefetcher delivers
with what was written (an independent reference), not with another read of the cache.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.train.planner import PackedMicrobatch

EDGES = (16, 32, 64, 128)
HIDDEN = 8
LAYERS = (1, 2)
WIDTH = HIDDEN * len(LAYERS)


def fingerprint(edges: tuple[int, ...] = EDGES) -> CacheFingerprint:
    return CacheFingerprint(
        target_id="random:test",
        weights_hash="0" * 16,
        num_target_layers=4,
        layer_ids=LAYERS,
        hidden_size=HIDDEN,
        storage_dtype="bfloat16",
        codec="blosc-zstd-1-shuffle",
        tokenizer_hash="tok",
        chat_template_hash="tpl",
        max_length=edges[-1],
        too_long="skip",
        bucket_edges=edges,
        data_source="synthetic",
        compute_dtype="float32",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class WrittenSample:
    """What a test wrote for one sample (the reference for reads)."""

    input_ids_T: np.ndarray
    """int32 [T]."""
    loss_mask_T: np.ndarray
    """uint8 [T]."""
    features_TF: torch.Tensor
    """bfloat16 [T, F]."""


def make_samples(
    num_samples: int, *, seed: int, start: int = 0, lengths: list[int] | None = None
) -> list[SampleToWrite]:
    """Random samples of 1..128 tokens (all four buckets) unless ``lengths`` are given; random bits in
    every feature (NaN payloads too)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(start, start + num_samples):
        num_tokens = int(rng.integers(1, EDGES[-1] + 1)) if lengths is None else lengths[i - start]
        bits = rng.integers(0, 1 << 16, size=(num_tokens, WIDTH), dtype=np.uint16)
        out.append(
            SampleToWrite(
                sample_id=f"synthetic:{i:05d}",
                source_index=i,
                input_ids_T=rng.integers(0, 50_000, num_tokens).astype(np.int32),
                loss_mask_T=(rng.random(num_tokens) < 0.6).astype(np.uint8),
                features_TF=torch.from_numpy(bits).view(torch.bfloat16),
                bucket_id=bisect.bisect_left(EDGES, num_tokens),
            )
        )
    return out


def write_cache(root: Path, samples: list[SampleToWrite], *, worker: int = 0) -> dict[str, WrittenSample]:
    """Write ``samples`` in one writer session with tiny shards (many shard boundaries)."""
    with ShardWriter(root, fingerprint(), worker=worker, shard_bytes=2048, chunk_bytes=256) as writer:
        for sample in samples:
            writer.add(sample)
    return {
        s.sample_id: WrittenSample(
            input_ids_T=s.input_ids_T, loss_mask_T=s.loss_mask_T, features_TF=s.features_TF.clone()
        )
        for s in samples
    }


PACKED_TENSORS = (
    "input_ids_T",
    "features_TF",
    "loss_mask_T",
    "doc_ids_T",
    "positions_T",
    "cu_seqlens_D1",
    "anchors_A",
)
"""The tensors of a ``PackedMicrobatch`` the tests compare."""


def as_host_dict(batch: PackedMicrobatch) -> dict[str, torch.Tensor]:
    """The batch's tensors on the CPU, by name."""
    return {
        name: (batch.cu_seqlens_D1 if name == "cu_seqlens_D1" else getattr(batch.inputs, name)).cpu()
        for name in PACKED_TENSORS
    }
