"""Faults of ``dflash generate``: two runs into one cache, a killed coordinator, a killed
worker, a full disk, and the configuration mistakes that used to pass silently or with a traceback.
The long version of the kill loop is ``bench/soak.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cli import main
from dflash_offline.generate.run import KILLED_RUN_NOTE
from tests.process_helpers import group_members, reaped, workers_of
from tests.tiny_caches import TinyCache

from . import worker_entry
from .helpers import features_by_id, generate_cmd, run_in_process, start_in_new_session

NUM_RECORDS = 60


def _assert_equal_caches(reference: Path, cache: Path) -> None:
    ids = read_table(cache, "samples", ["sample_id"])["sample_id"].to_pylist()
    assert len(ids) == len(set(ids))  # none twice
    want, got = features_by_id(reference), features_by_id(cache)
    assert set(got) == set(want)  # none lost
    for sample_id, (features, input_ids, mask) in want.items():
        assert np.array_equal(input_ids, got[sample_id][1])
        assert np.array_equal(mask, got[sample_id][2])
        assert torch.equal(features.view(torch.int16), got[sample_id][0].view(torch.int16)), sample_id
    report = verify_cache(cache, progress=False)
    assert report.ok, report.render()


@pytest.fixture(scope="module")
def reference(uninterrupted_generate: Callable[[int, int], TinyCache]) -> tuple[Path, Path]:
    """(data, uninterrupted cache) shared by the tests of this module (and by the xdist workers that run
    them)."""
    shared = uninterrupted_generate(NUM_RECORDS, 7)
    return shared.data, shared.root


def _wait_for_workers(
    process: subprocess.Popen[bytes], cache: Path, count: int, *, opened: bool = True
) -> list[int]:
    """Pids of ``count`` workers once they exist and (``opened``) each has opened its shard group."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        shards = cache / "manifest" / "shards"
        if not opened or (shards.is_dir() and len(list(shards.glob("*.parquet"))) >= count):
            workers = workers_of(process.pid)
            if len(workers) >= count:
                return workers
        time.sleep(0.1)
    raise AssertionError("the workers did not start (or the run ended first)")


