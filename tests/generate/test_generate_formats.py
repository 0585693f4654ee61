"""generate from every ``--data`` container gives the same cache (same sample ids, same bytes), and bad
lines are failure rows with their line number while the good rows commit; a file with no usable record
is refused before a cache directory exists."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.errors import DataError
from dflash_offline.generate.run import run_generate

from ..data.container_helpers import CONTAINERS, jsonl_bytes, write_container
from .helpers import tiny_config


def _records(n: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(3)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()  # noqa: SIM905
    return [
        {
            "id": f"rec-{i}",
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(2, 20))))},
                {"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(2, 60))))},
            ],
        }
        for i in range(n)
    ]


def _contents(root: Path) -> dict[str, tuple[int, bytes, bytes, bytes]]:
    """sample id -> (source_index, input ids, loss mask, feature bits) of every committed sample."""
    samples = read_table(root, "samples").to_pylist()
    index_of = {row["sample_id"]: row["source_index"] for row in samples}
    reader = CacheReader.open(root)
    try:
        return {
            s.sample_id: (
                index_of[s.sample_id],
                s.input_ids_T.numpy().tobytes(),
                s.loss_mask_T.numpy().tobytes(),
                s.features_TF.contiguous().view(torch.int16).numpy().tobytes(),  # the stored bf16 bits
            )
            for s in reader.read(list(index_of))
        }
    finally:
        reader.close()


# generate reads its records through data/sources.py alone (iter_records, first_usable_record, source_name),
# and tests/data/test_containers.py proves that every container gives the plain JSONL's items there (source
# index, sample id, record id, messages, failures). The caches are generated from one container of each
# reader: a compressed JSONL stream (.gz decodes as .zst does, into the same parser), Parquet files (the
# directory of several, read as the single file is) and a saved dataset; each run costs a worker's start-up.
GENERATED = ("jsonl", "jsonl.zst", "parquet-dir", "save_to_disk")


@pytest.mark.slow  # four generate runs, a worker process each: ~30 s on 2 loaded cores
@pytest.mark.timeout(600)
def test_every_container_gives_the_same_cache(tmp_path: Path) -> None:
    assert set(GENERATED) <= set(CONTAINERS)
    records = _records(24)
    records[5] = {"id": "bad", "messages": [{"role": "wizard", "content": "?"}]}
    caches: dict[str, Path] = {}
    for kind in GENERATED:
        data = write_container(records, kind, tmp_path / "data" / kind.replace(".", "_"))
        caches[kind] = tmp_path / "caches" / kind.replace(".", "_")
        summary = run_generate(tiny_config(caches[kind], data))
        assert summary.status == "finished"
        assert summary.samples_committed == 23
    reference = _contents(caches["jsonl"])
    assert len(reference) == 23
    assert sorted(v[0] for v in reference.values()) == [i for i in range(24) if i != 5]
    ref_failures = read_table(caches["jsonl"], "failures").to_pylist()
    assert [(f["source_index"], f["reason"]) for f in ref_failures] == [(5, "unknown_role")]
    for kind, root in caches.items():
        assert _contents(root) == reference, kind  # same ids, positions, tokens, masks, feature bits
        failures = read_table(root, "failures").to_pylist()
        assert [(f["sample_id"], f["source_index"]) for f in failures] == [
            (f["sample_id"], f["source_index"]) for f in ref_failures
        ], kind
        assert CacheReader.open(root).fingerprint.data_source == "d"


def test_bad_lines_are_failure_rows_with_their_line_and_the_good_rows_commit(tmp_path: Path) -> None:
    good = _records(4)
    lines = [
        jsonl_bytes([good[0]]),
        b'{"id": "u", "messages": [{"role": "user", "content": "caf\xe9"}]}\n',  # invalid UTF-8
        jsonl_bytes([good[1]]),
        b'{"id": "s", "messages": [{"role": "user", "content": "\\ud800"}]}\n',  # lone surrogate
        b"[" * 100_000 + b"\n",  # deeper than Python's JSON parser goes
        jsonl_bytes([good[2]]),
        b"\x00\x01binary\xfe\xff\n",
        jsonl_bytes([good[3]]),
    ]
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"".join(lines))
    summary = run_generate(tiny_config(tmp_path / "cache", data))
    assert summary.samples_committed == 4
    samples = read_table(tmp_path / "cache", "samples").to_pylist()
    assert sorted(row["source_index"] for row in samples) == [0, 2, 5, 7]
    failures = {row["source_index"]: row for row in read_table(tmp_path / "cache", "failures").to_pylist()}
    assert sorted(failures) == [1, 3, 4, 6]
    for index, row in failures.items():
        assert row["reason"] == "malformed_record"
        assert row["detail"].startswith(f"line {index + 1}: "), row["detail"]
    assert "invalid UTF-8" in failures[1]["detail"]
    assert "not valid text" in failures[3]["detail"]
    assert "nested too deeply" in failures[4]["detail"]


@pytest.mark.parametrize("content", ["binary", "all_bad", "wrong_schema"])
def test_a_file_without_a_usable_record_is_refused_and_creates_no_cache(content: str, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    if content == "binary":
        data.write_bytes(bytes(range(256)) * 64)
    elif content == "all_bad":
        data.write_bytes(b"\xff\xfe not utf-8\n" + b"[" * 100_000 + b"\n")
    else:
        data.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(5)))
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="accepted: a JSON array or JSONL file"):
        run_generate(tiny_config(cache, data))
    assert not cache.exists()
