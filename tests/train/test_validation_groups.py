"""``--val-group root-id``: the records of one conversation (ShareGPT's ``X_0``, ``X_11``, …) are held out
together or trained on together; the roots come from the data file the cache was generated from, are
saved with the run, and a resume keeps the split even when that file is gone."""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.manifest import record_run
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import RunRow, SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import conversation_root, iter_records, source_name
from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.run_split import SPLIT_FILE, read_run_split
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import read_metrics, validation_records
from dflash_offline.train.snapshot import (
    GROUPS_FILE,
    read_groups,
    read_snapshot,
    snapshot_from_columns,
    split_snapshot,
    validation_key,
)
from dflash_offline.train.validation import validation_ids_of_run
from tests.eval.helpers import tiny_fingerprint
from tests.generate.helpers import WORDS
from tests.train.helpers import train_config


def test_conversation_root() -> None:
    assert conversation_root("QWJhYvA_0", "s1") == "QWJhYvA"
    assert conversation_root("hRPPgZT_17", "s2") == "hRPPgZT"
    # Other ids are conversations of their own (a generic "name_3" is not taken for a ShareGPT part).
    assert conversation_root("rec_3", "s3") == "rec_3"
    assert conversation_root("QWJhYvA_0_1", "s4") == "QWJhYvA_0_1"
    assert conversation_root("", "s5") == "s5"


def _grouped_ids(num_roots: int, seed: int = 0) -> dict[str, str]:
    """sample id → root: 1..4 samples per root."""
    rng = np.random.default_rng(seed)
    out = {}
    for r in range(num_roots):
        for k in range(int(rng.integers(1, 5))):
            out[f"s{r:03d}-{k}"] = f"root{r:03d}"
    return out


def test_split_by_group_keeps_groups_whole() -> None:
    groups = _grouped_ids(300)
    ids = sorted(groups)
    snap = snapshot_from_columns(ids, [10] * len(ids), [0] * len(ids))
    split = split_snapshot(snap, fraction=0.1, num_samples=None, groups=groups)
    assert split.validation is not None
    val = set(split.validation.sample_ids)
    # The documented rule: a sample is held out when its root's key is below the fraction.
    assert val == {s for s in ids if validation_key(groups[s]) < 0.1}
    held_roots = {groups[s] for s in val}
    assert {s for s in ids if groups[s] in held_roots} == val  # no root on both sides
    assert not set(split.train.sample_ids) & val
    # --val-samples: whole groups of the smallest keys, until at least N samples.
    exact = split_snapshot(snap, fraction=0.1, num_samples=25, groups=groups)
    assert exact.validation is not None
    roots_by_key = sorted(set(groups.values()), key=validation_key)
    want: set[str] = set()
    for root in roots_by_key:
        if len(want) >= 25:
            break
        want |= {s for s in ids if groups[s] == root}
    assert set(exact.validation.sample_ids) == want
    assert 25 <= len(want) <= 28
    # Without groups, as before: the 25 samples of smallest key.
    plain = split_snapshot(snap, fraction=0.1, num_samples=25)
    assert plain.validation is not None
    assert set(plain.validation.sample_ids) == set(sorted(ids, key=validation_key)[:25])


def _sharegpt_file(path: Path, num_roots: int) -> Path:
    """ShareGPT-format records: each root split into 1..3 records ``X_0``, ``X_4``, …, as ShareGPT does."""
    rng = np.random.default_rng(5)
    with open(path, "w") as f:
        for r in range(num_roots):
            root = f"R{r:05d}x"[:7]
            for part in range(int(rng.integers(1, 4))):
                turns = []
                for _ in range(int(rng.integers(1, 3))):
                    human = " ".join(rng.choice(WORDS, int(rng.integers(2, 9))))
                    gpt = " ".join(rng.choice(WORDS, int(rng.integers(2, 30))))
                    turns += [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]
                f.write(json.dumps({"id": f"{root}_{4 * part}", "conversations": turns}) + "\n")
    return path


