"""The cache commands through click's CliRunner, and once through a real `dflash` subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cli import main
from tests.cache._samples import TINY, make_samples


@pytest.fixture
def cache(tmp_path, fingerprint):
    with ShardWriter(tmp_path, fingerprint, worker=0, **TINY) as writer:
        for s in make_samples(fingerprint, range(12)):
            writer.add(s)
        writer.add_failure(sample_id="bad", source_index=99, reason="template_error", detail="boom")
    return tmp_path


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_index_sql_status(cache):
    result = invoke("sql", cache, "--query", "buckets", "--format", "json")
    assert result.exit_code == 0, result.output
    assert sum(r["samples"] for r in json.loads(result.output)) == 12
    result = invoke("index", cache)
    assert result.exit_code == 0
    assert "12 samples, 1 failures" in result.output
    result = invoke(
        "sql", cache, "SELECT reason, count(*) AS n FROM failures GROUP BY reason", "--format", "csv"
    )
    assert result.output.splitlines() == ["reason,n", "template_error,1"]
    assert "from the index" in invoke("sql", cache, "SELECT 1").output
    result = invoke("status", cache)
    assert result.exit_code == 0
    assert "samples    12" in result.output
    assert "template_error 1" in result.output


def test_verify_exit_codes(cache):
    result = invoke("verify", cache, "--no-progress")
    assert result.exit_code == 0
    assert "OK" in result.output
    shard_file = next((cache / "shards").glob("*.zarr")).joinpath("features", "c", "0", "0")
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    result = invoke("verify", cache, "--no-progress")
    assert result.exit_code == 1
    assert "DAMAGED" in result.output
    assert "damaged in w000-" in result.output


def test_user_errors_are_one_line(tmp_path_factory, cache):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    not_a_dir = elsewhere / "file"
    not_a_dir.write_text("x")
    result = CliRunner().invoke(main, ["status", str(not_a_dir)])
    assert result.exit_code == 1
    assert "is a file, not a directory" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["sql", str(cache), "--query", "nope"])
    assert result.exit_code == 1
    assert "known: buckets" in result.output
    result = CliRunner().invoke(main, ["sql", str(elsewhere / "missing"), "SELECT 1"])
    assert result.exit_code == 1
    assert "not a dflash cache" in result.output


def test_real_subprocess(cache):
    dflash = Path(sys.executable).with_name("dflash")
    command = [str(dflash)] if dflash.exists() else [sys.executable, "-m", "dflash_offline"]
    done = subprocess.run(
        [*command, "sql", str(cache), "--query", "progress"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split()[:3] == ["worker", "samples", "tokens"]
    assert "total" in done.stdout
    assert not CacheLayout.at(cache).index_path.exists()  # sql never writes the index
