"""The writer lock (``dflash_offline.locking``), ``dflash verify --repair``, commit by bytes, and the
fingerprint's compute dtype on older caches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_offline.cache.layout import CacheLayout, create_or_open_cache, read_fingerprint
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.repair import repair_cache
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cli import main
from dflash_offline.errors import CacheFormatError, FingerprintMismatchError
from dflash_offline.locking import LOCK_NAME, LockedError, LockHolder, acquire_lock
from tests.cache._samples import TINY, bits, make_fingerprint, make_samples
from tests.process_helpers import reaped

HOLDER = textwrap.dedent(
    """
    import sys, time
    from dflash_offline.locking import acquire_lock
    lock = acquire_lock(sys.argv[1], what="cache", command="holder-under-test")
    print("held", flush=True)
    time.sleep(600)
    """
)


def _hold_in_subprocess(directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    first = acquire_lock(tmp_path, what="cache", command="dflash generate --cache X")
    with pytest.raises(LockedError, match=rf"pid {os.getpid()} .*dflash generate --cache X"):
        acquire_lock(tmp_path, what="cache")
    assert first.held  # the refused attempt did not disturb the holder
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    acquire_lock(tmp_path, what="cache").release()  # free again


@pytest.mark.timeout(60)
def test_lock_of_a_live_process_refused_of_a_killed_one_taken_over(tmp_path: Path, capsys) -> None:
    with reaped(_hold_in_subprocess(tmp_path)) as proc:
        with pytest.raises(LockedError, match=rf"pid {proc.pid} .*holder-under-test"):
            acquire_lock(tmp_path, what="cache")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    stale = LockHolder.from_json((tmp_path / LOCK_NAME).read_text())
    assert stale is not None
    assert stale.pid == proc.pid
    lock = acquire_lock(tmp_path, what="cache")
    assert lock.took_over is not None
    assert lock.took_over.pid == proc.pid
    assert f"took over the stale lock of cache {tmp_path} from pid {proc.pid}" in capsys.readouterr().err
    assert LockHolder.from_json((tmp_path / LOCK_NAME).read_text()).pid == os.getpid()  # type: ignore[union-attr]
    lock.release()


def _write(root: Path, fingerprint, ids, *, worker: int) -> None:
    # known_sample_ids=() bypasses the manifest check: what two writers without the lock would do.
    with ShardWriter(root, fingerprint, worker=worker, flush_seconds=1e9, known_sample_ids=(), **TINY) as w:
        for sample in make_samples(fingerprint, ids):
            w.add(sample)


def _features(root: Path) -> dict[str, np.ndarray]:
    with CacheReader.open(root) as reader:
        return {s.sample_id: bits(s.features_TF) for s in reader.read(list(reader.samples.sample_id))}


def test_repair_drops_duplicate_commits_and_orphan_bytes(tmp_path: Path) -> None:
    fingerprint = make_fingerprint()
    reference = tmp_path / "reference"
    _write(reference, fingerprint, range(40), worker=0)
    cache = tmp_path / "cache"
    _write(cache, fingerprint, range(40), worker=0)
    _write(cache, fingerprint, range(10, 30), worker=1)  # a second writer commits 20 ids again
    orphan = ShardWriter(cache, fingerprint, worker=2, flush_seconds=1e9, known_sample_ids=(), **TINY)
    for sample in make_samples(fingerprint, range(40, 60)):
        orphan.add(sample)  # whole shards written, never committed: orphan bytes
    del orphan
    (cache / "shards" / "stale.partial").write_bytes(b"x" * 100)
    report = verify_cache(cache, progress=False)
    assert not report.ok
    assert len(report.duplicates) == 20
    assert report.unreferenced_bytes > 0

    result = CliRunner().invoke(main, ["verify", str(cache), "--repair", "--yes", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "dropped 20 duplicate commits, 0 damaged samples" in result.output
    after = verify_cache(cache, progress=False)
    assert after.ok, after.render()
    assert after.unreferenced == ()
    assert after.samples_checked == 40
    freed = int(result.output.split("freed ")[1].split(" bytes")[0].replace(",", ""))
    assert freed >= report.unreferenced_bytes  # the orphans and the dropped copies' shard files
    ids = read_table(cache, "samples", ["sample_id"])["sample_id"].to_pylist()
    assert sorted(ids) == sorted(set(ids))
    assert len(ids) == 40
    want, got = _features(reference), _features(cache)
    assert set(got) == set(want)
    for sample_id, features in want.items():
        np.testing.assert_array_equal(got[sample_id], features)


def test_repair_keeps_the_good_copy_when_the_first_is_damaged(tmp_path: Path) -> None:
    fingerprint = make_fingerprint()
    cache = tmp_path / "cache"
    _write(cache, fingerprint, range(20), worker=0)
    _write(cache, fingerprint, range(20), worker=1)
    with CacheReader.open(cache) as reader:
        first_shard = str(reader.samples.shard[0])
    for path in (CacheLayout.at(cache).shard_group(first_shard) / "features" / "c").rglob("*"):
        if path.is_file():  # damage every feature byte of the first commits
            path.write_bytes(bytes(b ^ 0x5A for b in path.read_bytes()))
    assert verify_cache(cache, progress=False).damaged
    report = repair_cache(cache, progress=False)
    assert report.duplicate_rows_dropped == 20
    assert report.damaged_ids_dropped == ()
    after = verify_cache(cache, progress=False)
    assert after.ok, after.render()
    assert after.samples_checked == 20
    with CacheReader.open(cache) as reader:
        assert first_shard not in set(reader.samples.shard.tolist())  # the damaged copies went


def test_repair_is_refused_while_a_writer_holds_the_lock(tmp_path: Path) -> None:
    fingerprint = make_fingerprint()
    _write(tmp_path, fingerprint, range(5), worker=0)
    with acquire_lock(tmp_path, what="cache"), pytest.raises(LockedError):
        repair_cache(tmp_path, progress=False)


def test_commits_by_bytes_before_the_time_threshold(tmp_path: Path) -> None:
    fingerprint = make_fingerprint()
    row_bytes = fingerprint.feature_width * 2 + 5
    writer = ShardWriter(
        tmp_path, fingerprint, worker=0, flush_seconds=1e9, flush_bytes=200 * row_bytes, **TINY
    )
    for sample in make_samples(fingerprint, range(30)):
        writer.add(sample)
    # Without closing (a kill would not close either), rows are already committed.
    committed = read_table(tmp_path, "samples", ["num_tokens"])["num_tokens"].to_pylist()
    assert committed
    assert sum(committed) >= 200
    assert len(list((tmp_path / "manifest" / "samples").glob("*.parquet"))) >= 2
    writer.close()


def test_compute_dtype_is_part_of_the_fingerprint_and_required(tmp_path: Path) -> None:
    from dataclasses import replace

    f32 = make_fingerprint(compute_dtype="float32")
    create_or_open_cache(tmp_path, f32)
    assert read_fingerprint(tmp_path) == f32
    with pytest.raises(FingerprintMismatchError, match=r"compute_dtype='float32'.*compute_dtype='bfloat16'"):
        create_or_open_cache(tmp_path, replace(f32, compute_dtype="bfloat16"))
    path = tmp_path / "cache.json"
    doc = json.loads(path.read_text())
    del doc["fingerprint"]["compute_dtype"]
    path.write_text(json.dumps(doc))
    with pytest.raises(CacheFormatError) as refused:
        read_fingerprint(tmp_path)
    assert str(refused.value).startswith(f"{path}: its fingerprint lacks fields ['compute_dtype']; ")


def test_a_directory_without_cache_json_is_not_told_to_run_generate_when_generate_refuses(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CacheFormatError) as caught:
        read_fingerprint(tmp_path)
    assert "dflash generate --cache" not in str(caught.value)
    with pytest.raises(CacheFormatError, match=r"not empty and has no cache\.json"):
        create_or_open_cache(tmp_path, make_fingerprint())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CacheFormatError, match="dflash generate --cache"):
        read_fingerprint(empty)  # here the advice is true: generate creates a cache in it
    create_or_open_cache(empty, make_fingerprint())


def test_status_sql_index_name_a_truncated_manifest_part(tmp_path: Path) -> None:
    fingerprint = make_fingerprint()
    _write(tmp_path, fingerprint, range(10), worker=0)
    part = sorted((tmp_path / "manifest" / "samples").glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:40])
    runner = CliRunner()
    for args in (
        ["status", str(tmp_path)],
        ["sql", str(tmp_path), "--query", "buckets"],
        ["index", str(tmp_path)],
    ):
        result = runner.invoke(main, args)
        assert result.exit_code != 0, args
        assert f"manifest part {part} is damaged" in result.output, (args, result.output)
        assert "Traceback" not in result.output
