"""The DuckDB index and `dflash sql`: same answers from the live manifest and from index.duckdb."""

from __future__ import annotations

import collections
import csv
import dataclasses
import datetime as dt
import io
import json
import struct

import duckdb
import pytest

from dflash_offline.cache.index import build_index
from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.manifest import read_runs, record_run
from dflash_offline.cache.rows import RunRow
from dflash_offline.cache.sql import SqlConfig, query_cache, run_sql
from dflash_offline.cache.status import cache_status
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.errors import ConfigError, DflashError
from dflash_offline.sql_files import named_queries
from tests.cache._samples import TINY, copy_part, make_samples


def sql(root, statement=None, *, query=None, source="auto"):
    return run_sql(SqlConfig(root=root, sql=statement, query_name=query, source=source))


@pytest.fixture
def cache(tmp_path, fingerprint):
    """Two sessions, 30 samples, 3 failures, one run row."""
    samples = make_samples(fingerprint, range(30))
    for worker, chunk in enumerate((samples[:18], samples[18:])):
        with ShardWriter(tmp_path, fingerprint, worker=worker, **TINY) as writer:
            for s in chunk:
                writer.add(s)
            writer.add_failure(
                sample_id=f"bad-{worker}", source_index=100 + worker, reason="too_long", detail="99 > 64"
            )
    with ShardWriter(tmp_path, fingerprint, worker=1, **TINY) as writer:
        writer.add_failure(
            sample_id="bad-x", source_index=200, reason="empty_response", detail="no assistant tokens"
        )
    started = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    record_run(
        tmp_path,
        RunRow(
            run_id="run-1",
            command="generate",
            started_at=started,
            finished_at=None,
            status="running",
            num_workers=2,
            samples_committed=30,
            tokens_committed=sum(s.num_tokens for s in samples),
            bytes_written=1,
            failures=3,
            fingerprint_json=json.dumps(fingerprint.to_dict()),
            host="test",
        ),
    )
    return tmp_path, samples


def test_named_queries_against_the_live_manifest(cache):
    root, samples = cache
    assert not CacheLayout.at(root).index_path.exists()
    result = sql(root, query="buckets")
    assert result.source == "manifest"
    rows = {r[0]: r for r in result.rows}
    counts = collections.Counter(s.bucket_id for s in samples)
    tokens = collections.Counter()
    for s in samples:
        tokens[s.bucket_id] += s.num_tokens
    assert {b: rows[b][2] for b in rows} == {b: counts.get(b, 0) for b in range(5)}
    assert {b: rows[b][3] for b in rows} == {b: tokens.get(b, 0) for b in range(5)}
    assert [rows[b][1] for b in range(5)] == [4, 8, 16, 32, None]
    failures = {r[0]: r[1] for r in sql(root, query="failures").rows}
    assert failures == {"too_long": 2, "empty_response": 1}
    largest = sql(root, query="largest").rows
    assert largest[0][2] == max(s.num_tokens for s in samples)
    progress = sql(root, query="progress")
    total = next(r for r in progress.rows if r[0] == "total")
    assert total[1:5] == (30, sum(s.num_tokens for s in samples), sum(s.num_loss_tokens for s in samples), 3)
    assert len(sql(root, query="shards").rows) == 3
    assert sql(root, query="runs").rows[0][:3] == ("run-1", "generate", "running")
    for name in named_queries():  # every named query runs
        sql(root, query=name)


def test_index_matches_manifest_and_opens_with_old_storage(cache):
    root, _ = cache
    stats = build_index(root)
    assert (stats.samples, stats.failures, stats.shards, stats.runs, stats.duplicates) == (30, 3, 3, 1, 0)
    path = CacheLayout.at(root).index_path
    header = path.read_bytes()[:20]
    assert header[8:12] == b"DUCK"
    # Storage version 64 = the v1.0.0 format (DuckDB 2.0 writes a newer one by default); verified by hand
    # with the DuckDB 1.0.0 and 1.1.3 Python packages.
    assert struct.unpack("<Q", header[12:20])[0] == 64
    assert not list(path.parent.glob("index.duckdb.tmp-*"))
    for name in named_queries():
        from_index, from_manifest = sql(root, query=name), sql(root, query=name, source="manifest")
        assert from_index.source == "index"
        assert from_index.rows == from_manifest.rows, name
    con = duckdb.connect(str(path), read_only=True)
    try:
        views = {
            r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()
        }
        assert {"bucket_stats", "shard_stats", "failure_stats", "progress"} <= views
        assert con.execute("SELECT count(*) FROM samples").fetchall() == [(30,)]
        build_index(root)  # rebuilding while a reader holds the old file open is fine (rename)
    finally:
        con.close()


