"""An output begun before source names dropped container suffixes (``source`` = ``chat.jsonl``) resumes
under that name: no record answered twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_offline.data import sources as sources_module
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.run import run_regenerate
from tests.eval.helpers import one_thread, write_chat_jsonl


def test_an_old_output_resumes_under_its_source_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6)
    out = tmp_path / "regen.jsonl"

    def config(**kw: object) -> RegenerateConfig:
        return RegenerateConfig(
            out=out,
            data=str(data),
            target="random:tiny",
            max_new_tokens=4,
            batch_size=3,
            progress=False,
            **kw,
        )  # type: ignore[arg-type]

    with one_thread():
        with monkeypatch.context() as m:  # what the older code wrote
            m.setattr(sources_module, "source_name_for_cache", lambda data, recorded: "chat.jsonl")
            assert run_regenerate(config(limit=3)).written == 3
        second = run_regenerate(config())
    assert (second.written, second.skipped) == (3, 3)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["source_index"] for line in lines) == list(range(6))
    assert {line["source"] for line in lines} == {"chat.jsonl"}
    assert len({line["source_sample_id"] for line in lines}) == 6
