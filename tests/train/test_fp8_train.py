"""Training from an fp8 cache: the prefetcher delivers the reference dequantisation whether the reader
decodes on the CPU or the stored fp8 rows are decoded on the device after the copy; GPU decode equals
CPU decode bit for bit; ``dflash train`` runs from an fp8 cache written by ``dflash generate``."""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.fp8 import Fp8Layout, decode_rows, encode_rows
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.train.launch import run_training
from dflash_offline.train.loader import Prefetcher, device_decode_layout
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.planner import LengthMixingPlanner, ScheduledMicrobatch, schedule_for_rank
from dflash_offline.train.snapshot import take_snapshot
from tests.cache.fp8_reference import CODEC_K, HIDDEN, features, ref_decode, ref_encode
from tests.tiny_caches import TinyCaches
from tests.train.cache_helpers import as_host_dict
from tests.train.helpers import train_config

pytestmark = pytest.mark.timeout(300)
EDGES = (16, 32, 64, 128)


def fp8_fingerprint() -> CacheFingerprint:
    return CacheFingerprint(
        target_id="random:test",
        weights_hash="0" * 16,
        num_target_layers=4,
        layer_ids=(1, 2),
        hidden_size=HIDDEN,
        storage_dtype="float8_e4m3fn",
        codec="fp8",
        tokenizer_hash="tok",
        chat_template_hash="tpl",
        max_length=EDGES[-1],
        too_long="skip",
        bucket_edges=EDGES,
        data_source="synthetic",
        compute_dtype="float32",
    )


@pytest.fixture(scope="module")
def fp8_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A two-session fp8 cache with tiny shards; returns it and each sample's expected bf16 features
    (the reference dequantisation of the reference encoding of what was written)."""
    root = tmp_path_factory.mktemp("fp8")
    rng = np.random.default_rng(4)
    expected = {}
    for session in range(2):
        with ShardWriter(
            root, fp8_fingerprint(), worker=session, shard_bytes=4096, chunk_bytes=512
        ) as writer:
            for i in range(session * 30, session * 30 + 30):
                T = int(rng.integers(1, EDGES[-1] + 1))
                x = features(T, seed=i, outliers=True)
                writer.add(
                    SampleToWrite(
                        sample_id=f"fp8:{i:04d}",
                        source_index=i,
                        input_ids_T=rng.integers(0, 50_000, T).astype(np.int32),
                        loss_mask_T=(rng.random(T) < 0.6).astype(np.uint8),
                        features_TF=x,
                        bucket_id=bisect.bisect_left(EDGES, T),
                    )
                )
                want = ref_decode(ref_encode(x.to(torch.float64).numpy(), HIDDEN, CODEC_K), HIDDEN, CODEC_K)
                expected[f"fp8:{i:04d}"] = torch.from_numpy(want).to(torch.bfloat16)
    return root, expected


def jobs_for(reader: CacheReader) -> list[ScheduledMicrobatch]:
    snap = take_snapshot(reader)
    planner = LengthMixingPlanner(snap, seed=3, tokens_per_microbatch=300, grad_accum=2, world_size=1)
    return list(schedule_for_rank(planner.iterate(1), rank=0, seed=3, reader_rows_N=snap.reader_rows_N))


def delivered(root: Path, device: str, *, decode_on_device: bool | None) -> list[dict[str, torch.Tensor]]:
    with CacheReader.open(root, num_threads=2) as reader:
        jobs = jobs_for(reader)
        with Prefetcher(
            reader, jobs, device=device, prefetch=3, num_threads=2, decode_on_device=decode_on_device
        ) as prefetcher:
            out = []
            for batch, job in zip(prefetcher, jobs, strict=True):
                assert batch.plan == job.plan
                assert batch.inputs.features_TF.device.type == torch.device(device).type
                out.append({**as_host_dict(batch), "sample_ids": job.plan.sample_ids})
    return out


@pytest.mark.parametrize("decode_on_device", [False, True])
def test_cpu_batches_hold_the_reference_dequantisation(fp8_cache, decode_on_device):
    root, expected = fp8_cache
    with CacheReader.open(root) as reader:
        assert device_decode_layout(reader) is not None
    batches = delivered(root, "cpu", decode_on_device=decode_on_device)
    assert sum(len(b["sample_ids"]) for b in batches) == len(expected)
    for batch in batches:
        want = torch.cat([expected[sid] for sid in batch["sample_ids"]])
        got = batch["features_TF"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_equals_cpu_decode_bit_for_bit(fp8_cache):
    root, _expected = fp8_cache
    cpu = delivered(root, "cpu", decode_on_device=False)
    gpu = delivered(root, "cuda", decode_on_device=True)  # fp8 bytes cross PCIe, decoded on the GPU
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu, strict=True):
        for name in ("features_TF", "input_ids_T", "loss_mask_T", "positions_T"):
            assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    # The decode function itself on arbitrary valid rows, large enough for several CUDA blocks.
    layout = Fp8Layout(num_layers=5, hidden_size=576, group_dims=576, num_outliers=4)
    x = (torch.randn(3000, 2880) * torch.logspace(-3, 2, 2880)).to(torch.bfloat16)
    x[:, [17, 600, 1400]] = 24_000.0
    stored = encode_rows(x, layout)
    on_cpu = decode_rows(stored, layout, torch.empty_like(x))
    on_gpu = decode_rows(stored.cuda(), layout, torch.empty_like(x, device="cuda")).cpu()
    assert torch.equal(on_cpu.view(torch.int16), on_gpu.view(torch.int16))
    # Encoding on the GPU: the CPU's bytes (ties among the top-K |x| go to the lower dim on both).
    encoded_on_gpu = encode_rows(x.cuda(), layout).cpu()
    assert torch.equal(encoded_on_gpu, stored)
    again = decode_rows(encoded_on_gpu, layout, torch.empty_like(x)).float()
    assert torch.equal(again[:, [17, 600, 1400]], x[:, [17, 600, 1400]].float())
    assert ((again - x.float()).norm() / x.float().norm()).item() < 0.05


@pytest.mark.slow
def test_training_runs_from_an_fp8_cache(tiny_caches: TinyCaches, tmp_path: Path) -> None:
    cache = tiny_caches.get(records=40, seed=5, codec="fp8").root
    with CacheReader.open(cache) as reader:
        assert reader.fingerprint.codec == "fp8"
        assert reader.fingerprint.storage_dtype == "float8_e4m3fn"
        assert len(reader.samples) > 0
    result = run_training(train_config(cache, tmp_path / "run", max_steps=4, checkpoint_every=100))
    assert result is not None
    assert result.global_step == 4
    losses = [float(m["loss"]) for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]  # type: ignore[arg-type]
    assert len(losses) == 4
    assert all(np.isfinite(losses))


def test_prefetcher_keeps_bf16_caches_on_the_reader_decode_path(tmp_path: Path) -> None:
    from tests.train.cache_helpers import make_samples, write_cache

    write_cache(tmp_path, make_samples(5, seed=0))
    with CacheReader.open(tmp_path) as reader:
        assert device_decode_layout(reader) is None
