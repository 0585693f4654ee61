"""Cache format 3 stores each sample's conversation root in its row: ``dflash generate`` writes it, and
``--val-group root-id`` reads it there instead of parsing the data file again. A cache of format 2 (rows
without a root, as the earlier writer left them) still splits, identically, from the data file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash_offline.cache.layout import CacheLayout, read_format_version
from dflash_offline.cache.manifest import PartName, read_parts, read_table, write_part
from dflash_offline.data.conversations import Conversation, Message
from dflash_offline.data.sources import iter_records, source_name
from dflash_offline.data.template import tokenize_conversation
from dflash_offline.errors import ConfigError
from dflash_offline.generate.run import run_generate
from dflash_offline.target_model.loader import load_tokenizer
from dflash_offline.train.snapshot import (
    conversation_groups,
    reparsed_roots,
    snapshot_from_columns,
    split_snapshot,
    stored_roots,
)
from tests.generate.helpers import tiny_config
from tests.tiny_caches import copy_cache
from tests.train.test_validation_groups import _sharegpt_file


def as_format_2(cache: Path) -> Path:
    """Rewrite ``cache`` as the format-2 writer left it: sample parts without the ``conversation_root``
    column (each renamed by the sha256 of its new bytes), cache.json at format 2."""
    layout = CacheLayout.at(cache)
    for part in layout.parts("samples"):
        table = read_parts("samples", [part]).drop_columns(["conversation_root"])
        part.unlink()
        write_part(part.with_name(f"{PartName.parse(part).stem}.parquet"), table)
    doc = json.loads(layout.cache_json.read_text())
    layout.cache_json.write_text(json.dumps({**doc, "format_version": 2}))
    return cache


def _no_data_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of a data file fail."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data file was read")

    monkeypatch.setattr("dflash_offline.data.sources.iter_records", refuse)


def _sample_ids(cache: Path) -> list[str]:
    return read_table(cache, "samples", ["sample_id"]).column("sample_id").to_pylist()


def test_generate_stores_each_samples_root(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared generated cache (multi-turn chat records): every row stores the root that the re-parse
    of the data file (training's way before format 3, the independent reference) gives, and grouping
    reads no data file."""
    assert read_format_version(tiny_cache) == 3
    ids = _sample_ids(tiny_cache)
    data = tiny_cache.parent / "chat.jsonl"
    source = source_name(data)
    records = {c.sample_id: c for c in iter_records(data) if isinstance(c, Conversation)}
    assert any(sum(m.role == "user" for m in records[s].messages) > 1 for s in ids)  # multi-turn
    stored = stored_roots(tiny_cache, ids)
    assert set(stored) == set(ids)
    assert stored == reparsed_roots(tiny_cache, ids, source=source)
    assert stored == {s: records[s].record_id for s in ids}  # records "rec-<i>": their own conversation
    _no_data_file(monkeypatch)
    assert conversation_groups(tiny_cache, ids, source=source) == stored


def test_a_format_2_cache_splits_as_before(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = as_format_2(copy_cache(tiny_cache, tmp_path / "cache-v2"))
    assert read_format_version(old) == 2
    ids = _sample_ids(old)
    roots = read_table(old, "samples", ["conversation_root"]).column("conversation_root").to_pylist()
    assert set(roots) == {None}
    assert stored_roots(old, ids) == {}
    source = source_name(tiny_cache.parent / "chat.jsonl")
    groups_v2 = conversation_groups(old, ids, source=source)
    groups_v3 = conversation_groups(tiny_cache, ids, source=source)
    assert groups_v2 == groups_v3
    snapshot = snapshot_from_columns(sorted(ids), [10] * len(ids), [0] * len(ids))
    split_v2 = split_snapshot(snapshot, fraction=0.3, num_samples=None, groups=groups_v2)
    split_v3 = split_snapshot(snapshot, fraction=0.3, num_samples=None, groups=groups_v3)
    assert split_v2.validation is not None
    assert split_v3.validation is not None
    assert split_v2.validation.sample_ids == split_v3.validation.sample_ids
    _no_data_file(monkeypatch)  # a format-2 cache's roots are in its data file alone
    with pytest.raises(AssertionError, match="the data file was read"):
        conversation_groups(old, ids, source=source)


def test_a_sharegpt_parts_root_is_its_conversation() -> None:
    """What generate stores for ShareGPT's ``X_4``: ``X`` (the sample id and record id differ from it)."""
    conv = Conversation(
        sample_id="sample-1",
        source_index=0,
        record_id="AbCdEfG_4",
        messages=(Message(role="user", content="hi"), Message(role="assistant", content="hello")),
    )
    sample = tokenize_conversation(load_tokenizer("random:tiny"), conv, max_length=64, too_long="skip")
    assert not isinstance(sample, Exception)
    assert getattr(sample, "conversation_root", None) == "AbCdEfG"


@pytest.mark.slow
def test_generate_stores_sharegpt_roots(tmp_path: Path) -> None:
    """End to end on ShareGPT records of conversations split in parts (``X_0``, ``X_4``, …): the stored
    roots are the re-parse's and the ShareGPT rule's, and a format-2 rewrite without its data file cannot
    be grouped, while the format-3 cache can."""
    data = _sharegpt_file(tmp_path / "parts.jsonl", 12)
    cache = tmp_path / "cache"
    run_generate(tiny_config(cache, data))
    source = source_name(data)
    ids = _sample_ids(cache)
    records = [c for c in iter_records(data) if isinstance(c, Conversation)]
    assert len(ids) == len(records)
    stored = stored_roots(cache, ids)
    assert stored == reparsed_roots(cache, ids, source=source)
    assert stored == {c.sample_id: re.sub(r"_\d+$", "", c.record_id) for c in records}
    assert len(set(stored.values())) < len(stored)  # conversations of several samples
    old = as_format_2(copy_cache(cache, tmp_path / "cache-v2"))
    data.rename(data.with_name("moved.jsonl"))
    assert conversation_groups(cache, ids, source=source) == stored
    with pytest.raises(ConfigError, match="root-id needs the record id of every sample"):
        conversation_groups(old, ids, source=source)
