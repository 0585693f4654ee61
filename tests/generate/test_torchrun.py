"""``dflash generate`` under ``torchrun`` with two CPU ranks (gloo): the same samples and bit-equal
features as one in-process worker, the run rows of the one coordinator (``running`` then
``finished``; ``failed`` when a rank dies), a resume that writes nothing new, and a SIGKILL of one
rank followed by a rerun that leaves every sample once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader
from tests.tiny_caches import TinyCache
from tests.torchrun_helpers import rank_pid, torchrun_cmd, torchrun_env

from .helpers import generate_cmd, make_chat_jsonl, run_in_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # each torchrun start costs seconds


def _samples(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray, torch.Tensor]]:
    reader = CacheReader.open(root)
    try:
        ids = [str(s) for s in reader.samples.sample_id]
        return {
            s.sample_id: (s.input_ids_T.numpy(), s.loss_mask_T.numpy(), s.features_TF)
            for s in reader.read(ids)
        }
    finally:
        reader.close()


def _assert_same_samples(got: Path, reference: Path) -> None:
    ids = read_table(got, "samples").column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "a sample was committed twice"
    ref, out = _samples(reference), _samples(got)
    assert set(out) == set(ref)
    for sample_id, (input_ids, mask, features) in ref.items():
        input_ids2, mask2, features2 = out[sample_id]
        assert np.array_equal(input_ids, input_ids2)
        assert np.array_equal(mask, mask2)
        assert torch.equal(features.view(torch.int16), features2.view(torch.int16)), sample_id


def _torchrun_generate(cache: Path, data: Path, *extra: str) -> list[str]:
    return torchrun_cmd(*generate_cmd(cache, data, *extra)[3:])


def _runs(cache: Path) -> list[dict[str, object]]:
    return sorted(read_table(cache, "runs").to_pylist(), key=lambda r: str(r["started_at"]))


def test_torchrun_ranks_write_the_samples_of_one_worker_and_resume(
    tmp_path: Path, uninterrupted_generate: Callable[[int, int], TinyCache]
) -> None:
    shared = uninterrupted_generate(40, 5)  # one worker (the SIGINT test's reference too)
    data, reference = shared.data, shared.root

    cache = tmp_path / "ranks"
    cmd = _torchrun_generate(cache, data)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env())
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_same_samples(cache, reference)
    [run] = _runs(cache)
    assert (run["status"], run["num_workers"], run["error"]) == ("finished", 2, "")
    assert run["samples_committed"] == len(_samples(reference))
    assert run["finished_at"] is not None
    assert (cache / "index.duckdb").is_file()
    # One summary, printed by rank 0 (worker lines of both ranks, which took the jobs between them).
    assert done.stdout.count(": finished in ") == 1
    assert "0 already in the cache" in done.stdout
    assert "worker w000-" in done.stdout
    assert "worker w001-" in done.stdout

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env())
    assert again.returncode == 0, again.stdout + again.stderr
    assert "committed 0 samples, 0 tokens" in again.stdout
    assert f"{run['samples_committed']} already in the cache" in again.stdout
    runs = _runs(cache)
    assert [r["status"] for r in runs] == ["finished", "finished"]
    assert runs[1]["samples_committed"] == 0
    _assert_same_samples(cache, reference)


def test_sigkill_of_one_rank_then_rerun_leaves_every_sample_once(tmp_path: Path) -> None:
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 480, seed=8)
    # Small jobs committed every 0.1 s: rank 1 dies at its first commit (below), when both ranks together
    # had committed about 190 samples on 2 cores: most of the 480 records' jobs are still to do, the
    # reference's forwards cost seconds, not the tens of seconds of a larger set. (The reference packs
    # the same jobs: features are bit-equal only for the same batches.)
    small_jobs = ("--tokens-per-batch", "256", "--flush-seconds", "0.1")
    reference = tmp_path / "reference"
    run_in_process(generate_cmd(reference, data, "--workers", "1", *small_jobs))

    cache = tmp_path / "killed"
    cmd = _torchrun_generate(cache, data, *small_jobs)
    process = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=torchrun_env()
    )
    try:
        # Rank 1 is killed once it has committed work of its own, or at the latest 3 s after its worker
        # started once rank 0 has committed some (on a loaded machine rank 0 may take every early job, and
        # both may still be loading the target 3 s after rank 1's store opened): mid-run either way.
        deadline = time.monotonic() + 200
        victim = started = None
        parts = cache / "manifest" / "samples"
        while time.monotonic() < deadline and process.poll() is None:
            if started is None and list((cache / "shards").glob("w001-*")):
                started = time.monotonic()
            # Committed parts only: one being written is named ``<part>.parquet.tmp-<pid>-<n>``.
            committed_by_1 = list(parts.glob("w001-*.parquet"))
            waited = started is not None and time.monotonic() - started > 3
            if committed_by_1 or (waited and list(parts.glob("w000-*.parquet"))):
                victim = rank_pid(process.pid, 1)
                break
            time.sleep(0.02)
        assert victim is not None, "rank 1 never started before the run ended"
        os.kill(victim, signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0, output.decode(errors="replace")
    [run] = _runs(cache)
    # torchrun stopped rank 0, which recorded the end of the run (not a run left `running`).
    assert run["status"] == "failed", (run, output.decode(errors="replace")[-3000:])
    assert "torchrun stopped rank 0" in str(run["error"])
    committed = read_table(cache, "samples").num_rows
    assert 0 < committed < len(_samples(reference))

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env())
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"{committed} already in the cache" in rerun.stdout
    assert [r["status"] for r in _runs(cache)] == ["failed", "finished"]
    _assert_same_samples(cache, reference)