def test_stale_index_is_not_used_by_auto(cache, fingerprint):
    root, _ = cache
    build_index(root)
    assert sql(root, "SELECT count(*) FROM samples").source == "index"
    with ShardWriter(root, fingerprint, worker=5, **TINY) as writer:
        for s in make_samples(fingerprint, range(30, 33)):
            writer.add(s)
    result = sql(root, "SELECT count(*) FROM samples")
    assert (result.source, result.rows) == ("manifest", [(33,)])
    assert sql(root, "SELECT count(*) FROM samples", source="index").rows == [(30,)]
    assert cache_status(root).index.state == "stale"


def test_sql_while_a_writer_is_active(tmp_path, fingerprint):
    samples = make_samples(fingerprint, range(20))
    writer = ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=1e9, **TINY)
    assert sql(tmp_path, query="buckets").rows[0][2] == 0  # zero sample parts
    for s in samples[:12]:
        writer.add(s)
    writer.flush()
    for s in samples[12:]:
        writer.add(s)  # staged, not committed
    assert sql(tmp_path, "SELECT count(*) FROM samples").rows == [(12,)]
    assert sum(r[2] for r in sql(tmp_path, query="buckets").rows) == 12
    writer.close()
    assert sql(tmp_path, "SELECT count(*) FROM samples").rows == [(20,)]


def test_duplicates_are_dropped_by_the_index_keeping_the_first(cache):
    root, _ = cache
    part = CacheLayout.at(root).parts("samples")[0]
    copy_part(part, "w009-zz-000000")
    stats = build_index(root)
    assert stats.samples == 30
    assert stats.duplicates > 0
    assert len(stats.duplicate_ids) == min(20, stats.duplicates)
    assert "dropped" in stats.render()
    assert sql(root, "SELECT count(*) FROM duplicates").rows == [(stats.duplicates,)]


def test_output_formats(cache):
    root, _ = cache
    config = SqlConfig(root=root, sql=None, query_name="buckets", output_format="csv")
    rows = list(csv.reader(io.StringIO(query_cache(config))))
    assert rows[0][:3] == ["bucket_id", "max_tokens", "samples"]
    assert len(rows) == 6
    config = SqlConfig(root=root, sql=None, query_name="shards", output_format="json")
    doc = json.loads(query_cache(config))
    assert len(doc) == 3
    assert {"shard", "samples", "opened_at"} <= doc[0].keys()
    table = query_cache(SqlConfig(root=root, sql="SELECT 1 AS one, 'x' AS s", query_name=None))
    assert table.splitlines()[0].split() == ["one", "s"]
    assert "(1 row, from the manifest)" in table


def test_sql_errors(cache):
    root, _ = cache
    with pytest.raises(ConfigError, match="no named query 'nope'; known: buckets"):
        sql(root, query="nope")
    with pytest.raises(ConfigError, match="exactly one"):
        sql(root, "SELECT 1", query="buckets")
    with pytest.raises(DflashError, match="the query failed"):
        sql(root, "SELECT * FROM no_such_table")


def test_status_and_runs(cache):
    root, samples = cache
    status = cache_status(root)
    assert (status.samples, status.tokens) == (30, sum(s.num_tokens for s in samples))
    assert status.loss_tokens == sum(s.num_loss_tokens for s in samples)
    assert status.raw_bytes == status.tokens * (16 * 2 + 5)
    assert status.stored_bytes > 0
    assert status.shards == 3
    assert status.workers == 2
    assert dict(status.failures) == {"too_long": 2, "empty_response": 1}
    assert sum(b.samples for b in status.buckets) == 30
    assert status.last_run == "run-1 generate running"
    assert status.index.state == "absent"
    text = status.render()
    assert "samples    30" in text
    assert "too_long 2" in text
    (run,) = read_runs(root)
    assert run.finished_at is None
    assert run.started_at == dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    finished = dataclasses.replace(run, status="finished", finished_at=run.started_at + dt.timedelta(hours=1))
    record_run(root, finished)  # a new revision (its own part); the newest counts
    assert read_runs(root) == [finished]
    assert cache_status(root).last_run == "run-1 generate finished"


def test_progress_rate_counts_the_time_before_the_first_commit(tmp_path, fingerprint):
    """Commits land every --flush-seconds: a worker that wrote for a second and committed twice at the
    end wrote at tokens / (about a second), not tokens / (the gap between its two commits)."""
    import time

    samples = make_samples(fingerprint, range(12))
    opened = time.time()
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=3600, **TINY) as writer:
        time.sleep(1.0)  # the target's forwards: nothing committed yet
        for s in samples[:6]:
            writer.add(s)
        writer.flush()
        for s in samples[6:]:
            writer.add(s)
    closed = time.time()
    tokens = sum(s.num_tokens for s in samples)
    rows = {r[0]: r for r in sql(tmp_path, query="progress").rows}
    for key in ("0", "total"):
        rate = rows[key][7]
        assert rate is not None
        # The writer was open between 1 s and (closed - opened) s before its last commit.
        assert tokens / (closed - opened) <= rate <= tokens / 1.0, (key, rate)
