"""Data sources: both record formats in JSONL and JSON arrays, malformed and truncated input,
skip/limit, duplicates, stable sample ids, and the embedded ShareGPT file streamed in bounded memory."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest

from dflash_offline.data import jsonstream
from dflash_offline.data.conversations import Conversation, Message, SourceFailure
from dflash_offline.data.sources import (
    DEFAULT_SOURCE_NAME,
    default_data_path,
    iter_records,
    make_sample_id,
    source_name,
)
from dflash_offline.errors import DataError

SHAREGPT = {
    "id": "a1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
    ],
}
CHAT = {
    "id": 7,
    "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "."}]},
    ],
}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def items(path: Path, **kw: int | None) -> list[Conversation | SourceFailure]:
    return list(iter_records(path, **kw))  # type: ignore[arg-type]


def summary(found: list[Conversation | SourceFailure]) -> list[tuple[int, str]]:
    return [(x.source_index, "ok" if isinstance(x, Conversation) else x.reason) for x in found]


def test_both_formats_in_jsonl_map_roles_and_ids(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(SHAREGPT), "", json.dumps(CHAT)])
    first, second = items(path)
    assert isinstance(first, Conversation)
    assert isinstance(second, Conversation)
    assert first.messages == (
        Message(role="system", content="Be brief."),
        Message(role="user", content="Hi"),
        Message(role="assistant", content="Hello!"),
    )
    assert (first.source_index, first.record_id) == (0, "a1")
    # Blank lines are not records: the next record has index 1; an int id becomes its string.
    assert (second.source_index, second.record_id) == (1, "7")
    assert second.messages[1] == Message(role="assistant", content="4.")
    assert first.sample_id == make_sample_id("d", "a1", first.messages)  # the name without its suffixes


def test_token_ids_beside_a_message_are_read_and_leave_the_sample_id_alone(tmp_path: Path) -> None:
    with_ids = json.loads(json.dumps(CHAT))
    with_ids["messages"][1]["token_ids"] = [19, 30]
    bad = [json.loads(json.dumps(CHAT)) for _ in range(3)]
    for record, value in zip(bad, ([1, -2], "19 30", [1, True]), strict=True):
        record["messages"][1]["token_ids"] = value
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (plain,) = items(write_jsonl(tmp_path / "a" / "d.jsonl", [json.dumps(CHAT)]))
    path = write_jsonl(tmp_path / "b" / "d.jsonl", [json.dumps(r) for r in (with_ids, *bad)])
    carried, *failed = items(path)
    assert isinstance(plain, Conversation)
    assert isinstance(carried, Conversation)
    assert carried.messages[1] == Message(role="assistant", content="4.", token_ids=(19, 30))
    assert plain.messages[1].token_ids is None
    assert carried.sample_id == plain.sample_id  # the same record with and without ids
    assert all(isinstance(f, SourceFailure) for f in failed)
    assert [(f.reason, "messages[1].token_ids" in f.detail) for f in failed] == [  # type: ignore[union-attr]
        ("malformed_record", True)
    ] * 3


def test_json_array_gives_the_same_conversations_as_jsonl(tmp_path: Path) -> None:
    records = [SHAREGPT, CHAT, {**SHAREGPT, "id": "a2"}]
    (tmp_path / "d.json").write_text(json.dumps(records, indent=2), encoding="utf-8")
    write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in records])
    from_array = items(tmp_path / "d.json")
    from_lines = items(tmp_path / "d.jsonl")
    assert summary(from_array) == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert [c.messages for c in from_array] == [c.messages for c in from_lines]  # type: ignore[union-attr]


def test_malformed_jsonl_lines_are_reported_and_the_rest_is_read(tmp_path: Path) -> None:
    lines = [
        json.dumps(SHAREGPT),
        '{"conversations": [ {"from": "human", "value": "cut',  # bad JSON mid-file
        json.dumps([1, 2]),  # not an object
        json.dumps({"id": "x", "text": "hello"}),  # neither conversations nor messages
        json.dumps({"conversations": [{"from": "human"}]}),  # missing value
        json.dumps({"messages": [{"role": "user", "content": 3}]}),  # content not a string
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "a"}]}),
        json.dumps({"messages": [{"role": "tool", "content": "x"}]}),
        json.dumps({"conversations": []}),
        json.dumps({"conversations": "not a list"}),
        json.dumps(CHAT),
    ]
    found = items(write_jsonl(tmp_path / "bad.jsonl", lines))
    assert summary(found) == [
        (0, "ok"),
        (1, "malformed_record"),
        (2, "malformed_record"),
        (3, "malformed_record"),
        (4, "malformed_record"),
        (5, "malformed_record"),
        (6, "unknown_role"),
        (7, "unknown_role"),
        (8, "empty_conversation"),
        (9, "malformed_record"),
        (10, "ok"),
    ]
    failures = [x for x in found if isinstance(x, SourceFailure)]
    for failure in failures:  # each detail names the file line (1-based) of its record
        assert failure.detail.startswith(f"line {failure.source_index + 1}:"), failure.detail
        assert failure.sample_id == f"bad#{failure.source_index}"
    assert "'bing'" in failures[5].detail
    assert "conversations[1].from" in failures[5].detail


def test_truncated_last_jsonl_line_is_truncated_source(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(CHAT)[:20], encoding="utf-8")
    assert summary(items(path)) == [(0, "ok"), (1, "truncated_source")]


def array_text(records: list[object]) -> str:
    return json.dumps(records, indent=2, ensure_ascii=False)


def test_every_cut_of_a_json_array_yields_exactly_the_complete_elements(tmp_path: Path) -> None:
    """Cut the file at every character: the complete elements before the cut come back intact, and
    a partly present element is reported as truncated_source (never dropped, never invented)."""
    records = [SHAREGPT, CHAT, {"id": "u", "messages": [{"role": "user", "content": 'é 🙂 \\" ]'}]}]
    text = array_text(records)
    element_ends = []  # character offset just past each complete element
    for k in range(1, len(records) + 1):
        prefix = array_text(records[:k])[:-2]  # drop the closing "\n]"
        element_ends.append(len(prefix))
    path = tmp_path / "cut.json"
    for cut in range(text.index("[") + 1, len(text) + 1):
        path.write_text(text[:cut], encoding="utf-8")
        found = items(path)
        complete = sum(1 for end in element_ends if end <= cut)
        oks = [x for x in found if isinstance(x, Conversation)]
        assert [c.source_index for c in oks] == list(range(complete)), cut
        tail = [x for x in found if isinstance(x, SourceFailure)]
        start = element_ends[complete - 1] if complete else text.index("[") + 1
        rest = text[start:cut].strip()
        rest = rest.removeprefix(",").strip() if complete else rest
        if rest not in ("", "]"):  # part of the next element is in the file
            assert [(f.source_index, f.reason) for f in tail] == [(complete, "truncated_source")], cut
        else:
            assert tail == [], cut


def test_small_buffers_give_the_same_records_and_line_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny read chunks force buffer growth and compaction inside multi-byte text and big elements."""
    big = {"id": "big", "messages": [{"role": "user", "content": "ü" * 500 + "\n"}]}
    records = [SHAREGPT, big, CHAT, {"id": 3}, SHAREGPT]
    path = tmp_path / "d.json"
    path.write_text(array_text(records), encoding="utf-8")
    expected = items(path)
    monkeypatch.setattr(jsonstream, "_CHUNK_CHARS", 7)
    assert items(path) == expected
    assert summary(expected) == [
        (0, "ok"),
        (1, "ok"),
        (2, "ok"),
        (3, "malformed_record"),
        (4, "duplicate_record"),
    ]
    starts = [i + 1 for i, line in enumerate(array_text(records).splitlines()) if line == "  {"]
    assert expected[3].detail.startswith(f"element 3 (line {starts[3]}):")  # type: ignore[union-attr]


