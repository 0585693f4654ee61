"""``dflash train --follow`` over a window cache (docs/follow.md): every training sample is trained
exactly ``--passes`` times, counted from the run's records (each segment's snapshot, its plan and the
step its run reached); every training store is retired after its segment's last checkpoint; the
validation stores are never retired; the cache stays sound for every reader."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.window import is_validation_store, read_retirements, read_seals
from dflash_offline.errors import ConfigError
from dflash_offline.generate.run import run_generate
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.follow import read_follow_state, run_follow, segment_dir
from dflash_offline.train.planner import LengthMixingPlanner
from dflash_offline.train.snapshot import SNAPSHOT_FILE, held_out_of_run, read_snapshot, split_snapshot
from tests.generate.helpers import make_chat_jsonl, tiny_config
from tests.tiny_caches import build_once, copy_cache, shared_temp_dir
from tests.train.helpers import train_config

VAL_FRACTION = 0.1
SMALL_FILES = dict(chunk_bytes=2048, shard_file_bytes=16384)


def window_cache(root: Path, data: Path, **overrides: object) -> Path:
    config = tiny_config(
        root,
        data,
        window_limit=10**9,  # no wait: this cache is written before training
        store_size=60_000,
        val_fraction=VAL_FRACTION,
        flush_seconds=0.2,
        **SMALL_FILES,
        **overrides,
    )
    assert run_generate(config).status == "finished"
    return root


@pytest.fixture(scope="session")
def written_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A window cache of 80 records, written before training, once for the session (xdist workers share
    it): the tests train on copies of it."""

    def build(where: Path) -> None:
        window_cache(where / "cache", make_chat_jsonl(where / "chat.jsonl", 80, seed=3))

    return build_once(shared_temp_dir(tmp_path_factory) / "follow-window", build) / "cache"


def follow_config(cache: Path, out: Path, **overrides: object) -> TrainConfig:
    settings: dict[str, object] = dict(
        follow=True, passes=2, max_steps=None, val_fraction=VAL_FRACTION, val_every=1000
    )
    return train_config(cache, out, **{**settings, **overrides})


def passes_from_records(run: Path, config: TrainConfig) -> Counter[str]:
    """How often each sample was trained, replayed from the run's records: each segment's snapshot and
    split (as the segment's run made them), its plan over ``--passes`` epochs, up to the step its last
    checkpoint recorded."""
    state = read_follow_state(run)
    assert state is not None
    counts: Counter[str] = Counter()
    for segment in state.segments:
        if segment.num_samples == 0:
            continue  # stores without samples: retired untrained
        folder = segment_dir(run, segment.index)
        snapshot = read_snapshot(folder / SNAPSHOT_FILE)
        held_out = held_out_of_run(folder)  # the validation stores' samples, saved when it was planned
        assert held_out is not None
        train = split_snapshot(
            snapshot, fraction=config.data.val_fraction, num_samples=None, held_out=held_out
        ).train
        planner = LengthMixingPlanner(
            train,
            seed=config.data.seed,
            tokens_per_microbatch=config.data.tokens_per_microbatch,
            grad_accum=config.topology.grad_accum,
            world_size=config.launch.world_size,
        )
        last_checkpoint = max(step for step, _ in list_checkpoints(folder))
        assert last_checkpoint == planner.total_steps(state.passes)
        for step in planner.iterate(state.passes):
            for mb in step.microbatches:
                if not mb.is_padding:
                    counts.update(train.sample_ids[r] for r in mb.rows)
    return counts


def check_followed(cache: Path, run: Path, config: TrainConfig) -> None:
    rows = read_table(cache, "samples", ["sample_id", "shard"]).to_pydict()
    shard_of = dict(zip(rows["sample_id"], rows["shard"], strict=True))
    train_ids = {i for i, s in shard_of.items() if not is_validation_store(s)}
    val_ids = set(shard_of) - train_ids
    assert train_ids
    assert val_ids
    counts = passes_from_records(run, config)
    assert set(counts) == train_ids  # no validation sample trained on
    assert set(counts.values()) == {config.window.passes}
    retired = read_retirements(cache)
    assert set(retired) == {s for s in read_seals(cache) if not is_validation_store(s)}
    assert {r.run_id for r in retired.values()} == {f"train-follow:{run.resolve()}"}
    assert not any(is_validation_store(s) for s in retired)
    report = verify_cache(cache, progress=False)
    assert report.ok
    assert report.samples_checked == len(val_ids)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("workers", [2])  # one rank is the kill test's (tests/train/test_follow_kill.py)
def test_follow_trains_every_sample_its_passes_and_retires_its_stores(
    written_window: Path, tmp_path: Path, workers: int
) -> None:
    cache = copy_cache(written_window, tmp_path / "cache")  # training retires (deletes) its stores
    config = follow_config(cache, tmp_path / "run", num_cpu_workers=workers)
    result = run_follow(config)
    check_followed(cache, tmp_path / "run", config)
    assert result.segments == 1  # generate had finished: one segment of every store
    assert result.last_drafter is not None
    assert (result.last_drafter / "model.safetensors").is_file()
    again = run_follow(config)  # a finished run rerun: nothing left to do
    assert again.segments == 1


@pytest.mark.slow
def test_follow_refuses_a_split_unlike_the_routing(written_window: Path, tmp_path: Path) -> None:
    cache = copy_cache(written_window, tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"routed a validation share of 0\.1"):
        run_follow(follow_config(cache, tmp_path / "run", val_fraction=0.2))
    with pytest.raises(
        ConfigError, match=r"`OptimizerConfig\.max_steps` does not go with `WindowConfig\.follow`"
    ):
        run_follow(follow_config(cache, tmp_path / "run", max_steps=3))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rerun_of_a_finished_generate_after_follow_leaves_the_window_drained(
    written_window: Path, tmp_path: Path
) -> None:
    """The same generate command again, after the follow run retired every training store: its workers get
    no job and open no store, so no empty store is sealed that no run would retire (bench/soak_follow.py
    found two such stores a round when a kill hit a generate that had already finished)."""
    cache = copy_cache(written_window, tmp_path / "cache")
    config = follow_config(cache, tmp_path / "run")
    run_follow(config)
    stores = sorted(p.name for p in (cache / "shards").iterdir())
    seals = read_seals(cache)
    window_cache(cache, written_window.parent / "chat.jsonl")  # the same command: nothing left to do
    assert sorted(p.name for p in (cache / "shards").iterdir()) == stores
    assert read_seals(cache) == seals
    check_followed(cache, tmp_path / "run", config)


def test_stores_without_samples_are_retired_without_a_run(tmp_path: Path) -> None:
    """A store can hold failures only (a worker's new store that got a failed sample, then closed)."""
    from dflash_offline.cache.rolling import RollingWriter
    from dflash_offline.cache.writer import ShardWriter
    from dflash_offline.train.follow import FollowState, new_segment
    from tests.cache._samples import TINY, make_fingerprint

    fingerprint = make_fingerprint()

    def open_store(session: str) -> ShardWriter:
        return ShardWriter(tmp_path / "cache", fingerprint, worker=0, session=session, **TINY)

    with RollingWriter(
        open_store, worker=0, session="s", store_bytes=None, token_bytes=1, val_fraction=0, fsync=False
    ) as w:
        w.add_failure(sample_id="x", source_index=0, reason="too_long", detail="")
    config = train_config(tmp_path / "cache", tmp_path / "run", follow=True, max_steps=None)
    segment = new_segment(config, FollowState(passes=2, segments=()))
    assert segment is not None
    assert segment.stores == ("w000-s",)
    assert segment.num_samples == 0
    assert segment.trained
