"""Crash safety: SIGKILL a real writer process at random points, resume, and finish; the result must be
indistinguishable from an uninterrupted run, and verify must be clean."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_offline.cache.layout import sweep_partial_files
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.verify import verify_cache
from tests.cache._samples import bits

HELPER = Path(__file__).with_name("crash_writer.py")
NUM_SAMPLES = 300  # as in crash_writer.py
MIN_KILLS = 20


class ForkServer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def start(self, cache: Path) -> int:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"run {cache}\n")
        self.proc.stdin.flush()
        kind, pid = self.proc.stdout.readline().split()
        assert kind == "pid"
        return int(pid)

    def wait(self, pid: int) -> int:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write("reap\n")
        self.proc.stdin.flush()
        kind, got, code = self.proc.stdout.readline().split()
        assert (kind, int(got)) == ("exit", pid)
        return int(code)

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()  # the server ends at the end of its input
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def _sessions(cache: Path) -> set[Path]:
    shards = cache / "shards"
    return set(shards.iterdir()) if shards.is_dir() else set()


def _committed(cache: Path) -> int:
    return len(read_table(cache, "samples", ["sample_id"])) if (cache / "cache.json").exists() else 0


def _has_data(session: Path) -> bool:
    return any((session / "features").rglob("c/*/0"))


def _wait_for_session_data(cache: Path, sessions_before: set[Path], pid: int) -> None:
    """Until a session this writer started has a shard file, or the writer has exited (a zombie: it is
    reaped only after the kill), e.g. because nothing was left to write."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(_has_data(g) for g in _sessions(cache) - sessions_before):
            return
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return
        time.sleep(0.002)
    raise AssertionError("the writer wrote no shard within 60 s")


@pytest.mark.timeout(600)
def test_sigkill_at_random_points_then_resume(tmp_path):
    server = ForkServer()
    try:
        reference = tmp_path / "reference"
        started = time.monotonic()
        assert server.wait(server.start(reference)) == 0  # the uninterrupted run
        full_run = time.monotonic() - started
        started = time.monotonic()
        assert server.wait(server.start(reference)) == 0  # a resume with nothing left: start-up + close
        idle_run = time.monotonic() - started
        per_sample = max(full_run - idle_run, 0.05) / NUM_SAMPLES
        print(f"uninterrupted run {full_run:.2f} s, idle resume {idle_run:.2f} s")

        # Kills go on until MIN_KILLS, half of them before the cache was complete and a quarter in the
        # middle of shard data. When a cache completes short of that (the time scale misjudged a loaded
        # machine), the kills go on into a fresh cache: every cache must end equal to the reference.
        caches = [tmp_path / "crashed0"]
        rng = random.Random(1234)
        kills = rounds = 0
        committed_after_kill: list[int] = []
        mid_data_kills = 0  # kills of a session that had written shard data, leaving work undone

        def kills_wanted() -> bool:
            before_complete = sum(n < NUM_SAMPLES for n in committed_after_kill)
            return kills < MIN_KILLS or before_complete < MIN_KILLS // 2 or mid_data_kills < MIN_KILLS // 4

        started = time.monotonic()
        while True:
            rounds += 1
            crashed = caches[-1]
            sweep_partial_files(crashed)  # as generate's main process does before starting workers
            remaining = NUM_SAMPLES - _committed(crashed)
            sessions_before = _sessions(crashed)
            pid = server.start(crashed)
            if kills_wanted():
                # Half the kills once this session has written shard data, then after up to an equal
                # share of the remaining work per remaining kill; the other half at a random time around
                # the start-up: kills land in start-up, writes, commits and close alike, whatever this
                # machine's speed (a time scale alone missed every write on a fast machine).
                share = remaining * per_sample / (max(MIN_KILLS - kills, 1) + 2)
                if kills % 2 == 1 or remaining == 0:  # a complete cache writes no shard: start-up only
                    time.sleep(idle_run * rng.uniform(0.3, 1.0) + rng.uniform(0.0, share))
                else:
                    _wait_for_session_data(crashed, sessions_before, pid)
                    time.sleep(rng.uniform(0.0, 2.0 * share))
                os.kill(pid, signal.SIGKILL)  # the child is not reaped yet: its pid is still ours
            code = server.wait(pid)
            if code == -signal.SIGKILL:
                kills += 1
                committed_after_kill.append(_committed(crashed))
                killed_had_data = any(_has_data(g) for g in _sessions(crashed) - sessions_before)
                mid_data_kills += killed_had_data and committed_after_kill[-1] < NUM_SAMPLES
            else:
                assert code == 0, f"writer failed in round {rounds} (see its traceback above)"
                if not kills_wanted():
                    break
                caches.append(tmp_path / f"crashed{len(caches)}")
            assert time.monotonic() - started < 240 * len(caches), "the crash loop makes no progress"
    finally:
        server.close()
    assert kills >= MIN_KILLS
    print(
        f"{kills} kills in {rounds} rounds over {len(caches)} caches, "
        f"{mid_data_kills} in the middle of shard data; "
        f"committed after each kill: {committed_after_kill}"
    )
    # The kills hit writers in the middle of their data, not only in start-up or after the end: a good
    # part of the killed sessions had written shard files with work left, and half the kills came
    # before the cache was complete.
    assert mid_data_kills >= MIN_KILLS // 4
    assert sum(n < NUM_SAMPLES for n in committed_after_kill) >= MIN_KILLS // 2

    for crashed in caches:
        _assert_equal_to_reference(crashed, reference)


def _assert_equal_to_reference(crashed: Path, reference: Path) -> None:
    # Every sample exactly once: no duplicate manifest row, same id set as the reference.
    ids = read_table(crashed, "samples", ["sample_id"])["sample_id"].to_pylist()
    assert len(ids) == len(set(ids))
    ref_ids = read_table(reference, "samples", ["sample_id"])["sample_id"].to_pylist()
    assert sorted(ids) == sorted(ref_ids)
    assert len(ids) == NUM_SAMPLES

    with CacheReader.open(crashed) as got, CacheReader.open(reference) as want:
        assert got.samples.sample_id.tolist() == want.samples.sample_id.tolist()
        for a, b in zip(
            got.read_rows(range(len(got.samples))), want.read_rows(range(len(want.samples))), strict=True
        ):
            assert a.sample_id == b.sample_id
            np.testing.assert_array_equal(bits(a.features_TF), bits(b.features_TF))
            np.testing.assert_array_equal(a.input_ids_T.numpy(), b.input_ids_T.numpy())
            np.testing.assert_array_equal(a.loss_mask_T.numpy(), b.loss_mask_T.numpy())
            assert a.bucket_id == b.bucket_id
        np.testing.assert_array_equal(got.samples.checksum, want.samples.checksum)

    report = verify_cache(crashed, progress=False)
    assert report.ok, report.render()
    assert report.samples_checked == NUM_SAMPLES
    # Killed sessions left unreferenced data behind, and verify accounts for it (without calling it damage).
    print(report.render())
