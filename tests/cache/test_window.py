"""The disk window's cache side (docs/follow.md): stores roll over at a size and are sealed,
validation samples go to stores of their own, and a retired store is intentionally gone for every
reader (never listed, never read, never reported as damage)."""

from __future__ import annotations

import dataclasses

import duckdb
import numpy as np
import pytest

from dflash_offline.cache.index import build_index
from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.manifest import committed_sample_ids, read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.repair import plan_repair
from dflash_offline.cache.rolling import RollingWriter
from dflash_offline.cache.rows import utc_now
from dflash_offline.cache.sql import SqlConfig, run_sql
from dflash_offline.cache.status import cache_status
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.window import (
    finish_retirements,
    is_validation_store,
    read_seals,
    record_wait,
    retire_store,
    routing_key,
    seal_orphans,
    window_usage,
)
from dflash_offline.cache.window_records import StoreRetirement, WindowWait
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.train.snapshot import validation_key, validation_mask
from tests.cache._samples import TINY, assert_same, make_fingerprint, make_samples

VAL_FRACTION = 0.25


def write_rolling(root, fingerprint, samples, *, store_bytes, val_fraction=VAL_FRACTION, worker=0):
    def open_store(session: str) -> ShardWriter:
        return ShardWriter(root, fingerprint, worker=worker, session=session, flush_seconds=1e9, **TINY)

    token_bytes = fingerprint.storage.token_bytes
    with RollingWriter(
        open_store,
        worker=worker,
        session=f"sess{worker}",
        store_bytes=store_bytes,
        token_bytes=token_bytes,
        val_fraction=val_fraction,
        fsync=False,
    ) as writer:
        for sample in samples:
            writer.add(sample)
    return writer


def store_tokens(root) -> dict[str, int]:
    samples = read_table(root, "samples", ["shard", "num_tokens"]).to_pydict()
    tokens: dict[str, int] = {}
    for shard, n in zip(samples["shard"], samples["num_tokens"], strict=True):
        tokens[shard] = tokens.get(shard, 0) + n
    return tokens


def test_stores_roll_over_at_their_size_and_every_store_is_sealed(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(80))
    token_bytes = fingerprint.storage.token_bytes
    store_bytes = 200 * token_bytes
    writer = write_rolling(tmp_path, fingerprint, samples, store_bytes=store_bytes)

    tokens = store_tokens(tmp_path)
    seals = read_seals(tmp_path)
    assert set(seals) == set(tokens)
    assert len(tokens) >= 5
    assert {s.shard for s in writer.sealed} == set(tokens)
    longest = max(s.num_tokens for s in samples) * token_bytes
    for shard, n in tokens.items():
        # A store is closed by the sample that reaches its size: never more than one sample over it.
        assert n * token_bytes < store_bytes + longest
        assert seals[shard].num_tokens == n
        assert seals[shard].validation == is_validation_store(shard)
    # Only the last store of each lane is sealed by the close; the others by their size.
    assert sorted(s.reason for s in seals.values()).count("close") == 2
    with CacheReader.open(tmp_path, check_checksums=True) as reader:
        got = reader.read([s.sample_id for s in samples])
    for g, want in zip(got, samples, strict=True):
        assert_same(g, want)
    assert writer.stats.samples == len(samples)


def test_a_session_handed_no_sample_leaves_no_store(tmp_path):
    """A worker that gets no job (a rerun of a finished generate) opens no store, so it seals none: an empty
    store sealed after the follow run had ended would never be retired. One failure opens a store."""
    fingerprint = make_fingerprint()
    writer = write_rolling(tmp_path, fingerprint, [], store_bytes=None)
    assert writer.sealed == []
    assert list(tmp_path.iterdir()) == []  # no store, no seal (here not even the cache, which generate makes)
    assert writer.stats.shard == "w000-sess0"
    assert writer.stats.samples == 0

    def open_store(session: str) -> ShardWriter:
        return ShardWriter(tmp_path, fingerprint, worker=1, session=session, flush_seconds=1e9, **TINY)

    with RollingWriter(
        open_store, worker=1, session="f", store_bytes=None, token_bytes=1, val_fraction=0, fsync=False
    ) as failing:
        failing.add_failure(sample_id="x", source_index=0, reason="too_long", detail="")
    assert [s.shard for s in failing.sealed] == ["w001-f"] == list(read_seals(tmp_path))


