"""``dflash verify --repair`` prints its plan and changes nothing without ``--yes``; damaged shard-group
metadata is rebuilt, never turned into dropped samples; only samples whose bytes fail are dropped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.shard_file import ShardFile
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.cache.zarr_format import parse_array_format
from dflash_offline.cli import main
from tests.cache._samples import TINY, bits, make_fingerprint, make_samples

N = 40


def _write(root: Path, codec: str) -> str:
    fingerprint = make_fingerprint(codec=codec)
    with ShardWriter(root, fingerprint, worker=0, flush_seconds=1e9, **TINY) as writer:
        for sample in make_samples(fingerprint, range(N)):
            writer.add(sample)
    return writer.shard


def _contents(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """sample_id -> (feature bits, input_ids, loss_mask), every committed sample."""
    with CacheReader.open(root, check_checksums=True) as reader:
        return {
            s.sample_id: (bits(s.features_TF), s.input_ids_T.numpy(), s.loss_mask_T.numpy())
            for s in reader.read(list(reader.samples.sample_id))
        }


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock"
    }


def _verify(root: Path, *args: str):
    return CliRunner().invoke(main, ["verify", str(root), "--no-progress", *args])


def _break_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:72])  # what a torn write leaves: 72 bytes of JSON, cut off


def _break_altered(path: Path) -> None:
    meta = json.loads(path.read_text())  # still valid JSON, with a wrong inner chunk shape
    meta["codecs"][0]["configuration"]["chunk_shape"][0] //= 2
    path.write_text(json.dumps(meta, indent=2) + "\n")


@pytest.mark.parametrize("damage", [_break_truncated, _break_altered], ids=["truncated", "altered"])
def test_broken_features_zarr_json_is_rebuilt_and_every_sample_kept(tmp_path: Path, damage) -> None:
    shard = _write(tmp_path, "blosc-zstd-1-shuffle")
    before = _contents(tmp_path)
    meta_file = CacheLayout.at(tmp_path).shard_group(shard) / "features" / "zarr.json"
    original = meta_file.read_bytes()
    damage(meta_file)

    result = _verify(tmp_path)
    assert result.exit_code == 1
    assert f"damaged metadata shards/{shard}.zarr/features/zarr.json" in result.output
    assert "(rebuildable)" in result.output
    assert "dflash verify --repair --dry-run" in result.output

    damaged_tree = _tree(tmp_path)
    for args in (["--repair", "--dry-run"], ["--repair"]):
        result = _verify(tmp_path, *args)
        assert result.exit_code == (0 if "--dry-run" in args else 1), result.output
        assert "rebuild 1 damaged zarr.json files" in result.output
        assert f"samples: {N} committed now, {N} after" in result.output
        assert "drop" not in result.output
        assert _tree(tmp_path) == damaged_tree  # a plan changes nothing

    result = _verify(tmp_path, "--repair", "--yes")
    assert result.exit_code == 0, result.output
    assert "0 damaged samples" in result.output
    assert "rebuilt 1 zarr.json" in result.output
    assert meta_file.read_bytes() == original  # the writer's metadata, byte for byte
    after = _contents(tmp_path)
    assert set(after) == set(before)
    for sample_id, arrays in before.items():
        for got, want in zip(after[sample_id], arrays, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_damaged_chunk_drops_only_the_samples_in_it(tmp_path: Path) -> None:
    shard = _write(tmp_path, "none")
    before = _contents(tmp_path)
    group = CacheLayout.at(tmp_path).shard_group(shard)
    fmt = parse_array_format(group / "features", "features")
    shard_file = ShardFile(fmt, 1)
    chunk = 2
    lo = fmt.shard_rows + chunk * fmt.chunk_rows  # the chunk's first row in the group
    data = bytearray(shard_file.path.read_bytes())
    data[int(shard_file.offsets[chunk]) + 7] ^= 0x10
    shard_file.path.write_bytes(bytes(data))
    with CacheReader.open(tmp_path) as reader:
        t = reader.samples
        hit = (t.row_start < lo + fmt.chunk_rows) & (t.row_start + t.num_tokens > lo)
        in_chunk = set(t.sample_id[hit].tolist())
    assert 0 < len(in_chunk) < N

    result = _verify(tmp_path, "--repair", "--dry-run")
    assert result.exit_code == 0
    assert f"drop {len(in_chunk)} damaged samples" in result.output
    assert f"samples: {N} committed now, {N - len(in_chunk)} after" in result.output
    result = _verify(tmp_path, "--repair", "--yes")
    assert result.exit_code == 0, result.output
    after = _contents(tmp_path)
    assert set(after) == set(before) - in_chunk
    for sample_id, arrays in after.items():
        for got, want in zip(arrays, before[sample_id], strict=True):
            np.testing.assert_array_equal(got, want)
    assert verify_cache(tmp_path, progress=False).ok


def test_yes_and_dry_run_are_used_with_repair(tmp_path: Path) -> None:
    _write(tmp_path, "none")
    assert _verify(tmp_path, "--yes").exit_code == 2
    assert _verify(tmp_path, "--repair", "--yes", "--dry-run").exit_code == 2
    result = _verify(tmp_path, "--repair")
    assert result.exit_code == 0
    assert "nothing to repair" in result.output
    assert "OK" in result.output  # and then verified
