"""`dflash sql` reads the cache and nothing else: every attack below is refused with one line, and leaves
the files it aimed at as they were (each of them worked before the confinement)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_offline.cache.index import build_index
from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.sql import SqlConfig, run_sql
from dflash_offline.cache.sql_guard import SqlRefusedError
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cli import main
from tests.cache._samples import TINY, make_samples


def sql(root, statement, *, source="auto"):
    return run_sql(SqlConfig(root=root, sql=statement, query_name=None, source=source))


@pytest.fixture
def cache(tmp_path, fingerprint):
    root = tmp_path / "cache"
    with ShardWriter(root, fingerprint, worker=0, **TINY) as writer:
        for s in make_samples(fingerprint, range(12)):
            writer.add(s)
    return root


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("source", ["manifest", "index"])
def test_file_access_outside_the_cache_is_refused(cache, tmp_path, source):
    build_index(cache)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    victim = tmp_path / "victim.csv"
    victim.write_text("keep me\n")
    (cache / "link.txt").symlink_to(secret)  # a link planted inside the cache, pointing out of it
    before = _snapshot(cache)
    attacks = [
        f"COPY (SELECT 1 AS x) TO '{victim}'",  # overwrote a file anywhere
        f"COPY (SELECT * FROM samples) TO '{cache}/manifest/samples/x.parquet' (FORMAT parquet)",
        f"SELECT * FROM read_text('{secret}')",
        f"SELECT * FROM read_csv('{secret}')",
        f"SELECT * FROM read_text('{cache}/../secret.txt')",  # climbing out of the allowed folder
        f"SELECT * FROM read_text('{cache}/link.txt')",
        f"SELECT * FROM glob('{tmp_path}/*')",
        f"ATTACH '{cache}/index.duckdb' AS ix; DROP TABLE ix.samples",
        f"ATTACH '{cache}/index.duckdb' AS ix",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        f"SET enable_external_access=false; SELECT * FROM read_text('{secret}')",
        "SELECT 1; SELECT 2",
        f"EXPORT DATABASE '{tmp_path}/dump'",
        "CREATE TABLE t AS SELECT 1",
        "DROP TABLE samples",
        "DELETE FROM samples",
        "PRAGMA version",
        "CALL pragma_version()",
        "SELECT * FROM read_parquet('https://example.com/x.parquet')",
    ]
    for attack in attacks:
        with pytest.raises(SqlRefusedError) as caught:
            sql(cache, attack, source=source)
        message = str(caught.value)
        assert "\n" not in message, attack
        assert "TOP-SECRET" not in message
        assert "duckdb CLI" in message, (attack, message)
        assert "index.duckdb" in message
    assert victim.read_text() == "keep me\n"
    assert not (tmp_path / "dump").exists()
    assert _snapshot(cache) == before  # nothing in the cache was written or dropped
    assert verify_cache(cache).ok
    assert sql(cache, "SELECT count(*) FROM samples", source=source).rows == [(12,)]


def test_reads_inside_the_cache_and_inspection_statements_still_work(cache):
    files = f"{cache}/manifest/samples/*.parquet"
    assert sql(cache, f"SELECT count(*) FROM read_parquet('{files}')").rows == [(12,)]
    assert sql(cache, "FROM samples SELECT count(*)").rows == [(12,)]
    assert ("sample_id",) in {r[:1] for r in sql(cache, "DESCRIBE samples").rows}
    assert ("samples",) in set(sql(cache, "SHOW TABLES").rows)
    assert sql(cache, "WITH a AS (SELECT 2 AS x) SELECT x FROM a;").rows == [(2,)]
    names = [p.name for p in CacheLayout.at(cache).parts("samples")]
    assert (
        sorted(r[0].rsplit("/", 1)[1] for r in sql(cache, f"SELECT file FROM glob('{files}')").rows) == names
    )


def test_cli_refusal_is_one_line_and_a_subprocess_exits_non_zero(cache, tmp_path):
    victim = tmp_path / "victim.csv"
    result = CliRunner().invoke(main, ["sql", str(cache), f"COPY (SELECT 1) TO '{victim}'"])
    assert result.exit_code != 0
    assert "read-only" in result.output
    assert "COPY" in result.output
    assert not victim.exists()
    done = subprocess.run(
        [sys.executable, "-m", "dflash_offline", "sql", str(cache), "SELECT * FROM read_text('/etc/passwd')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert "reads only the cache's own files" in lines[0]
    assert "root:" not in done.stdout + done.stderr


@pytest.mark.parametrize("source", ["manifest", "index"])
def test_duckdb_temp_directories_are_not_a_way_out(cache, tmp_path, monkeypatch, source):
    """DuckDB allows its temp directory beside any ``allowed_directories``: ``CACHE/index.duckdb.tmp/``
    for the index file, ``$PWD/.tmp/`` for the in-memory manifest database. A symlink of either name to
    ``/``, or a file a user left in ``$PWD/.tmp``, was readable through read_text/glob/read_csv."""
    build_index(cache)
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("TOP-SECRET-CONTENT\n")
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    (workdir / ".tmp").symlink_to(secret.parent)
    (cache / "index.duckdb.tmp").symlink_to(secret.parent)
    doors = [workdir / ".tmp", cache / "index.duckdb.tmp", ".tmp"]
    for door in doors:
        for attack in [
            f"SELECT * FROM read_text('{door}/secret.txt')",
            f"SELECT * FROM read_csv('{door}/secret.txt')",
            f"SELECT * FROM glob('{door}/*')",
        ]:
            with pytest.raises(SqlRefusedError) as caught:
                sql(cache, attack, source=source)
            assert "TOP-SECRET" not in str(caught.value)
    (workdir / ".tmp").unlink()
    (workdir / ".tmp").mkdir()  # a real folder with a user's file in it
    (workdir / ".tmp" / "notes.txt").write_text("TOP-SECRET-CONTENT\n")
    with pytest.raises(SqlRefusedError):
        sql(cache, f"SELECT * FROM read_text('{workdir}/.tmp/notes.txt')", source=source)
    assert sql(cache, "SELECT count(*) FROM samples", source=source).rows == [(12,)]