def test_validation_samples_are_routed_by_the_split_hash(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(80))
    write_rolling(tmp_path, fingerprint, samples, store_bytes=None)
    shard_of = dict(
        zip(*read_table(tmp_path, "samples", ["sample_id", "shard"]).to_pydict().values(), strict=True)
    )
    want_val = {s.sample_id for s in samples if validation_key(s.sample_id) < VAL_FRACTION}
    assert 5 < len(want_val) < 40  # the hash splits this set both ways
    assert {i for i, shard in shard_of.items() if is_validation_store(shard)} == want_val
    for s in samples:  # no conversation root known: each sample is its own conversation
        assert s.conversation_root is None
        assert routing_key(sample_id=s.sample_id, conversation_root=None) == validation_key(s.sample_id)


def test_the_samples_of_one_conversation_land_on_one_side(tmp_path):
    """Samples sharing a conversation root (ShareGPT's X_0, X_11, …; other answers to the same prompts)
    all go to validation stores or all to training stores, as ``dflash train --val-group root-id`` would
    split them: a split by sample would train on a validation sample's sibling."""
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(60))
    # Three samples a conversation; the roots are searched so that the key of each sample alone would split
    # some conversation across the two sides (the leak), and the conversations fall on both sides.
    for offset in range(100):
        roots = {s.sample_id: f"conv{(i // 3) + offset:04d}" for i, s in enumerate(samples)}
        by_sample = {s: validation_key(s) < VAL_FRACTION for s in roots}
        sides_by_sample = {r: {by_sample[s] for s in roots if roots[s] == r} for r in roots.values()}
        if any(len(sides) == 2 for sides in sides_by_sample.values()) and 0 < sum(
            validation_key(r) < VAL_FRACTION for r in set(roots.values())
        ) < len(set(roots.values())):
            break
    else:
        raise AssertionError("no root naming splits a conversation under the per-sample key")
    samples = [dataclasses.replace(s, conversation_root=roots[s.sample_id]) for s in samples]
    write_rolling(tmp_path, fingerprint, samples, store_bytes=400 * fingerprint.storage.token_bytes)

    rows = read_table(tmp_path, "samples", ["sample_id", "shard", "conversation_root"]).to_pydict()
    assert sorted(rows["sample_id"]) == sorted(roots)
    side: dict[str, set[bool]] = {}
    for sample_id, shard, root in zip(
        rows["sample_id"], rows["shard"], rows["conversation_root"], strict=True
    ):
        assert root == roots[sample_id]
        side.setdefault(root, set()).add(is_validation_store(shard))
    assert all(len(sides) == 1 for sides in side.values())  # never split
    held_out = {
        s for s, shard in zip(rows["sample_id"], rows["shard"], strict=True) if is_validation_store(shard)
    }
    # The reference: the validation split of ``dflash train --val-group root-id`` over the same samples.
    ids = sorted(roots)
    mask = validation_mask(ids, fraction=VAL_FRACTION, num_samples=None, groups=roots)
    assert held_out == {s for s, m in zip(ids, mask, strict=True) if m}
    assert 0 < len(held_out) < len(ids)


def retire(root, shard: str, run_id: str = "run-1") -> None:
    tokens = store_tokens(root)[shard]
    n = read_seals(root)[shard].num_samples
    retire_store(
        root,
        StoreRetirement(shard=shard, run_id=run_id, num_samples=n, num_tokens=tokens, retired_at=utc_now()),
    )


