"""``--data`` containers and schemas: the same records in every container give the same items; magic
bytes against suffixes; bad lines (invalid UTF-8, lone surrogates, deep nesting) are failures with their
line while the rest is read; unknown and damaged files are clear errors that say what is accepted."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from dflash_offline.data.conversations import Conversation, Message, SourceFailure
from dflash_offline.data.sources import iter_records, make_sample_id, source_name
from dflash_offline.errors import DataError

from .container_helpers import CONTAINERS, jsonl_bytes, write_container


def chat(i: int) -> dict[str, Any]:
    return {
        "id": f"r{i}",
        "messages": [
            {"role": "user", "content": f"question {i} é 🙂"},
            {"role": "assistant", "content": f"answer {i}\nwith a second line"},
        ],
    }


def key(item: Conversation | SourceFailure) -> tuple[Any, ...]:
    if isinstance(item, Conversation):
        return (item.source_index, item.sample_id, item.record_id, item.messages)
    return (item.source_index, item.sample_id, item.reason)


@pytest.mark.parametrize("kind", CONTAINERS)
def test_every_container_gives_the_items_of_the_plain_jsonl(kind: str, tmp_path: Path) -> None:
    records = [chat(i) for i in range(8)]
    records[2] = {"id": "bad", "messages": [{"role": "wizard", "content": "x"}]}
    records[5] = chat(1)  # a duplicate of record 1
    reference = [key(x) for x in iter_records(write_container(records, "jsonl", tmp_path / "ref"))]
    assert [k[0] for k in reference] == list(range(8))
    assert [k[2] if len(k) == 3 else "ok" for k in reference].count("duplicate_record") == 1
    got = [key(x) for x in iter_records(write_container(records, kind, tmp_path / "x"))]
    assert got == reference
    # The ids hash the source name "d", whatever the container: recompute one independently.
    first = chat(0)["messages"]
    messages = tuple(Message(role=m["role"], content=m["content"]) for m in first)
    assert got[0][1] == make_sample_id("d", "r0", messages)


def test_source_name_drops_container_suffixes(tmp_path: Path) -> None:
    for name in ("d.jsonl", "d.JSONL.GZ", "d.json.zst", "d.parquet", "d.ndjson.zstd"):
        (tmp_path / name).write_text("{}\n")
        assert source_name(tmp_path / name) == "d", name
    (tmp_path / "d").mkdir()
    assert source_name(tmp_path / "d") == "d"
    (tmp_path / "v1.2.jsonl").write_text("{}\n")
    assert source_name(tmp_path / "v1.2.jsonl") == "v1.2"  # only known suffixes go


def test_compression_is_recognised_by_magic_bytes_and_a_lying_suffix_is_refused(tmp_path: Path) -> None:
    records = [chat(i) for i in range(3)]
    hidden = tmp_path / "gz_without_suffix.jsonl"
    hidden.write_bytes(gzip.compress(jsonl_bytes(records)))
    assert [x.source_index for x in iter_records(hidden)] == [0, 1, 2]
    import zstandard

    as_json = tmp_path / "array.json"  # a zstd JSON array named .json
    as_json.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(records).encode()))
    assert all(isinstance(x, Conversation) for x in iter_records(as_json))
    lying = tmp_path / "plain.jsonl.gz"
    lying.write_bytes(jsonl_bytes(records))
    with pytest.raises(DataError, match=r"named like a gzip file .*accepted: "):
        list(iter_records(lying))
    lying_zst = tmp_path / "gzip.jsonl.zst"
    lying_zst.write_bytes(gzip.compress(jsonl_bytes(records)))
    with pytest.raises(DataError, match="named like a zstd file"):
        list(iter_records(lying_zst))


def test_binary_and_unknown_inputs_are_one_clear_error(tmp_path: Path) -> None:
    png = tmp_path / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    with pytest.raises(DataError, match=r"not text .*accepted: a JSON array or JSONL file"):
        list(iter_records(png))
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    (empty_dir / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"no \.parquet file and no datasets save_to_disk"):
        list(iter_records(empty_dir))
    bad_gz = tmp_path / "bad.jsonl.gz"
    bad_gz.write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(DataError, match="cannot decompress"):
        list(iter_records(bad_gz))


def test_a_saved_dataset_dict_is_refused_naming_its_splits(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    root = tmp_path / "dd"
    split = datasets.Dataset.from_list([chat(0)])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(root))
    with pytest.raises(DataError, match=r"DatasetDict: pass one split, e.g. `data` .*train"):
        list(iter_records(root))
    assert [x.source_index for x in iter_records(root / "train")] == [0]


def test_bad_lines_are_failures_with_their_line_and_the_rest_is_read(tmp_path: Path) -> None:
    good = [jsonl_bytes([chat(i)]) for i in range(4)]
    invalid_utf8 = b'{"id": "u", "messages": [{"role": "user", "content": "caf\xe9 \xff"}]}\n'
    surrogate = b'{"id": "s", "messages": [{"role": "user", "content": "x \\ud800 y"}]}\n'
    surrogate_id = b'{"id": "\\udfff", "messages": [{"role": "user", "content": "fine"}]}\n'
    deep = b"[" * 100_000 + b"\n"
    lines = [good[0], invalid_utf8, good[1], surrogate, deep, good[2], surrogate_id, good[3]]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(lines))
    found = list(iter_records(path))
    assert [(x.source_index, type(x).__name__) for x in found] == [
        (0, "Conversation"),
        (1, "SourceFailure"),
        (2, "Conversation"),
        (3, "SourceFailure"),
        (4, "SourceFailure"),
        (5, "Conversation"),
        (6, "SourceFailure"),
        (7, "Conversation"),
    ]
    failures = {x.source_index: x for x in found if isinstance(x, SourceFailure)}
    assert all(f.reason == "malformed_record" for f in failures.values())
    at = invalid_utf8.index(b"\xe9")
    assert failures[1].detail.startswith(f"line 2: invalid UTF-8 at byte {at} ")
    assert failures[3].detail.startswith("line 4: turn 0 (user) content is not valid text")
    assert failures[4].detail.startswith("line 5: invalid JSON: nested too deeply")
    assert failures[6].detail.startswith("line 7: id is not valid text")
    # The same bad line first in a .jsonl file stays one bad line (a '[' does not make it an array).
    first_deep = tmp_path / "deep_first.jsonl"
    first_deep.write_bytes(deep + good[0])
    assert [type(x).__name__ for x in iter_records(first_deep)] == ["SourceFailure", "Conversation"]


def test_invalid_utf8_inside_a_json_array_fails_only_its_element(tmp_path: Path) -> None:
    text = json.dumps([chat(0), {"id": "u", "messages": [{"role": "user", "content": "MARK"}]}, chat(2)])
    path = tmp_path / "d.json"
    path.write_bytes(text.encode().replace(b"MARK", b"caf\xe9"))
    found = list(iter_records(path))
    assert [type(x).__name__ for x in found] == ["Conversation", "SourceFailure", "Conversation"]
    assert "not valid text" in found[1].detail  # type: ignore[union-attr]
    deep = tmp_path / "deep.json"
    deep.write_text("[" + json.dumps(chat(0)) + ", " + "[" * 100_000)
    found = list(iter_records(deep))
    assert [x.source_index for x in found] == [0, 1]
    assert "nested too deeply" in found[1].detail  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst"])
def test_a_cut_compressed_file_keeps_the_records_before_the_cut(kind: str, tmp_path: Path) -> None:
    records = [chat(i) for i in range(4000)]  # ~600 KB: several zstd blocks, several gzip blocks
    path = write_container(records, kind, tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 2 // 3])
    found = list(iter_records(path))
    oks = [x for x in found if isinstance(x, Conversation)]
    assert [x.source_index for x in oks] == list(range(len(oks)))
    assert 500 < len(oks) < 4000
    tail = found[len(oks) :]
    assert len(tail) == 1
    assert tail[0].reason == "truncated_source"  # type: ignore[union-attr]


def test_schemas_map_onto_the_same_conversation(tmp_path: Path) -> None:
    expected = (Message(role="user", content="Add 2 and 2."), Message(role="assistant", content="4"))
    with_input = (Message(role="user", content="Add.\n\n2 and 2"), Message(role="assistant", content="4"))
    records = [
        {"messages": [{"role": "user", "content": "Add 2 and 2."}, {"role": "assistant", "content": "4"}]},
        {"conversations": [{"from": "human", "value": "Add 2 and 2."}, {"from": "gpt", "value": "4"}]},
        {"prompt": "Add 2 and 2.", "response": "4"},
        {"instruction": "Add 2 and 2.", "input": "", "output": "4"},
        {"instruction": "Add 2 and 2.", "output": "4"},
        {"instruction": "Add.", "input": "2 and 2", "output": "4"},
        {"prompt": "Add 2 and 2.", "completion": "4"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(jsonl_bytes([{**r, "id": k} for k, r in enumerate(records)]))
    found = list(iter_records(path))
    assert [getattr(x, "messages", None) for x in found[:6]] == [expected] * 5 + [with_input]
    assert found[6].reason == "malformed_record"  # type: ignore[union-attr]
    assert "'prompt'+'response'" in found[6].detail  # type: ignore[union-attr]
    # Same content, no id: the same sample id whichever schema it came in (duplicates of record 0).
    no_ids = tmp_path / "no_ids.jsonl"
    no_ids.write_bytes(jsonl_bytes(records[:5]))
    reasons = [getattr(x, "reason", "ok") for x in iter_records(no_ids)]
    assert reasons == ["ok"] + ["duplicate_record"] * 4
    # Forcing a schema: the others are failures that name the missing field.
    forced = list(iter_records(path, data_format="alpaca"))
    assert [type(x).__name__ for x in forced] == ["SourceFailure"] * 3 + ["Conversation"] * 3 + [
        "SourceFailure"
    ]
    assert "`data_format` alpaca: the record has no ['instruction', 'output'] field" in forced[0].detail  # type: ignore[union-attr]
    with pytest.raises(DataError, match=r"^`data_format` 'csv': expected one of auto, sharegpt"):
        list(iter_records(path, data_format="csv"))  # type: ignore[arg-type]


def test_parquet_reads_only_the_known_columns_and_names_the_keys_otherwise(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "wide.parquet"
    table = pa.table({"prompt": ["p"], "response": ["r"], "embedding": [[0.5] * 4]})
    pq.write_table(table, path)
    (item,) = iter_records(path)
    assert isinstance(item, Conversation)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["hello"]}), other)
    (failure,) = iter_records(other)
    assert isinstance(failure, SourceFailure)
    assert "keys: ['text']" in failure.detail


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_1gb_zstd_jsonl_streams_in_bounded_memory(tmp_path: Path) -> None:
    """~1 GB of JSONL (compressible: a few MB on disk) read in a fresh process: its peak RSS may grow
    by a small fraction of the data, never by the data itself."""
    import zstandard

    path = tmp_path / "big.jsonl.zst"
    filler = "lorem ipsum dolor sit amet " * 2400  # ~64 KB of content per record
    total = 0
    with open(path, "wb") as raw, zstandard.ZstdCompressor(level=1).stream_writer(raw) as w:
        i = 0
        while total < 1 << 30:
            line = jsonl_bytes([{"id": i, "prompt": f"q{i}", "response": filler}])
            w.write(line)
            total += len(line)
            i += 1
    num_records = i
    script = textwrap.dedent(
        f"""
        import resource, sys
        from dflash_offline.data.sources import iter_records
        from dflash_offline.data.conversations import Conversation
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        n = ok = 0
        for item in iter_records({str(path)!r}):
            n += 1
            ok += isinstance(item, Conversation)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(n, ok, before, after)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=280, env=env, check=True
    )
    n, ok, before_kb, after_kb = (int(x) for x in out.stdout.split())
    assert n == ok == num_records
    growth = (after_kb - before_kb) * 1024
    assert growth < total / 20, f"peak RSS grew by {growth / 2**20:.0f} MiB for {total / 2**20:.0f} MiB"
