"""End-to-end generate on random:tiny: stored features against Hugging Face's own hidden states,
one worker against two, malformed data, fingerprint refusal, and a failing worker."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.manifest import read_runs, read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.status import cache_status
from dflash_offline.data.sources import iter_records
from dflash_offline.data.template import tokenize_conversation
from dflash_offline.errors import FingerprintMismatchError, WorkerError
from dflash_offline.generate.events import WorkerStarted
from dflash_offline.generate.launch import format_summary
from dflash_offline.generate.run import run_generate
from dflash_offline.placement import Placement
from dflash_offline.target_model.loader import load_target
from tests.tiny_caches import TinyCache, TinyCaches, copy_cache

from . import worker_entry
from .helpers import tiny_config


def _all_samples(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray, torch.Tensor, int]]:
    reader = CacheReader.open(root)
    try:
        ids = [str(s) for s in reader.samples.sample_id]
        return {
            s.sample_id: (s.input_ids_T.numpy(), s.loss_mask_T.numpy(), s.features_TF, s.bucket_id)
            for s in reader.read(ids)
        }
    finally:
        reader.close()


def _assert_same_samples(reference: Path, cache: Path) -> None:
    """Every sample of ``reference`` is in ``cache``, and no other: the same ids, mask and bucket, and the
    same features bit for bit."""
    want, got = _all_samples(reference), _all_samples(cache)
    assert set(got) == set(want)
    for sample_id, (ids, mask, features, bucket) in want.items():
        ids2, mask2, features2, bucket2 = got[sample_id]
        assert np.array_equal(ids, ids2)
        assert np.array_equal(mask, mask2)
        assert bucket == bucket2
        assert torch.equal(features.view(torch.int16), features2.view(torch.int16)), sample_id


@pytest.fixture(scope="module")
def generated(tiny_caches: TinyCaches) -> TinyCache:
    """The shared cache of 60 chat records and its data (``chat_data``'s shape)."""
    return tiny_caches.get(records=60, seed=0)


def test_features_equal_hf_hidden_states_of_each_sample_alone(generated: TinyCache) -> None:
    """Reference: the same model's HF ``output_hidden_states[i + 1]``, run on each sample alone.

    The cache computes in float32 on padded batches and stores bf16. Batching changes matmul shapes,
    so float32 results may differ from the single-sample ones in their last bits, which can move a
    bf16 rounding by one ulp: we require every value within one bf16 ulp (at most 2^-7 relative) of the
    float32 reference (plus float32 noise of 1e-6 of the row's largest value), and nearly all of them
    bit-equal to it rounded to bf16 (measured: 99.997 %)."""
    tiny_cache, chat_data = generated.root, generated.data
    target = load_target("random:tiny", device="cpu", dtype=torch.float32)
    fingerprint = CacheReader.open(tiny_cache).fingerprint
    layer_ids = fingerprint.layer_ids
    stored = _all_samples(tiny_cache)
    conversations = {c.sample_id: c for c in iter_records(chat_data) if hasattr(c, "messages")}
    assert set(stored) == set(conversations)  # every record became a sample
    assert len({bucket for *_rest, bucket in stored.values()}) >= 3
    exact = total = 0
    tokenizer = target.tokenizer
    for sample_id, (ids_T, mask_T, features_TF, bucket_id) in stored.items():
        conv = conversations[sample_id]
        chat = [{"role": m.role, "content": m.content} for m in conv.messages]
        rendered = tokenizer.apply_chat_template(chat, tokenize=False)
        reference_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"][:256]
        assert ids_T.tolist() == reference_ids
        expected = tokenize_conversation(tokenizer, conv, max_length=256, too_long="truncate")
        assert np.array_equal(mask_T, expected.loss_mask_T)  # type: ignore[union-attr]
        assert bucket_id == int(np.searchsorted(fingerprint.bucket_edges, len(ids_T), side="left"))
        with torch.no_grad():
            out = target.model(torch.from_numpy(ids_T).long()[None], output_hidden_states=True)
        ref_TF = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        got_TF = features_TF.float()
        assert got_TF.shape == ref_TF.shape
        # Float32 batching noise is relative to the activations' scale (~1e-7 of the largest value),
        # so a value near zero may move by more than its own bf16 ulp: allow 1e-6 of the row scale.
        noise_T1 = 1e-6 * ref_TF.abs().amax(dim=1, keepdim=True)
        assert torch.all((got_TF - ref_TF).abs() <= ref_TF.abs() * 2**-7 + noise_T1)
        exact += int((features_TF == ref_TF.to(torch.bfloat16)).sum())
        total += ref_TF.numel()
    assert exact / total > 0.99


def test_rerun_is_a_no_op_and_index_is_built(generated: TinyCache, tmp_path: Path) -> None:
    tiny_cache, chat_data = copy_cache(generated.root, tmp_path / "cache"), generated.data
    before = _all_samples(tiny_cache)
    summary = run_generate(tiny_config(tiny_cache, chat_data))
    assert summary.samples_committed == 0
    assert summary.skipped_already_done == len(before)
    assert (tiny_cache / "index.duckdb").is_file()
    samples = read_table(tiny_cache, "samples")
    assert samples.num_rows == len(before)  # nothing twice


def test_two_workers_write_the_same_samples_as_one(
    generated: TinyCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_cache, chat_data = generated.root, generated.data
    root = tmp_path / "two"
    # Jobs are handed out dynamically: each worker holds its first job until the other holds one, so
    # that both write samples however fast each starts.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (barrier / "expected").write_text("2")
    monkeypatch.setenv(worker_entry.BARRIER_ENV, str(barrier))
    monkeypatch.setattr("dflash_offline.generate.run.run_worker", worker_entry.run_worker_after_all_ready)
    config = tiny_config(root, chat_data, placement=Placement(num_cpu_workers=2, threads_per_worker=1))
    summary = run_generate(config)
    assert sorted(w.worker for w in summary.workers) == [0, 1]
    assert all(w.jobs > 0 for w in summary.workers), summary.workers
    assert set(read_table(root, "samples").column("worker").to_pylist()) == {0, 1}
    # Which worker took which job depends on timing; the content must not: each sample is computed
    # in the batch it was planned in.
    _assert_same_samples(tiny_cache, root)


def test_summary_tells_start_up_from_the_capture_rate(
    generated: TinyCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dflash_offline.generate.run.run_worker", worker_entry.run_worker_slow_to_load)
    started: list[WorkerStarted] = []
    summary = run_generate(
        tiny_config(tmp_path / "cache", generated.data),
        on_event=lambda e: started.append(e) if isinstance(e, WorkerStarted) else None,
    )
    assert summary.tokens_committed > 0
    # The worker slept before loading; its own load time counts it, and the run's start-up holds that.
    assert started[0].load_seconds >= worker_entry.LOAD_DELAY_SECONDS
    assert started[0].load_seconds <= summary.startup_seconds < summary.seconds
    assert summary.workers[0].timings.load_seconds == started[0].load_seconds
    capture = summary.tokens_committed / (summary.seconds - summary.startup_seconds)
    assert summary.capture_tokens_per_second == pytest.approx(capture)
    assert summary.capture_tokens_per_second > summary.tokens_per_second
    printed = format_summary(summary, cache_dir=str(tmp_path / "cache"))
    assert f"{summary.startup_seconds:.1f} s of it start-up" in printed
    assert f"{capture:,.0f} tok/s after start-up" in printed
    assert f"target and buffers loaded in {started[0].load_seconds:.1f} s" in printed


def test_malformed_rows_become_failures_and_the_rest_is_processed(tmp_path: Path) -> None:
    good = {
        "id": "g",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    }
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"id": "m"}),  # neither messages nor conversations
        json.dumps({"id": "r", "messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps({"id": "e", "messages": []}),
        json.dumps({"id": "n", "messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({**good, "id": "g2"}),
    ]
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    summary = run_generate(tiny_config(tmp_path / "cache", data))
    assert summary.samples_committed == 2
    failures = read_table(tmp_path / "cache", "failures").to_pylist()
    by_index = {row["source_index"]: row["reason"] for row in failures}
    assert by_index == {
        1: "malformed_record",
        2: "malformed_record",
        3: "unknown_role",
        4: "empty_conversation",
        5: "empty_response",
    }
    assert all(row["detail"] for row in failures)


def test_different_fingerprint_is_refused_naming_the_field(generated: TinyCache) -> None:
    tiny_cache, chat_data = generated.root, generated.data
    with pytest.raises(FingerprintMismatchError, match="layer_ids"):
        run_generate(tiny_config(tiny_cache, chat_data, layer_ids=(0, 1)))
    with pytest.raises(FingerprintMismatchError, match="max_length"):
        run_generate(tiny_config(tiny_cache, chat_data, max_length=200))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_failing_worker_stops_the_run_with_its_traceback(
    tmp_path: Path, chat_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Spawned workers run the production worker through a test entry point whose capture step fails.
    monkeypatch.setattr("dflash_offline.generate.run.run_worker", worker_entry.run_faulty_worker)
    config = tiny_config(
        tmp_path / "cache", chat_data, placement=Placement(num_cpu_workers=2, threads_per_worker=1)
    )
    with pytest.raises(WorkerError, match="injected fault"):
        run_generate(config)
    runs = read_table(tmp_path / "cache", "runs").to_pylist()
    assert [r["status"] for r in runs] == ["failed"]
    # What was committed before the failure is intact and the run resumes to completion.
    monkeypatch.undo()
    summary = run_generate(replace(config, placement=Placement(num_cpu_workers=1, threads_per_worker=1)))
    assert summary.status == "finished"
    assert read_table(tmp_path / "cache", "samples").num_rows == 60


def test_a_run_stops_before_the_disk_fills_and_its_rerun_completes_the_same_cache(
    generated: TinyCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache's file system reports 5 GB free for the first two jobs, then 0.4 GB: below
    # --keep-free-gb 1, the planner hands out no more jobs; those handed out are written.
    checks: list[Path] = []

    def free_bytes(path: Path) -> int:
        checks.append(path)
        return 5_000_000_000 if len(checks) <= 2 else 400_000_000

    monkeypatch.setattr("dflash_offline.generate.feed.free_bytes", free_bytes)
    root = tmp_path / "cache"
    summary = run_generate(tiny_config(root, generated.data, keep_free_gb=1.0))
    num_samples = len(_all_samples(generated.root))
    assert summary.status == "interrupted"
    assert "0.40 GB free" in summary.stopped_because
    assert "below `GenerateConfig.keep_free_gb` 1:" in summary.stopped_because
    assert checks[0] == root
    assert 0 < summary.samples_committed < num_samples
    assert summary.stopped_because in format_summary(summary, cache_dir=str(root))
    (run,) = read_runs(root)
    assert (run.status, run.error) == ("interrupted", summary.stopped_because)
    assert cache_status(root).last_run == f"{run.run_id} generate interrupted: {summary.stopped_because}"
    # With space again (no reserve asked), the same command resumes: the cache then holds every sample
    # of a run never stopped, bit for bit.
    resumed = run_generate(tiny_config(root, generated.data))
    assert resumed.status == "finished"
    assert resumed.skipped_already_done == summary.samples_committed
    _assert_same_samples(generated.root, root)
