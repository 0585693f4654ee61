"""``dflash generate`` as a real subprocess: SIGKILL of the whole run at random points, then the same
command again; and live SQL over the manifest while the run is still writing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.verify import verify_cache
from tests.process_helpers import reaped

from . import worker_entry
from .helpers import features_by_id, generate_cmd, make_chat_jsonl, run_in_process, start_in_new_session

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_sigkill_at_random_points_then_rerun_equals_uninterrupted(tmp_path: Path) -> None:
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 600, seed=7)
    reference = tmp_path / "reference"
    started = time.monotonic()
    done = subprocess.run(generate_cmd(reference, data), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    whole_run = time.monotonic() - started

    # Kill points scale with this machine's speed (the uninterrupted run's time): early enough that three
    # kills happen before the run can finish, with rows committed every 0.3 s so that every rerun resumes
    # a cache that holds a part of the work (the time-based commits of a default run are 10 s apart).
    cache = tmp_path / "killed"
    rng = np.random.default_rng(11)
    kills = attempts = 0
    while kills < 3 and attempts < 8:
        attempts += 1
        cmd = generate_cmd(cache, data, "--workers", "2", "--flush-seconds", "0.3")
        with reaped(start_in_new_session(cmd)) as process:
            delay = float(rng.uniform(0.15, 0.3)) * whole_run
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                kills += 1
                continue
        break  # it finished before the kill: the rest of the loop would only re-run a no-op
    assert kills >= 3
    run_in_process(generate_cmd(cache, data))

    samples = read_table(cache, "samples").column("sample_id").to_pylist()
    assert len(samples) == len(set(samples))  # none twice
    ref, got = features_by_id(reference), features_by_id(cache)
    assert set(got) == set(ref)  # none missing
    for sample_id, (features, ids, mask) in ref.items():
        features2, ids2, mask2 = got[sample_id]
        assert np.array_equal(ids, ids2)
        assert np.array_equal(mask, mask2)
        assert torch.equal(features.view(torch.int16), features2.view(torch.int16)), sample_id
    report = verify_cache(cache, progress=False)
    assert report.ok, report


@pytest.mark.timeout(600)
def test_sql_shows_buckets_while_generate_is_writing(tmp_path: Path) -> None:
    # A larger random target so that the run lasts long enough to be observed mid-way.
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 400, seed=3, max_words=200)
    cache = tmp_path / "cache"
    cmd = generate_cmd(cache, data, "--flush-seconds", "1")  # rows to see within a second of writing
    cmd[cmd.index("random:tiny")] = "random:smollm2-135m"
    cmd[cmd.index("0,2")] = "1,8,14"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with reaped(start_in_new_session([*cmd, "--workers", "1"], env=env)) as process:
        deadline = time.monotonic() + 400
        seen: list[dict[str, object]] = []
        while time.monotonic() < deadline and process.poll() is None:
            if (cache / "manifest" / "samples").is_dir():
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "dflash_offline",
                        "sql",
                        str(cache),
                        "--query",
                        "buckets",
                        "--format",
                        "json",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert out.returncode == 0, out.stderr
                rows = json.loads(out.stdout) if out.stdout.strip() else []
                if sum(int(row["samples"]) for row in rows) > 0 and process.poll() is None:
                    seen = rows
                    break
            time.sleep(1.0)
        assert seen, "no bucket rows appeared while the run was writing"
        assert process.poll() is None  # still writing when the histogram was read
        assert not (cache / "index.duckdb").exists()  # so the answer came from the live manifest
        assert {"bucket_id", "samples", "tokens"} <= set(seen[0])


@pytest.mark.timeout(600)
def test_ctrl_c_stops_cleanly_and_the_rerun_completes(tmp_path: Path) -> None:
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 80, seed=5)
    cache = tmp_path / "cache"
    cmd = generate_cmd(cache, data, "--workers", "2")
    # Both workers hold their first job until the run asks them to stop: Ctrl-C lands mid-run with each
    # worker holding a job, however fast the machine (a real model sized to be slow enough cost minutes).
    held = tmp_path / "held"
    held.mkdir()
    with reaped(start_in_new_session(*worker_entry.held_cmd(cmd, held))) as process:
        worker_entry.wait_until_held(held, 2, process)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the process group
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output.decode()[-3000:]
    assert b"resume" in output
    runs = read_table(cache, "runs").to_pylist()
    assert [r["status"] for r in runs] == ["interrupted"]
    partial = read_table(cache, "samples").num_rows
    assert 0 < partial < 80
    assert verify_cache(cache, progress=False).ok
    run_in_process(cmd)
    samples = read_table(cache, "samples").column("sample_id").to_pylist()
    assert len(samples) == len(set(samples)) == 80
