"""``dflash generate`` started the way a script starts a background job (``cmd &`` in a non-interactive
shell: SIGINT inherited as ignored) still stops on SIGINT: exit 130, committed samples kept, the run row
``interrupted``, and the rerun completes to the cache of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.verify import verify_cache
from tests.tiny_caches import TinyCache

from . import worker_entry
from .helpers import features_by_id, generate_cmd, run_in_process

pytestmark = pytest.mark.slow

NUM_RECORDS = 40


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(900)
def test_sigint_stops_a_run_started_with_sigint_ignored_and_the_rerun_completes(
    tmp_path: Path, uninterrupted_generate: Callable[[int, int], TinyCache]
) -> None:
    shared = uninterrupted_generate(NUM_RECORDS, 5)  # the torchrun test's too
    data, reference = shared.data, shared.root

    cache = tmp_path / "cache"
    cmd = generate_cmd(cache, data, "--flush-seconds", "0.3")
    # The worker holds its first job until the run asks it to stop: the SIGINT lands mid-run on any machine.
    held = tmp_path / "held"
    held.mkdir()
    held_cmd, env = worker_entry.held_cmd(cmd, held)
    process = subprocess.Popen(
        held_cmd, preexec_fn=_ignore_sigint, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        worker_entry.wait_until_held(held, 1, process)
        os.kill(process.pid, signal.SIGINT)  # to the coordinator alone, as `kill -INT $pid` from a script
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail("SIGINT did not stop a run started with SIGINT ignored")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, output.decode()[-3000:]
    assert b"resume" in output
    assert [r["status"] for r in read_table(cache, "runs").to_pylist()] == ["interrupted"]
    partial = read_table(cache, "samples").num_rows
    assert 0 < partial < NUM_RECORDS  # stopped before the end, keeping what it had committed
    # The summary of what it committed comes before the exit, as for a finished run.
    committed = read_table(cache, "samples")
    tokens = sum(committed.column("num_tokens").to_pylist())
    assert "interrupted in " in output.decode()
    assert f"committed {partial} samples, {tokens} tokens (" in output.decode(), output.decode()[-3000:]
    assert verify_cache(cache, progress=False).ok

    run_in_process(cmd)
    samples = read_table(cache, "samples").column("sample_id").to_pylist()
    assert len(samples) == len(set(samples))
    ref, got = features_by_id(reference), features_by_id(cache)
    assert set(got) == set(ref)
    for sample_id, (features, ids, mask) in ref.items():
        features2, ids2, mask2 = got[sample_id]
        assert np.array_equal(ids, ids2)
        assert np.array_equal(mask, mask2)
        assert torch.equal(features.view(torch.int16), features2.view(torch.int16)), sample_id
