"""Generate with the lossy (fp8, nf4) codecs, whose rows are encoded in the capture step (where the
features are), against the features of a bf16 run of the same data encoded by ``ShardWriter.add`` (the
writer's own encode) and by the numpy references (tests/cache/fp8_reference.py, tests/cache/test_nf4.py).

Shape legend: T = tokens of one sample, F = features per token, N = tokens of a job,
W = stored bytes per token of an fp8 row.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.codecs import feature_storage
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.fp8 import Fp8Layout, encode_rows
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.data.conversations import TokenizedSample
from dflash_offline.generate.capture_step import PinnedBufferPool, capture_job
from dflash_offline.generate.plan import CaptureJob, bucket_of
from dflash_offline.generate.run import run_generate
from dflash_offline.placement import Placement
from tests.cache.fp8_reference import ref_encode
from tests.cache.test_nf4 import ref_encode as nf4_ref_encode
from tests.tiny_caches import TinyCache, TinyCaches

from . import worker_entry
from .helpers import tiny_config

Stored = dict[str, tuple[np.ndarray, int]]
"""sample_id -> (stored uint8 [T, W] rows, manifest checksum)."""


@pytest.fixture(scope="module")
def bf16_run(tiny_caches: TinyCaches) -> TinyCache:
    """The shared default-codec cache: the same data, planned into the same jobs (the plan does not
    depend on the codec), so its bf16 features are what the fp8 runs encoded."""
    return tiny_caches.get(records=60, seed=0)


def stored_rows(root: Path) -> Stored:
    with CacheReader.open(root, check_checksums=True) as reader:
        t = reader.samples
        ids = sorted(t.sample_id.tolist())
        rows = reader.positions(ids)
        fp = reader.fingerprint
        width = feature_storage(fp.codec, num_layers=len(fp.layer_ids), hidden_size=fp.hidden_size).width
        out = np.empty((int(t.num_tokens[rows].sum()), width), np.uint8)
        read = reader.read_rows(rows, stored_out=out)
        checksums = dict(zip(t.sample_id.tolist(), t.checksum.tolist(), strict=True))
    result: Stored = {}
    for sample in read:
        assert sample.stored_TW is not None
        result[sample.sample_id] = (sample.stored_TW.numpy().copy(), int(checksums[sample.sample_id]))
    return result


def encoded_by_the_writer(bf16_root: Path, fingerprint: CacheFingerprint, dest: Path) -> Stored:
    """Every sample of the bf16 cache handed to ``ShardWriter.add`` as bf16 features (the writer
    encodes them) into a new cache of ``fingerprint``; what it stored."""
    with CacheReader.open(bf16_root) as reader:
        samples = reader.read(sorted(str(s) for s in reader.samples.sample_id))
        source_index = dict(zip(reader.samples.sample_id, reader.samples.source_index, strict=True))
    with ShardWriter(dest, fingerprint, worker=0, flush_seconds=1e9) as writer:
        for s in samples:
            writer.add(
                SampleToWrite(
                    sample_id=s.sample_id,
                    source_index=int(source_index[s.sample_id]),
                    input_ids_T=s.input_ids_T.numpy(),
                    loss_mask_T=s.loss_mask_T.numpy(),
                    features_TF=s.features_TF,
                    bucket_id=s.bucket_id,
                )
            )
    return stored_rows(dest)


def fp8_fingerprint_of(root: Path, bf16_root: Path) -> CacheFingerprint:
    """The fp8 run's fingerprint, checked to differ from the bf16 run's in the codec only."""
    with CacheReader.open(root) as reader:
        fingerprint = reader.fingerprint
    with CacheReader.open(bf16_root) as reader:
        bf16 = reader.fingerprint
    assert replace(bf16, codec=fingerprint.codec, storage_dtype=fingerprint.storage_dtype) == fingerprint
    return fingerprint


@pytest.mark.parametrize("codec", ["fp8", "fp8-zstd-1", "nf4"])
def test_two_workers_store_the_rows_the_writer_encodes(
    bf16_run: TinyCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """Rows encoded in the capture step of two workers: the same bytes and checksums as the same
    features encoded by ``ShardWriter.add``, and as the numpy reference."""
    barrier = tmp_path / "barrier"  # each worker holds its first job until the other holds one
    barrier.mkdir()
    (barrier / "expected").write_text("2")
    monkeypatch.setenv(worker_entry.BARRIER_ENV, str(barrier))
    monkeypatch.setattr("dflash_offline.generate.run.run_worker", worker_entry.run_worker_after_all_ready)
    root = tmp_path / "fp8"
    config = tiny_config(
        root, bf16_run.data, codec=codec, placement=Placement(num_cpu_workers=2, threads_per_worker=1)
    )
    summary = run_generate(config)
    assert summary.status == "finished", summary
    assert all(w.jobs > 0 for w in summary.workers), summary.workers
    assert set(read_table(root, "samples").column("worker").to_pylist()) == {0, 1}
    fingerprint = fp8_fingerprint_of(root, bf16_run.root)
    layout = feature_storage(codec, num_layers=2, hidden_size=fingerprint.hidden_size).lossy
    assert layout is not None
    got = stored_rows(root)
    want = encoded_by_the_writer(bf16_run.root, fingerprint, tmp_path / "reference")
    assert sorted(got) == sorted(want)
    assert len(got) == 60
    features = {s.sample_id: s.features_TF for s in _read_all(bf16_run.root)}
    for sample_id, (rows, checksum) in got.items():
        np.testing.assert_array_equal(rows, want[sample_id][0], err_msg=sample_id)
        assert checksum == want[sample_id][1], sample_id
        reference = (nf4_ref_encode if codec == "nf4" else ref_encode)(
            features[sample_id].to(torch.float64).numpy(),
            layout.group_dims,
            layout.num_outliers,
            layers=layout.num_layers,
            hidden=layout.hidden_size,
        )
        np.testing.assert_array_equal(rows, reference, err_msg=sample_id)


def test_a_nonfinite_sample_is_a_failure_and_its_neighbours_are_stored(
    bf16_run: TinyCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN and Inf in two samples of one job (worker_entry.run_worker_with_nonfinite_features): both
    recorded as ``nonfinite_features`` failures, nothing stored for them; every other sample, the ones
    of the same job included (one with NaNs in its padding), stored as the writer encodes it."""
    poisoned = tmp_path / "poisoned"
    poisoned.mkdir()
    monkeypatch.setenv(worker_entry.NONFINITE_ENV, str(poisoned))
    monkeypatch.setattr(
        "dflash_offline.generate.run.run_worker", worker_entry.run_worker_with_nonfinite_features
    )
    root = tmp_path / "fp8"
    summary = run_generate(tiny_config(root, bf16_run.data, codec="fp8"))
    assert summary.status == "finished", summary
    ids = json.loads((poisoned / "w0.json").read_text())
    failures = read_table(root, "failures").to_pylist()
    assert sorted((f["sample_id"], f["reason"]) for f in failures) == sorted(
        (sid, "nonfinite_features") for sid in ids["nonfinite"]
    )
    got = stored_rows(root)
    want = encoded_by_the_writer(bf16_run.root, fp8_fingerprint_of(root, bf16_run.root), tmp_path / "ref")
    assert sorted(got) == sorted(set(want) - set(ids["nonfinite"]))
    assert ids["padding"] in got
    for sample_id, (rows, checksum) in got.items():
        np.testing.assert_array_equal(rows, want[sample_id][0], err_msg=sample_id)
        assert checksum == want[sample_id][1], sample_id