def write_cache_of(cache: Path, data: Path) -> Path:
    """A real cache of ``data``'s records for the random:tiny target, as ``dflash generate`` leaves it
    (sample ids over the file's source name, its generate run recorded) with random features: the split
    reads ids and runs, not features, and a generate run would cost a worker process."""
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    fp = replace(tiny_fingerprint(data_source=source_name(data)), hidden_size=64)
    rng = np.random.default_rng(0)
    with ShardWriter(cache, fp, worker=0, shard_bytes=1 << 16, chunk_bytes=1 << 12) as writer:
        for c in records:
            n = int(rng.integers(8, 65))
            bits = rng.integers(0, 1 << 14, size=(n, fp.feature_width), dtype=np.uint16)
            writer.add(
                SampleToWrite(
                    sample_id=c.sample_id,
                    source_index=c.source_index,
                    input_ids_T=rng.integers(0, 1000, n).astype(np.int32),
                    loss_mask_T=np.ones(n, dtype=np.uint8),
                    features_TF=torch.from_numpy(bits).view(torch.bfloat16),
                    bucket_id=int(np.searchsorted(fp.bucket_edges, n)),
                )
            )
    now = dt.datetime.now(dt.UTC)
    record_run(
        cache,
        RunRow(
            run_id="gen-1", command="generate", started_at=now, finished_at=now, status="finished",
            num_workers=1, samples_committed=len(records), tokens_committed=0, bytes_written=0,
            failures=0, fingerprint_json="{}", host="test",
            config_json=json.dumps({"data": str(data), "data_format": "auto"}),
        ),
    )  # fmt: skip
    return cache


@pytest.fixture(scope="module")
def sharegpt_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("groups")
    data = _sharegpt_file(root / "parts.jsonl", 16)
    return write_cache_of(root / "cache", data), data


def test_root_id_split_in_a_run_and_its_resume(sharegpt_cache: tuple[Path, Path], tmp_path: Path) -> None:
    cache, data = sharegpt_cache
    root_of = {
        c.sample_id: re.sub(r"_\d+$", "", c.record_id)  # the ShareGPT rule, written out
        for c in iter_records(data)
        if isinstance(c, Conversation)
    }
    with CacheReader.open(cache) as reader:
        cached = set(reader.samples.sample_id.tolist())
    assert len(set(root_of.values())) < len(cached)  # several records share a root
    run = tmp_path / "run"
    config = train_config(
        cache, run, val_fraction=0.3, val_group="root-id", val_every=2, max_steps=4, tensorboard=False
    )
    run_training(config)
    saved = read_groups(run / GROUPS_FILE)
    assert saved == {s: root_of[s] for s in cached}
    val = validation_ids_of_run(run)
    assert val is not None
    assert 0 < len(val) < len(cached)
    held_roots = {root_of[s] for s in val}
    assert {s for s in cached if root_of[s] in held_roots} == val  # whole conversations
    assert val == {s for s in cached if validation_key(root_of[s]) < 0.3}
    train_ids = set(read_snapshot(run / "snapshot.parquet").sample_ids) - val
    assert not {root_of[s] for s in train_ids} & held_roots
    # The run's split file, what `dflash eval` reads, says the same.
    written = read_run_split(run)
    assert written is not None
    assert (written.train, written.validation, written.left_out) == (train_ids, val, frozenset())
    records = validation_records(read_metrics(run / "metrics.jsonl"))  # type: ignore[arg-type]
    assert records
    assert records[-1]["val_num_samples"] == len(val)

    # A resume reads the saved roots: it keeps the split although the data file is gone now.
    moved = data.with_name("moved.jsonl")
    data.rename(moved)
    (run / SPLIT_FILE).unlink()  # as a run trained before the file existed: the resume writes it
    try:
        run_training(config.with_options(max_steps=6))
        assert validation_ids_of_run(run) == val
        assert read_run_split(run) == written
        # The finished run's command again: no step runs, and the split file is back.
        (run / SPLIT_FILE).unlink()
        rerun = run_training(config.with_options(max_steps=6))
        assert rerun is not None
        assert rerun.global_step == 6
        assert read_run_split(run) == written
        assert validation_records(read_metrics(run / "metrics.jsonl"))[-1]["step"] == 6  # type: ignore[arg-type]
        assert validation_records(read_metrics(run / "metrics.jsonl"))[-1]["step"] == 6  # type: ignore[arg-type]
        # A fresh run cannot read the roots: it says so instead of splitting by sample.
        with pytest.raises(ConfigError, match=r"`DataConfig\.val_group` root-id needs the record id"):
            run_training(config.with_options(out_dir=tmp_path / "fresh"))
    finally:
        moved.rename(data)
    with pytest.raises(ResumeError, match=r"`DataConfig\.val_group`"):
        run_training(config.with_options(val_group="sample", max_steps=8))
