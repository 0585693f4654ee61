"""Training from an nf4 cache: the prefetcher delivers ``decode_rows`` of the reference encoding whether
the reader decodes on the CPU or the stored rows are decoded on the device after the copy, and on the GPU
bit for bit as on the CPU; ``dflash train`` runs from an nf4 cache written by ``dflash generate``."""

from __future__ import annotations

import bisect
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.nf4 import Nf4Layout, decode_rows
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.train.launch import run_training
from dflash_offline.train.loader import device_decode_layout
from dflash_offline.train.metrics import read_metrics
from tests.cache.fp8_reference import LAYERS
from tests.cache.test_nf4 import WIDE, ref_encode, wide_features
from tests.tiny_caches import TinyCaches
from tests.train.helpers import train_config
from tests.train.test_fp8_train import EDGES, delivered, fp8_fingerprint

pytestmark = pytest.mark.timeout(300)
LAYOUT = Nf4Layout(num_layers=LAYERS, hidden_size=WIDE, group_dims=32, num_outliers=2)


@pytest.fixture(scope="module")
def nf4_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A two-session nf4 cache with tiny shards; returns it and each sample's expected bf16 features
    (``decode_rows`` of the reference encoding of what was written)."""
    root = tmp_path_factory.mktemp("nf4")
    fingerprint = replace(fp8_fingerprint(), hidden_size=WIDE, storage_dtype="nf4", codec="nf4")
    rng = np.random.default_rng(4)
    expected = {}
    for session in range(2):
        with ShardWriter(root, fingerprint, worker=session, shard_bytes=4096, chunk_bytes=512) as writer:
            for i in range(session * 30, session * 30 + 30):
                T = int(rng.integers(1, EDGES[-1] + 1))
                x = wide_features(T, seed=i)
                writer.add(
                    SampleToWrite(
                        sample_id=f"nf4:{i:04d}",
                        source_index=i,
                        input_ids_T=rng.integers(0, 50_000, T).astype(np.int32),
                        loss_mask_T=(rng.random(T) < 0.6).astype(np.uint8),
                        features_TF=x,
                        bucket_id=bisect.bisect_left(EDGES, T),
                    )
                )
                rows = torch.from_numpy(ref_encode(x.to(torch.float64).numpy(), 32, 2, hidden=WIDE))
                expected[f"nf4:{i:04d}"] = decode_rows(rows, LAYOUT, torch.empty_like(x))
    return root, expected


@pytest.mark.parametrize("decode_on_device", [False, True])
def test_cpu_batches_hold_the_decoded_reference_rows(nf4_cache, decode_on_device):
    root, expected = nf4_cache
    with CacheReader.open(root) as reader:
        assert device_decode_layout(reader) == LAYOUT
    batches = delivered(root, "cpu", decode_on_device=decode_on_device)
    assert sum(len(b["sample_ids"]) for b in batches) == len(expected)
    for batch in batches:
        want = torch.cat([expected[sid] for sid in batch["sample_ids"]])
        assert torch.equal(batch["features_TF"].view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefetch_decode_equals_cpu_decode_bit_for_bit(nf4_cache):
    root, _expected = nf4_cache
    cpu = delivered(root, "cpu", decode_on_device=False)
    gpu = delivered(root, "cuda", decode_on_device=True)  # nf4 bytes cross PCIe, decoded on the GPU
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu, strict=True):
        for name in ("features_TF", "input_ids_T", "loss_mask_T", "positions_T"):
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.slow
def test_training_runs_from_an_nf4_cache(tiny_caches: TinyCaches, tmp_path: Path) -> None:
    cache = tiny_caches.get(records=40, seed=5, codec="nf4").root
    with CacheReader.open(cache) as reader:
        assert (reader.fingerprint.codec, reader.fingerprint.storage_dtype) == ("nf4", "nf4")
        assert len(reader.samples) > 0
    result = run_training(train_config(cache, tmp_path / "run", max_steps=4, checkpoint_every=100))
    assert result is not None
    assert result.global_step == 4
    losses = [float(m["loss"]) for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]  # type: ignore[arg-type]
    assert len(losses) == 4
    assert all(np.isfinite(losses))