def test_syntax_error_inside_a_json_array_stops_with_a_malformed_record(tmp_path: Path) -> None:
    text = array_text([SHAREGPT, CHAT, SHAREGPT]).replace('"2+2?"', '"2+2?" oops', 1)
    path = tmp_path / "d.json"
    path.write_text(text, encoding="utf-8")
    found = items(path)
    assert summary(found) == [(0, "ok"), (1, "malformed_record")]
    assert "cannot be read" in found[1].detail  # type: ignore[union-attr]


def test_skip_and_limit_select_source_positions(tmp_path: Path) -> None:
    lines = [json.dumps({**CHAT, "id": i}) for i in range(6)]
    lines[2] = "not json"
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    assert summary(items(path, skip=1, limit=3)) == [(1, "ok"), (2, "malformed_record"), (3, "ok")]
    assert summary(items(path, skip=4)) == [(4, "ok"), (5, "ok")]
    assert items(path, limit=0) == []
    assert items(path, skip=10) == []
    with pytest.raises(DataError, match=r"^`skip` must be >= 0, got -1$"):
        items(path, skip=-1)
    with pytest.raises(DataError, match=r"^`limit` must be >= 0, got -2$"):
        items(path, limit=-2)


def test_duplicates_are_reported_even_when_the_original_is_skipped(tmp_path: Path) -> None:
    same_content_other_id = {**SHAREGPT, "id": "other"}
    lines = [json.dumps(x) for x in (SHAREGPT, CHAT, SHAREGPT, same_content_other_id, SHAREGPT)]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    found = items(path)
    assert summary(found) == [
        (0, "ok"),
        (1, "ok"),
        (2, "duplicate_record"),
        (3, "ok"),
        (4, "duplicate_record"),
    ]
    assert found[2].sample_id == found[0].sample_id
    assert "record 0" in found[2].detail  # type: ignore[union-attr]
    # The verdict does not depend on --skip: record 2 is still a duplicate of the skipped record 0.
    assert summary(items(path, skip=2)) == [(2, "duplicate_record"), (3, "ok"), (4, "duplicate_record")]


