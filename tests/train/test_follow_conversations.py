"""``dflash train --follow`` validates on what generate stored (docs/follow.md): each segment holds out
exactly the samples of the validation stores, whole conversations as generate routed them, and trains on
the training stores' samples; nothing on the training side hashes sample ids again."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.window import is_validation_store
from dflash_offline.generate.run import run_generate
from dflash_offline.run_split import read_run_split
from dflash_offline.train.follow import read_follow_state, run_follow, segment_dir
from dflash_offline.train.snapshot import validation_key
from dflash_offline.train.validation import split_of_run
from tests.generate.helpers import tiny_config
from tests.generate.test_window_conversations import VAL_FRACTION, related_records
from tests.train.helpers import train_config


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_follow_segments_hold_out_the_validation_stores_whole_conversations(tmp_path: Path) -> None:
    data, root_of = related_records(tmp_path)
    cache = tmp_path / "cache"
    generate = tiny_config(cache, data, window_limit=10**9, store_size=30_000, val_fraction=VAL_FRACTION)
    assert run_generate(generate).status == "finished"
    rows = read_table(cache, "samples", ["sample_id", "shard"]).to_pydict()
    in_validation_store = {
        s for s, shard in zip(rows["sample_id"], rows["shard"], strict=True) if is_validation_store(shard)
    }
    # Samples the training side would misplace if it hashed their own ids: held out by their id's key
    # but stored for training, or the other way round.
    misplaced_by_id = {s for s in root_of if (validation_key(s) < VAL_FRACTION) != (s in in_validation_store)}
    assert misplaced_by_id

    run = tmp_path / "run"
    config = train_config(
        cache, run, follow=True, passes=1, max_steps=None, val_fraction=VAL_FRACTION, val_every=1000
    )
    run_follow(config)
    state = read_follow_state(run)
    assert state is not None
    assert [s.num_samples for s in state.segments] == [len(root_of) - len(in_validation_store)]
    folder = segment_dir(run, state.segments[0].index)
    split = read_run_split(folder)
    assert split is not None
    assert split.validation == in_validation_store
    assert split.train == set(root_of) - in_validation_store
    roots_held = {root_of[s] for s in split.validation}
    assert not any(root_of[s] in roots_held for s in split.train)  # no conversation on both sides
    # The split as recomputed for ``dflash eval`` (train/validation.py ``split_of_run``) is the run's own.
    again = split_of_run(folder)
    assert again is not None
    assert again.validation is not None
    assert set(again.validation.sample_ids) == in_validation_store
    assert set(again.train.sample_ids) == split.train