def _read_all(root: Path) -> list:
    with CacheReader.open(root) as reader:
        return reader.read(sorted(str(s) for s in reader.samples.sample_id))


def _job(lengths: list[int], edges: tuple[int, ...]) -> CaptureJob:
    rng = np.random.default_rng(1)
    samples = tuple(
        TokenizedSample(
            sample_id=f"s{i}",
            source_index=i,
            input_ids_T=rng.integers(0, 1000, size=n, dtype=np.int32),
            loss_mask_T=np.ones(n, np.uint8),
            truncated=False,
        )
        for i, n in enumerate(lengths)
    )
    return CaptureJob(
        job_index=0,
        window=0,
        bucket_id=bucket_of(max(lengths), edges),
        samples=samples,
        already_done=(False,) * len(lengths),
        padded_length=max(lengths),
    )


def test_capture_step_hands_over_rows_encoded_where_the_features_are() -> None:
    """The batch says what its rows are (``fp8``); they are each sample's features encoded, the
    non-finite sample counted, in a bf16 pool buffer used as bytes (13 rows of 25 bytes: an odd
    byte count, from a pool of 162-element buffers, one byte short: the step must ask for 163)."""
    layout = Fp8Layout(num_layers=1, hidden_size=16, group_dims=16, num_outliers=2)
    assert layout.row_bytes == 25
    lengths = [5, 3, 5]
    job = _job(lengths, edges=(8,))
    gen = torch.Generator().manual_seed(3)
    features_BSF = torch.randn(3, 5, 16, generator=gen) * 40
    features_BSF[1, 2, 7] = math.nan  # sample 1's last real token
    features_BSF[1, 3:] = math.inf  # padding: never stored, never counted

    def capture(ids_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        assert mask_BS.tolist()[1] == [1, 1, 1, 0, 0]
        return features_BSF

    pool = PinnedBufferPool(num_buffers=1, elements=162, pin=False)
    batch = capture_job(capture, job, device=torch.device("cpu"), pool=pool, pad_id=0, fp8=layout)
    batch.wait()
    assert batch.fp8 == layout
    assert batch.rows_NW.dtype == torch.uint8
    assert tuple(batch.rows_NW.shape) == (13, 25)
    assert batch.offsets == (0, 5, 8, 13)
    assert batch.nonfinite_B.tolist() == [0, 1, 0]
    for b in (0, 2):
        rows_TW = batch.rows_NW[batch.offsets[b] : batch.offsets[b + 1]]
        want = encode_rows(features_BSF[b, : lengths[b]].to(torch.bfloat16), layout)
        assert torch.equal(rows_TW, want), b
    batch.release()
    bf16 = capture_job(capture, job, device=torch.device("cpu"), pool=pool, pad_id=0, fp8=None)
    assert bf16.fp8 is None
    assert bf16.rows_NW.dtype == torch.bfloat16
    want_NF = torch.cat([features_BSF[b, :n] for b, n in enumerate(lengths)]).to(torch.bfloat16)
    assert torch.equal(bf16.rows_NW.view(torch.int16), want_NF.view(torch.int16))
