"""SIGKILL of ``dflash generate --window-limit``, of ``dflash train --follow`` and of both, at random
points, as real subprocesses on the CPU (generate with two workers); each rerun with the same command.
Each training sample is trained exactly ``--passes`` times counted from the run's records, no retired
store is ever read (a read of one would fail the run: its files are gone), the validation stores are
never retired, and every sample equals a plain generate's (docs/follow.md)."""

from __future__ import annotations

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
from dflash_offline.train.damaged import DAMAGED_FILE
from tests.generate.helpers import (
    features_by_id,
    generate_cmd,
    make_chat_jsonl,
    run_in_process,
    start_in_new_session,
)
from tests.train.helpers import train_config
from tests.train.test_follow import VAL_FRACTION, check_followed

pytestmark = pytest.mark.slow


def follow_cmd(cache: Path, run: Path) -> list[str]:
    return [
        sys.executable, "-m", "dflash_offline", "train", "--follow", "--passes", "2",
        "--cache", str(cache), "--out", str(run),
        "--num-layers", "1", "--block-size", "8", "--num-anchors", "32",
        "--tokens-per-microbatch", "600", "--lr", "3e-3", "--grad-accum", "1", "--checkpoint-every", "3",
        "--val-fraction", str(VAL_FRACTION), "--val-every", "1000",
        "--loader-threads", "2", "--prefetch", "2", "--deterministic", "--threads", "1", "--no-progress",
    ]  # fmt: skip


def kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.timeout(1800)
def test_sigkill_generate_train_and_both_during_follow(tmp_path: Path) -> None:
    # 60 records: a window of 1 MB holds a few of their 11 stores, and generate and training both run
    # well past the last kill (three kills within 24 s of the start, each costing the victim a start-up
    # of seconds: the uninterrupted pair takes about 30 s on 2 cores, and training, the slower, waits for
    # generate to finish).
    data = make_chat_jsonl(tmp_path / "chat.jsonl", 60, seed=9)
    reference = tmp_path / "reference"
    run_in_process(generate_cmd(reference, data))

    cache, run = tmp_path / "window", tmp_path / "run"
    gen_cmd = generate_cmd(
        cache, data, "--workers", "2", "--flush-seconds", "0.2", "--window-limit", "1MB",
        "--val-fraction", str(VAL_FRACTION),
    )  # fmt: skip
    train_cmd = follow_cmd(cache, run)
    rng = np.random.default_rng(5)
    plan = ["generate", "train", "both"]
    generate = start_in_new_session(gen_cmd)
    train = start_in_new_session(train_cmd)
    deadline = time.monotonic() + 1500
    try:
        for victim in plan:
            time.sleep(float(rng.uniform(2.0, 8.0)))
            if victim in ("generate", "both"):
                kill(generate)
            if victim in ("train", "both"):
                kill(train)
            # A process that ended is read to its end (which closes its pipe) before it is replaced.
            if generate.poll() is not None:
                output = generate.communicate()[0].decode()
                assert generate.returncode in (0, -signal.SIGKILL), output
                generate = start_in_new_session(gen_cmd)
            if train.poll() is not None:
                output = train.communicate()[0].decode()
                assert train.returncode in (0, -signal.SIGKILL), output
                train = start_in_new_session(train_cmd)
        # Both end by themselves: generate once its data is done, train once generate finished and every
        # store was trained. Either failing fails the test at once (the other would wait for it forever).
        while (generate.poll() is None or train.poll() is None) and time.monotonic() < deadline:
            for process in (generate, train):
                if process.poll() not in (None, 0):
                    raise AssertionError(process.communicate()[0].decode()[-3000:])
            time.sleep(0.1)
        for process in (generate, train):
            output = process.communicate(timeout=5)[0].decode()
            assert process.returncode == 0, output[-3000:]
    finally:
        kill(generate)
        kill(train)

    check_followed(cache, run, train_config(cache, run, max_steps=None, val_fraction=VAL_FRACTION))
    assert "train" in read_table(cache, "waits", ["side"]).column("side").to_pylist()  # it started first
    assert not list(run.rglob(DAMAGED_FILE))
    rows = read_table(cache, "samples", ["sample_id", "checksum"]).to_pydict()
    ref_rows = read_table(reference, "samples", ["sample_id", "checksum"]).to_pydict()
    assert len(rows["sample_id"]) == len(set(rows["sample_id"]))  # none committed twice
    assert dict(zip(rows["sample_id"], rows["checksum"], strict=True)) == dict(
        zip(ref_rows["sample_id"], ref_rows["checksum"], strict=True)
    )
    ref, got = features_by_id(reference), features_by_id(cache)
    assert got
    for sample_id, (features, ids, mask) in got.items():
        features_ref, ids_ref, mask_ref = ref[sample_id]
        assert np.array_equal(ids, ids_ref)
        assert np.array_equal(mask, mask_ref)
        assert torch.equal(features.view(torch.int16), features_ref.view(torch.int16)), sample_id
