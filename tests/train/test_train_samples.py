"""``dflash train --train-samples N``: N of the samples not held out, chosen by a keyed hash of the id (or of
the conversation root), checked against the rule written out here; nested in N, the validation split
untouched, the same under every world size's plan; a run reads no other sample, and a resume keeps N."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.reader import CacheReader
from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import iter_records
from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.placement import DistInfo
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.planner import LengthMixingPlanner
from dflash_offline.train.snapshot import IndexSnapshot, read_snapshot, snapshot_from_columns, split_snapshot
from dflash_offline.train.trainer import train_rank
from dflash_offline.train.validation import validation_ids_of_run
from tests.tiny_caches import TinyCaches
from tests.train.helpers import flat_config_json, train_config
from tests.train.plan_helpers import epoch_plan
from tests.train.test_validation import CountingReader
from tests.train.test_validation_groups import sharegpt_cache  # noqa: F401  (a fixture)

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")


def _val_key(name: str) -> float:
    digest = hashlib.blake2b(b"dflash-validation-split-v1\x00" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _train_key(name: str) -> float:
    """The documented rule, written out: the validation key's blake2b under the training salt."""
    digest = hashlib.blake2b(b"dflash-training-subset-v1\x00" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _snapshot(ids: list[str]) -> IndexSnapshot:
    return snapshot_from_columns(ids, [10 + i % 7 for i in range(len(ids))], [i % 3 for i in range(len(ids))])


def _whole_groups(ids: list[str], group_of: dict[str, str], n: int) -> set[str]:
    """Whole groups in ascending training key until they hold at least ``n`` of ``ids``."""
    members: dict[str, list[str]] = {}
    for s in ids:
        members.setdefault(group_of[s], []).append(s)
    out: set[str] = set()
    for group in sorted(members, key=_train_key):
        if len(out) >= n:
            break
        out |= set(members[group])
    return out


def test_subset_is_the_n_smallest_training_keys_nested_and_leaves_validation_alone() -> None:
    ids = [f"sample-{i:04d}" for i in range(600)]
    snap = _snapshot(ids)
    val = {s for s in ids if _val_key(s) < 0.1}
    rest = [s for s in ids if s not in val]
    chosen: dict[int, set[str]] = {}
    for n in (1, 40, 41, 200, len(rest) - 1):
        split = split_snapshot(snap, fraction=0.1, num_samples=None, train_samples=n)
        assert split.validation is not None
        assert set(split.validation.sample_ids) == val  # the same held-out samples whatever N
        assert split.num_not_held_out == len(rest)
        train = set(split.train.sample_ids)
        assert len(train) == n
        assert train == set(sorted(rest, key=_train_key)[:n])
        assert not train & val
        assert list(split.train.sample_ids) == sorted(train)  # canonical order
        rows = [ids.index(s) for s in split.train.sample_ids]
        assert split.train.num_tokens_N.tolist() == snap.num_tokens_N[rows].tolist()
        chosen[n] = train
    sizes = sorted(chosen)
    for small, large in itertools.pairwise(sizes):
        assert chosen[small] < chosen[large]
    # Another order of the same ids: the same subset. All of them: the plain split.
    again = split_snapshot(_snapshot(list(reversed(ids))), fraction=0.1, num_samples=None, train_samples=40)
    assert set(again.train.sample_ids) == chosen[40]
    plain = split_snapshot(snap, fraction=0.1, num_samples=None)
    every = split_snapshot(snap, fraction=0.1, num_samples=None, train_samples=len(rest))
    assert every.train.snapshot_id == plain.train.snapshot_id
    # No validation at all: N of the whole snapshot.
    off = split_snapshot(snap, fraction=0.0, num_samples=None, train_samples=30)
    assert off.validation is None
    assert set(off.train.sample_ids) == set(sorted(ids, key=_train_key)[:30])
    # More than the split leaves: refused, both numbers named.
    with pytest.raises(
        ConfigError, match=rf"`DataConfig\.train_samples` {len(rest) + 1} .* {len(rest)} \(the snapshot"
    ):
        split_snapshot(snap, fraction=0.1, num_samples=None, train_samples=len(rest) + 1)


def test_subset_by_conversation_takes_whole_roots() -> None:
    rng = np.random.default_rng(3)
    group_of = {f"s{r:03d}-{k}": f"root{r:03d}" for r in range(300) for k in range(int(rng.integers(1, 5)))}
    ids = sorted(group_of)
    snap = _snapshot(ids)
    val = {s for s in ids if _val_key(group_of[s]) < 0.1}
    rest = [s for s in ids if s not in val]
    previous: set[str] = set()
    for n in (10, 25, 100, 400):
        split = split_snapshot(snap, fraction=0.1, num_samples=None, groups=group_of, train_samples=n)
        assert split.validation is not None
        assert set(split.validation.sample_ids) == val
        train = set(split.train.sample_ids)
        assert train == _whole_groups(rest, group_of, n)
        assert n <= len(train) <= n + 3
        roots = {group_of[s] for s in train}
        assert {s for s in ids if group_of[s] in roots} == train  # whole conversations, none held out
        assert previous < train
        previous = train


def test_every_world_size_plans_the_subset_alone() -> None:
    """The subset is chosen before the planner, from the ids alone: one process and three plan the same
    samples, each once an epoch, and nothing else."""
    ids = [f"s:{i:04d}" for i in range(300)]
    rng = np.random.default_rng(0)
    snap = snapshot_from_columns(ids, rng.integers(10, 300, len(ids)), rng.integers(0, 3, len(ids)))
    split = split_snapshot(snap, fraction=0.1, num_samples=None, train_samples=120)
    want = set(sorted((s for s in ids if _val_key(s) >= 0.1), key=_train_key)[:120])
    for world_size in (1, 3):
        planner = LengthMixingPlanner(
            split.train, seed=4, tokens_per_microbatch=2000, grad_accum=2, world_size=world_size
        )
        planned = Counter(
            s for step in epoch_plan(planner, 0) for mb in step.microbatches if not mb.is_padding
            for s in mb.sample_ids
        )  # fmt: skip
        assert set(planned) == want
        assert set(planned.values()) == {1}


# ---- runs ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tiny_caches: TinyCaches) -> Path:
    return tiny_caches.get(records=60, seed=11).root


def _expected_subset(run: Path, n: int) -> set[str]:
    """The subset recomputed from the run's saved snapshot and validation split."""
    val = validation_ids_of_run(run) or frozenset()
    rest = [s for s in read_snapshot(run / "snapshot.parquet").sample_ids if s not in val]
    return set(sorted(rest, key=_train_key)[:n])


def test_a_run_reads_only_its_subset_and_validation(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One epoch, validation only at its end: every subset sample is read once (trained), every validation
    sample once (evaluated), no other sample at all."""
    run = tmp_path / "run"
    config = train_config(
        cache, run, epochs=1, max_steps=None, val_fraction=0.15, val_every=10_000, train_samples=20,
        export_at_end=False, tensorboard=False,
    )  # fmt: skip
    reader = CountingReader(cache)
    train_rank(config, CPU, reader=reader)
    val = validation_ids_of_run(run)
    assert val is not None
    assert len(val) >= 3
    subset = _expected_subset(run, 20)
    assert len(subset) == 20
    assert set(reader.reads) == subset | val
    assert set(reader.reads.values()) == {1}
    snapshot = read_snapshot(run / "snapshot.parquet")
    line = f"training on 20 of {len(snapshot) - len(val)} samples"
    assert line in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["data"]["train_samples"] == 20
    with pytest.raises(ConfigError, match=rf"`DataConfig\.train_samples` 500 .* {len(snapshot) - len(val)} "):
        train_rank(config.with_options(out_dir=tmp_path / "too-many", train_samples=500), CPU)


def test_resume_keeps_n_and_refuses_another(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = train_config(cache, run, max_steps=2, checkpoint_every=2, train_samples=20, tensorboard=False)
    run_training(config)
    run_training(config.with_options(max_steps=3))  # the same N resumes
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    for other in (21, None):
        with pytest.raises(
            ResumeError,
            match=r"trained with `DataConfig\.train_samples` 20.* "
            r"resume with the same `DataConfig\.train_samples`",
        ):
            run_training(config.with_options(max_steps=4, train_samples=other))
    # A run whose config.json predates --train-samples trained on every sample: it resumes without it.
    old = tmp_path / "old"
    run_training(config.with_options(out_dir=old, train_samples=None))
    saved = flat_config_json(json.loads((old / "config.json").read_text()))
    del saved["train_samples"]
    (old / "config.json").write_text(json.dumps(saved))
    run_training(config.with_options(out_dir=old, train_samples=None, max_steps=3))
    with pytest.raises(
        ResumeError,
        match=r"`DataConfig\.train_samples` None.*this run asks for `DataConfig\.train_samples` 20",
    ):
        run_training(config.with_options(out_dir=old, max_steps=4))


def test_root_id_subset_in_a_run(sharegpt_cache: tuple[Path, Path], tmp_path: Path) -> None:  # noqa: F811
    """Without a validation split, ``--val-group root-id`` still reads the roots: the run trains on whole
    conversations of smallest training key."""
    cache_dir, data = sharegpt_cache
    root_of = {
        c.sample_id: c.record_id.rsplit("_", 1)[0] for c in iter_records(data) if isinstance(c, Conversation)
    }
    with CacheReader.open(cache_dir) as r:
        cached = sorted(r.samples.sample_id.tolist())
    run = tmp_path / "run"
    config = train_config(
        cache_dir, run, epochs=1, max_steps=None, val_fraction=0.0, val_group="root-id", train_samples=8,
        export_at_end=False, tensorboard=False,
    )  # fmt: skip
    reader = CountingReader(cache_dir)
    train_rank(config, CPU, reader=reader)
    want = _whole_groups(cached, root_of, 8)
    assert len(want) > 8  # a root of several records crosses N: taken whole
    assert set(reader.reads) == want
    assert set(reader.reads.values()) == {1}
