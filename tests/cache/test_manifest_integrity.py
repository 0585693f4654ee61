"""A manifest part carries the sha256 of its bytes in its name: a flipped byte is damage that verify
lists and every reader refuses, never a silently changed index."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_offline.cache.fingerprint import CACHE_FORMAT_VERSION
from dflash_offline.cache.index import build_index
from dflash_offline.cache.layout import CacheLayout, read_format_version
from dflash_offline.cache.manifest import read_runs, read_table, record_run
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import RunRow
from dflash_offline.cache.status import cache_status
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cli import main
from dflash_offline.errors import CacheDamageError
from tests.cache._samples import TINY, make_fingerprint, make_samples

GOLDEN_V1 = Path(__file__).resolve().parents[1] / "assets" / "golden_cache" / "v1"


def _write(root: Path, n: int = 40) -> None:
    fingerprint = make_fingerprint(codec="none")
    with ShardWriter(root, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for k, sample in enumerate(make_samples(fingerprint, range(n))):
            writer.add(sample)
            if k == n // 2:
                writer.flush()  # two samples parts


def _silent_flip(part: Path, column: str, *, duplicate_ids: bool = False) -> bytes:
    """The part's bytes with one bit flipped inside ``column``'s pages such that pyarrow still reads
    the part, with a different ``column`` (and, with ``duplicate_ids``, one sample id equal to another):
    the damage a reader without a digest takes for data."""
    data = part.read_bytes()
    original = pq.read_table(part)
    meta = pq.ParquetFile(part).metadata.row_group(0).column(original.schema.get_field_index(column))
    start = meta.dictionary_page_offset or meta.data_page_offset
    for offset in range(start, start + meta.total_compressed_size):
        for bit in (0x01, 0x10):
            flipped = bytearray(data)
            flipped[offset] ^= bit
            try:
                table = pq.read_table(pa.BufferReader(bytes(flipped)))
            except (OSError, pa.ArrowException):
                continue
            if table.column(column) == original.column(column):
                continue
            ids = table.column("sample_id").to_pylist()
            if not duplicate_ids or len(set(ids)) < len(ids):
                return bytes(flipped)
    raise AssertionError(f"no silent flip found in {column}")


@pytest.mark.parametrize(
    "where",
    ["num_loss_tokens page", "sample_id page (one id becomes another)", "footer"],
)
def test_a_flipped_byte_in_a_part_is_damage_that_every_reader_refuses(tmp_path: Path, where: str) -> None:
    _write(tmp_path)
    build_index(tmp_path)
    part = CacheLayout.at(tmp_path).parts("samples")[0]
    other_rows = read_table(tmp_path, "samples").num_rows - pq.read_metadata(part).num_rows
    if where == "footer":
        data = bytearray(part.read_bytes())
        data[-30] ^= 0x01
        part.write_bytes(bytes(data))
    else:
        column = where.split()[0]
        part.write_bytes(_silent_flip(part, column, duplicate_ids=column == "sample_id"))

    report = verify_cache(tmp_path, progress=False)
    assert not report.ok
    assert [d.path for d in report.damaged_parts] == [part]
    assert report.duplicates == ()  # the damaged part's rows are left out, not taken for a second commit
    assert report.samples_checked == other_rows
    assert f"damaged manifest part {part.relative_to(tmp_path)}" in report.render()

    with pytest.raises(CacheDamageError, match=f"manifest part {part} is damaged"):
        CacheReader.open(tmp_path)  # what train and its prefetch read through
    with pytest.raises(CacheDamageError, match=f"manifest part {part} is damaged"):
        cache_status(tmp_path)
    runner = CliRunner()
    for args in (
        ["status", str(tmp_path)],
        ["index", str(tmp_path)],
        ["sql", str(tmp_path), "--source", "manifest", "--query", "buckets"],
        ["sql", str(tmp_path), "--query", "buckets"],  # the old index is stale now: not used
        ["train", "--cache", str(tmp_path), "--out", str(tmp_path.parent / "run"), "--max-steps", "1"],
    ):
        result = runner.invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert result.output.startswith(f"Error: manifest part {part} is damaged"), (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    result = runner.invoke(main, ["verify", str(tmp_path), "--no-progress"])
    assert result.exit_code == 1
    assert "dflash verify --repair --dry-run" in result.output


def test_repair_moves_a_damaged_part_aside_and_keeps_its_shard_bytes(tmp_path: Path) -> None:
    _write(tmp_path)
    layout = CacheLayout.at(tmp_path)
    part = layout.parts("samples")[0]
    lost = pq.read_table(part).num_rows
    part.write_bytes(_silent_flip(part, "num_loss_tokens"))
    shard_bytes = {p: p.read_bytes() for p in layout.shards_dir.rglob("*") if p.is_file()}
    runner = CliRunner()

    result = runner.invoke(main, ["verify", str(tmp_path), "--repair", "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "move 1 damaged manifest parts" in result.output
    assert (
        f"samples: {40 - lost} committed now (+ {lost} in damaged parts), {40 - lost} after" in result.output
    )
    assert "nothing changed" in result.output
    assert part.is_file()

    result = runner.invoke(main, ["verify", str(tmp_path), "--repair", "--yes", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert not part.exists()
    assert (layout.damaged_dir / "samples" / part.name).is_file()  # kept, for inspection
    for path, data in shard_bytes.items():  # nothing of the shard was deleted
        assert path.read_bytes() == data
    assert len(read_table(tmp_path, "samples")) == 40 - lost
    again = runner.invoke(main, ["verify", str(tmp_path), "--repair", "--dry-run", "--no-progress"])
    assert again.exit_code == 0, again.output
    assert "keep the unreferenced files of" in again.output  # still guarded by the part moved aside


def test_runs_are_revisions_checked_like_every_part(tmp_path: Path) -> None:
    _write(tmp_path, n=4)
    running = RunRow(
        run_id="generate-x",
        command="generate",
        started_at=dt.datetime(2025, 1, 2, tzinfo=dt.UTC),
        finished_at=None,
        status="running",
        num_workers=1,
        samples_committed=0,
        tokens_committed=0,
        bytes_written=0,
        failures=0,
        fingerprint_json="{}",
        host="test",
    )
    record_run(tmp_path, running)
    finished = dataclasses.replace(running, status="finished", samples_committed=4)
    record_run(tmp_path, finished)
    assert read_runs(tmp_path) == [finished]  # the newest revision counts
    parts = CacheLayout.at(tmp_path).parts("runs")
    assert len(parts) == 2
    parts[-1].write_bytes(parts[-1].read_bytes()[:-1] + b"\0")
    with pytest.raises(CacheDamageError, match=f"manifest part {parts[-1]} is damaged"):
        read_runs(tmp_path)
    assert [d.path for d in verify_cache(tmp_path, progress=False).damaged_parts] == [parts[-1]]


def test_format_1_cache_reads_with_a_note_and_stays_format_1(tmp_path: Path) -> None:
    assert CACHE_FORMAT_VERSION == 3  # format 3: rows store their conversation root
    root = tmp_path / "v1"
    shutil.copytree(GOLDEN_V1, root)
    assert read_format_version(root) == 1
    status = cache_status(root)
    assert "format v1: its manifest parts carry no sha256" in status.render()
    report = verify_cache(root, progress=False)
    assert report.ok
    assert "format 1 cache" in report.render()
    doc = json.loads((root / "cache.json").read_text())
    assert doc["format_version"] == 1
