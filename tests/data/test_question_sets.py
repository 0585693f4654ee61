"""The question sets' JSONL reader: one record per "\\n"-ended line, whatever the text inside holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_offline.data import question_sets
from dflash_offline.errors import DataError


def write_questions(path: Path, rows: list[dict[str, object]]) -> Path:
    # ensure_ascii=False writes U+2028 and U+0085 raw: valid JSON, and line breaks to str.splitlines.
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_line_separator_inside_a_question_stays_in_that_question(tmp_path, monkeypatch):
    turns = ["first\u2028line two", "next\x85line"]
    path = write_questions(
        tmp_path / "question.jsonl",
        [{"question_id": 81, "category": "writing", "turns": turns}, {"question_id": 82, "turns": ["b"]}],
    )
    monkeypatch.setattr(question_sets, "package_file", lambda *a: path)
    questions = question_sets.read_mt_bench()
    assert [q.question_id for q in questions] == ["81", "82"]
    assert questions[0].texts == tuple(turns)


def test_a_broken_line_is_named_by_its_number(tmp_path, monkeypatch):
    path = tmp_path / "question.jsonl"
    broken = '{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": ["b"\n'
    path.write_text(broken, encoding="utf-8")
    monkeypatch.setattr(question_sets, "package_file", lambda *a: path)
    with pytest.raises(DataError, match=r"question\.jsonl:2: not JSON"):
        question_sets.read_mt_bench()