def test_sample_ids_are_stable_and_depend_on_source_id_and_content() -> None:
    messages = (Message(role="user", content="Hi"), Message(role="assistant", content="Hello! 🙂"))
    sid = make_sample_id("sharegpt-default", "abc_0", messages)
    # The documented recipe, spelled out independently; the golden value pins it: a change here
    # breaks resume of every existing cache.
    canonical = '[["user","Hi"],["assistant","Hello! 🙂"]]'
    recipe = hashlib.sha256(f"sharegpt-default\0abc_0\0{canonical}".encode()).hexdigest()[:16]
    assert sid == recipe == "2ead03cd14f06f6d"
    assert make_sample_id("other.jsonl", "abc_0", messages) != sid
    assert make_sample_id("sharegpt-default", "abc_1", messages) != sid
    changed = (messages[0], Message(role="assistant", content="Hello!"))
    assert make_sample_id("sharegpt-default", "abc_0", changed) != sid
    swapped = (Message(role="assistant", content="Hi"), Message(role="user", content="Hello! 🙂"))
    assert make_sample_id("sharegpt-default", "abc_0", swapped) != sid


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        items(tmp_path / "missing.jsonl")
    (tmp_path / "empty.json").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        items(tmp_path / "empty.json")
    (tmp_path / "obj.json").write_text(json.dumps({"data": [SHAREGPT]}, indent=2))
    with pytest.raises(DataError, match="pretty-printed JSON object"):
        items(tmp_path / "obj.json")


def test_default_source_is_the_embedded_sharegpt_file() -> None:
    path = default_data_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert path.is_file()
    assert source_name(None) == source_name("default") == source_name(path) == DEFAULT_SOURCE_NAME
    first = items(None, limit=2)  # type: ignore[arg-type]
    assert summary(first) == [(0, "ok"), (1, "ok")]
    assert first[0].record_id == "QWJhYvA_0"  # type: ignore[union-attr]
    assert first[0].messages[0].role == "user"  # type: ignore[union-attr]


def test_whole_default_file_streams_in_bounded_memory_and_reports_its_cut_tail() -> None:
    tracemalloc.start()
    try:
        last = None
        counts: dict[str, int] = {}
        for item in iter_records(None):
            key = "ok" if isinstance(item, Conversation) else item.reason
            counts[key] = counts.get(key, 0) + 1
            last = item
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The file is 125 MB; holding its records would take several hundred MB of Python objects.
    assert peak < 64 * 2**20, peak
    assert isinstance(last, SourceFailure)
    assert last.reason == "truncated_source"
    assert last.source_index == sum(counts.values()) - 1
    assert counts["truncated_source"] == 1
    assert counts["ok"] > 17_000
    # The V3 file's known oddities: empty conversations and a few bing/chatgpt/bard turns.
    assert counts["empty_conversation"] > 0
    assert counts["unknown_role"] > 0
