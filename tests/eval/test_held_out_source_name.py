"""Held-out prompts against a training cache written before source names dropped container suffixes:
its ids hash the full file name (``chat.jsonl``), and eval must still recognise its samples."""

from __future__ import annotations

from pathlib import Path

from dflash_offline.data.records import Conversation
from dflash_offline.data.sources import iter_records
from dflash_offline.eval.prompts import resolve_held_out, select_prompts
from dflash_offline.target.loader import load_tokenizer
from tests.eval.helpers import write_chat_jsonl, write_tiny_cache


def test_an_old_cache_keeps_its_prompts_held_out(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6)
    legacy = [c for c in iter_records(data, source="chat.jsonl") if isinstance(c, Conversation)]
    current = [c for c in iter_records(data) if isinstance(c, Conversation)]
    assert {c.sample_id for c in legacy}.isdisjoint(c.sample_id for c in current)
    trained = [legacy[i].sample_id for i in (0, 1, 4)]
    cache = write_tiny_cache(tmp_path / "cache", trained, data_source="chat.jsonl")
    held = resolve_held_out(exclude_cache=cache, drafter_dir=tmp_path, data=data)
    assert held.excluded_ids == set(trained)
    assert "held out by source" not in held.note
    selection = select_prompts(data, load_tokenizer("random:tiny"), held_out=held, limit=6)
    assert [p.source_index for p in selection.prompts] == [2, 3, 5]
    assert selection.excluded == 3