def _wait_gone(pgid: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and group_members(pgid):
        time.sleep(0.1)
    return group_members(pgid)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_the_coordinator_leaves_no_worker_and_the_rerun_completes(
    tmp_path: Path, reference: tuple[Path, Path]
) -> None:
    data, ref = reference
    cache = tmp_path / "cache"
    cmd = generate_cmd(cache, data, "--workers", "2", "--flush-seconds", "0.2")
    # Workers that hold after their first job: the kill lands mid-run with data written on any machine
    # (on a fast one, 60 records were all done before polling saw both shard groups open).
    held = tmp_path / "held"
    held.mkdir()
    with reaped(start_in_new_session(*worker_entry.held_cmd(cmd, held))) as process:
        workers = _wait_for_workers(process, cache, 2)
        worker_entry.wait_until_held(held, 2, process)
        os.kill(process.pid, signal.SIGKILL)  # the coordinator only: its workers must notice
        process.wait(timeout=30)
    survivors = _wait_gone(process.pid)
    if survivors:
        os.killpg(process.pid, signal.SIGKILL)
    assert not survivors, f"processes {survivors} survived their coordinator (workers were {workers})"
    run_in_process(cmd)
    _assert_equal_caches(ref, cache)
    # The killed run no longer reads as live once the rerun took the lock.
    runs = sorted(read_table(cache, "runs").to_pylist(), key=lambda r: r["started_at"])
    assert [r["status"] for r in runs] == ["interrupted", "finished"]
    assert KILLED_RUN_NOTE in runs[0]["error"]
    assert runs[1]["run_id"] in runs[0]["error"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_one_worker_stops_the_run_and_the_rerun_completes(
    tmp_path: Path, reference: tuple[Path, Path]
) -> None:
    data, ref = reference
    cache = tmp_path / "cache"
    cmd = generate_cmd(cache, data, "--workers", "2", "--flush-seconds", "0.2")
    with reaped(start_in_new_session(cmd)) as process:
        # Killed while it starts: 60 records take the workers less time than finding them once they
        # opened their shard groups (bench/soak.py kills workers mid-run too).
        workers = _wait_for_workers(process, cache, 2, opened=False)
        os.kill(workers[0], signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output.decode()[-2000:]
    assert b"rerun the same command" in output, output.decode()[-2000:]
    assert not _wait_gone(process.pid)
    run_in_process(cmd)
    _assert_equal_caches(ref, cache)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_generate_into_the_same_cache_is_refused_and_the_first_is_unharmed(
    tmp_path: Path, reference: tuple[Path, Path]
) -> None:
    data, ref = reference
    cache = tmp_path / "cache"
    cmd = generate_cmd(cache, data, "--workers", "1")
    with reaped(start_in_new_session(cmd)) as first:
        deadline = time.monotonic() + 300
        lock = cache / "lock"
        # The holder's JSON is written after the flock is taken: wait for it, not just for the file.
        while not (lock.exists() and lock.stat().st_size > 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Freeze the first run while it holds the lock: on an idle machine it would otherwise finish
        # (60 records) before the second has even imported torch, and the race would test nothing.
        os.killpg(first.pid, signal.SIGSTOP)
        assert first.poll() is None, "the first run ended before the check"
        assert lock.exists()
        try:
            second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        assert second.returncode == 1, second.stdout + second.stderr
        message = second.stderr.strip().splitlines()
        assert len(message) == 1, second.stderr
        assert f"is in use by pid {first.pid}" in message[0], second.stderr
        output, _ = first.communicate(timeout=600)
        assert first.returncode == 0, output.decode()[-3000:]
    _assert_equal_caches(ref, cache)
    assert not (cache / "lock").exists()  # released at the end


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` while the block runs (the test skipped where it cannot be)."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("needs root and permission to mount a tmpfs (mount -t tmpfs) for a small disk")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _resize(mount: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True, capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_disk_full_is_one_line_and_the_cache_resumes_to_the_uninterrupted_result(
    tmp_path: Path, reference: tuple[Path, Path]
) -> None:
    data, ref = reference
    with _small_disk(tmp_path / "small", "600k") as mount:
        cache = mount / "cache"
        cmd = generate_cmd(cache, data, "--flush-seconds", "0")
        full = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert full.returncode == 1, full.stdout + full.stderr
        # Beside the error only the start-up note naming the decontamination screen may stand.
        lines = [
            line
            for line in full.stderr.strip().splitlines()
            if not line.startswith("dflash generate: decontamination")
        ]
        assert lines == [
            f"Error: no space left on device at {cache}; free space and rerun the same command"
        ], full.stderr
        assert read_table(cache, "samples").num_rows < NUM_RECORDS
        assert verify_cache(cache, progress=False).ok
        _resize(mount, "64m")
        run_in_process(cmd)
        _assert_equal_caches(ref, cache)


@pytest.mark.slow
def test_keep_free_stops_a_run_on_a_small_disk_and_the_rerun_completes(
    tmp_path: Path, reference: tuple[Path, Path]
) -> None:
    data, ref = reference
    # 64 MB, of which the run must leave 60: committing every job (--flush-seconds 0, many small files)
    # it stops handing out jobs once 4 MB are used, writes those handed out and ends, exit 0.
    with _small_disk(tmp_path / "small", "64m") as mount:
        cache = mount / "cache"
        cmd = generate_cmd(cache, data, "--flush-seconds", "0")
        stopped = subprocess.run(
            [*cmd, "--keep-free-gb", "0.06"], capture_output=True, text=True, timeout=600
        )
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert ": interrupted in " in stopped.stdout
        assert "GB free on the cache's file system, below --keep-free-gb 0.06:" in stopped.stdout
        committed = read_table(cache, "samples").num_rows
        assert 0 < committed < NUM_RECORDS
        assert verify_cache(cache, progress=False).ok
        # Given room and no reserve, the same command resumes and completes the cache.
        _resize(mount, "256m")
        assert f"{committed} already in the cache" in run_in_process(cmd)
        _assert_equal_caches(ref, cache)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--layer-ids", "1,1"), "--layer-ids '1,1': [1] repeat"),
        (("--layer-ids", "2,0"), "ids must be ascending"),
        (("--layer-ids", "0,2", "--num-features", "2"), "give one of them"),
        (("--num-features", "5"), "fits at most 1 feature there (--num-features 1)"),
    ],
)
def test_layer_choice_mistakes_are_refused(
    tmp_path: Path, extra: tuple[str, ...], message: str, chat_data: Path
) -> None:
    cmd = list(generate_cmd(tmp_path / "cache", chat_data)[3:])
    at = cmd.index("--layer-ids")
    del cmd[at : at + 2]
    result = CliRunner().invoke(main, [*cmd, *extra])
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert not (tmp_path / "cache" / "cache.json").exists()


@pytest.mark.timeout(600)
def test_a_float32_cache_is_not_resumed_in_bfloat16(tmp_path: Path, chat_data: Path) -> None:
    runner = CliRunner()
    cmd = [*generate_cmd(tmp_path / "cache", chat_data)[3:], "--limit", "4"]
    first = runner.invoke(main, cmd)
    assert first.exit_code == 0, first.output
    again = runner.invoke(main, [*cmd, "--dtype", "bfloat16"])
    assert again.exit_code == 1, again.output
    assert "compute_dtype='float32'" in again.output
    assert "compute_dtype='bfloat16'" in again.output
    assert not (tmp_path / "cache" / "lock").exists()  # a refused run gives the lock back


def test_a_cache_json_without_a_fingerprint_field_is_refused_in_one_line(
    tmp_path: Path, chat_data: Path
) -> None:
    import json

    runner = CliRunner()
    cmd = [*generate_cmd(tmp_path / "cache", chat_data)[3:], "--limit", "3"]
    assert runner.invoke(main, cmd).exit_code == 0
    path = tmp_path / "cache" / "cache.json"
    doc = json.loads(path.read_text())
    del doc["fingerprint"]["compute_dtype"]
    path.write_text(json.dumps(doc))
    manifest = sorted(p.relative_to(path.parent) for p in (path.parent / "manifest").rglob("*"))
    refused = runner.invoke(main, [*cmd[:-1], "5"])
    assert refused.exit_code == 1, refused.output
    assert refused.output.strip() == (
        f"Error: {path}: its fingerprint lacks fields ['compute_dtype']; this dflash-offline did not write "
        "it: regenerate the cache into a new directory"
    )
    assert json.loads(path.read_text()) == doc  # left as it was
    assert sorted(p.relative_to(path.parent) for p in (path.parent / "manifest").rglob("*")) == manifest
    assert not (tmp_path / "cache" / "lock").exists()


def test_index_write_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    import shutil

    golden = Path(__file__).resolve().parents[1] / "assets" / "golden_cache" / "v1"
    with _small_disk(tmp_path / "small", "8m") as mount:
        cache = mount / "cache"
        shutil.copytree(golden, cache)
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk up
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        result = CliRunner().invoke(main, ["index", str(cache)])
        assert result.exit_code == 1, result.output
        assert result.output.strip() == (
            f"Error: no space left on device at {cache}; free space and rerun the same command"
        )
        (mount / "filler").unlink()
        again = CliRunner().invoke(main, ["index", str(cache)])
        assert again.exit_code == 0, again.output