def test_a_retired_store_is_gone_for_every_reader_but_its_rows_stay(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(60))
    write_rolling(tmp_path, fingerprint, samples, store_bytes=150 * fingerprint.storage.token_bytes)
    tokens = store_tokens(tmp_path)
    train_stores = sorted(s for s in tokens if not is_validation_store(s))
    gone = train_stores[:2]
    for shard in gone:
        retire(tmp_path, shard)
    layout = CacheLayout.at(tmp_path)
    assert not any(layout.shard_group(shard).exists() for shard in gone)

    rows = read_table(tmp_path, "samples", ["sample_id", "shard"]).to_pydict()
    retired_ids = {i for i, s in zip(rows["sample_id"], rows["shard"], strict=True) if s in gone}
    assert retired_ids
    assert committed_sample_ids(tmp_path) == {s.sample_id for s in samples}  # generate's resume skips them
    with CacheReader.open(tmp_path, check_checksums=True) as reader:
        listed = set(reader.samples.sample_id.tolist())
        assert listed == {s.sample_id for s in samples} - retired_ids
        for got in reader.read(sorted(listed)):
            assert_same(got, next(s for s in samples if s.sample_id == got.sample_id))
    report = verify_cache(tmp_path, progress=False)
    assert report.ok
    assert not report.damaged
    assert not report.unreferenced
    plan = plan_repair(tmp_path, progress=False)
    assert not plan.changes
    usage = window_usage(tmp_path)
    assert usage.retired_stores == 2
    assert usage.retired_samples == len(retired_ids)
    val_tokens = sum(n for s, n in tokens.items() if is_validation_store(s))
    val_samples = sum(1 for s in rows["shard"] if is_validation_store(s))
    assert usage.samples == len(samples) - len(retired_ids) - val_samples
    token_bytes = fingerprint.storage.token_bytes
    assert (
        usage.stored_bytes == (sum(n for s, n in tokens.items() if s not in gone) - val_tokens) * token_bytes
    )
    assert usage.validation_bytes == val_tokens * token_bytes
    assert usage.validation_samples == val_samples

    build_index(tmp_path)
    with duckdb.connect(str(layout.index_path), read_only=True) as con:
        states = dict(con.execute("SELECT shard, state FROM window_stores").fetchall())
        totals = con.execute("SELECT samples_retired, stores_retired FROM window_totals").fetchall()
    assert {s for s, state in states.items() if state == "retired"} == set(gone)
    assert set(states.values()) == {"retired", "sealed"}
    assert totals == [(len(retired_ids), 2)]


def test_a_kill_between_record_and_deletion_leaves_a_store_readers_skip(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(40))
    write_rolling(tmp_path, fingerprint, samples, store_bytes=150 * fingerprint.storage.token_bytes)
    shard = sorted(s for s in store_tokens(tmp_path) if not is_validation_store(s))[0]
    layout = CacheLayout.at(tmp_path)
    kept = tmp_path.parent / "kept.zarr"
    layout.shard_group(shard).rename(kept)
    retire(tmp_path, shard)
    kept.rename(layout.shard_group(shard))  # as if killed after the record, before the deletion
    with CacheReader.open(tmp_path) as reader:
        assert shard not in set(reader.samples.shard.tolist())
    assert not verify_cache(tmp_path, progress=False).damaged
    assert finish_retirements(tmp_path) == 1
    assert not layout.shard_group(shard).exists()
    assert finish_retirements(tmp_path) == 0


def test_a_validation_store_is_never_retired(tmp_path):
    fingerprint = make_fingerprint()
    write_rolling(tmp_path, fingerprint, make_samples(fingerprint, range(30)), store_bytes=None)
    shard = next(s for s in store_tokens(tmp_path) if is_validation_store(s))
    with pytest.raises(AssertionError, match="never be retired"):
        retire(tmp_path, shard)
    assert CacheLayout.at(tmp_path).shard_group(shard).exists()


def test_stores_of_a_killed_writer_are_sealed_by_the_next_lock_holder(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(20))
    writer = ShardWriter(tmp_path, fingerprint, worker=3, session="killed", flush_seconds=1e9, **TINY)
    for sample in samples:
        writer.add(sample)
    writer.flush()  # committed, then "killed": never closed, never sealed
    assert read_seals(tmp_path) == {}
    sealed = seal_orphans(tmp_path)
    assert [s.shard for s in sealed] == [writer.shard]
    assert sealed[0].reason == "recovered"
    assert sealed[0].num_samples == len(samples)
    assert sealed[0].num_tokens == int(np.sum([s.num_tokens for s in samples]))
    assert seal_orphans(tmp_path) == []


def test_status_and_sql_show_the_window(tmp_path):
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(50))
    write_rolling(tmp_path, fingerprint, samples, store_bytes=150 * fingerprint.storage.token_bytes)
    tokens = store_tokens(tmp_path)
    gone = sorted(s for s in tokens if not is_validation_store(s))[0]
    retire(tmp_path, gone)
    record_wait(
        tmp_path, WindowWait(run_id="gen-1", side="generate", started_at=utc_now(), seconds=1.5), number=1
    )
    record_wait(
        tmp_path, WindowWait(run_id="gen-1", side="generate", started_at=utc_now(), seconds=2.0), number=2
    )
    rows = read_table(tmp_path, "samples", ["shard"]).column("shard").to_pylist()
    retired_samples = rows.count(gone)

    status = cache_status(tmp_path)
    assert status.window is not None
    assert status.window.samples_retired == retired_samples
    assert status.window.stores_retired == 1
    assert status.window.samples_present == len(samples) - retired_samples
    assert status.window.tokens_retired == tokens[gone]
    assert status.window.samples_in_open_stores == 0  # the writer closed: every store is sealed
    text = status.render()
    assert f"{retired_samples:,} samples ({tokens[gone]:,} tokens) trained and retired in 1 stores" in text
    assert "gen-1 waited 3.5 s for room in the window (2 times)" in text

    result = run_sql(SqlConfig(root=tmp_path, sql=None, query_name="window", source="manifest"))
    states = [row[result.columns.index("state")] for row in result.rows]
    assert sorted(states) == sorted("retired" if s == gone else "sealed" for s in tokens)


def test_status_of_a_cache_without_a_window_has_no_window_line(tmp_path):
    fingerprint = make_fingerprint()
    with ShardWriter(tmp_path, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for sample in make_samples(fingerprint, range(5)):
            writer.add(sample)
    status = cache_status(tmp_path)
    assert status.window is None
    assert "window" not in status.render()


def test_plot_shows_the_window_over_time(tmp_path):
    from dflash_offline.plot.cache_plots import plot_cache
    from dflash_offline.plot.window_plots import window_series

    cache = tmp_path / "cache"
    fingerprint = make_fingerprint()
    samples = make_samples(fingerprint, range(40))
    write_rolling(cache, fingerprint, samples, store_bytes=150 * fingerprint.storage.token_bytes)
    gone = sorted(s for s in store_tokens(cache) if not is_validation_store(s))[:2]
    for shard in gone:
        retire(cache, shard)
    record_wait(cache, WindowWait(run_id="t", side="train", started_at=utc_now(), seconds=0.5), number=1)
    series = window_series(cache)
    assert series is not None
    retired = sum(read_seals(cache)[s].num_samples for s in gone)
    assert series.committed_E[-1] == len(samples)
    assert series.retired_E[-1] == retired
    assert series.present_E[-1] == len(samples) - retired
    assert [side for side, _, _ in series.waits] == ["train"]
    files = plot_cache(cache, tmp_path / "plots")
    assert tmp_path / "plots" / "window.png" in files
