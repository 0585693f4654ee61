"""The golden cache of each format (tests/assets/golden_cache/v<format>) is read by the current code."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_offline.cache.index import build_index
from dflash_offline.cache.layout import read_fingerprint
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.sql import SqlConfig, run_sql
from dflash_offline.cache.verify import verify_cache
from tests.cache._samples import bits

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden_cache"


def _generator():
    spec = importlib.util.spec_from_file_location("make_golden_cache", GOLDEN / "make_golden_cache.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERSIONS = ("v1", "v2", "v3")


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_reads_bit_exactly(version):
    gen = _generator()
    root = GOLDEN / version
    assert read_fingerprint(root).to_dict() == gen.fingerprint_dict()
    with CacheReader.open(root, check_checksums=True) as reader:
        assert len(reader.samples) == gen.NUM_SAMPLES
        ids = [f"golden-{k:03d}" for k in reversed(range(gen.NUM_SAMPLES))]
        for got in reader.read(ids):
            want = gen.golden_sample(int(got.sample_id.split("-")[1]))
            assert got.sample_id == want["sample_id"]
            np.testing.assert_array_equal(bits(got.features_TF), want["features_bits"])
            np.testing.assert_array_equal(got.input_ids_T.numpy(), want["input_ids"])
            np.testing.assert_array_equal(got.loss_mask_T.numpy(), want["loss_mask"])
            assert got.bucket_id == want["bucket_id"]
        # The special bf16 patterns (NaN payloads, ±inf, -0, subnormals) survived.
        first = reader.read(["golden-000"])[0]
        assert bits(first.features_TF)[0, : len(gen.SPECIAL_BITS)].tolist() == list(gen.SPECIAL_BITS)


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_verifies_and_indexes(tmp_path, version):
    root = GOLDEN / version
    report = verify_cache(root, progress=False)
    assert report.ok
    assert report.samples_checked == 24
    assert report.unreferenced == ()
    result = run_sql(SqlConfig(root=root, sql=None, query_name="failures", source="manifest"))
    assert result.rows[0][:2] == ("too_long", 2)
    copy = tmp_path / "golden"
    shutil.copytree(root, copy)  # never write into tests/assets
    stats = build_index(copy)
    assert (stats.samples, stats.failures, stats.shards, stats.runs) == (24, 2, 2, 1)


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_conversation_roots(tmp_path, version):
    """Format 3 stores each sample's conversation root in its row (3 samples a conversation in the golden
    cache); the rows of formats 1 and 2 have none, read as null by the manifest and by the index."""
    gen = _generator()
    root = GOLDEN / version
    rows = read_table(root, "samples", ["sample_id", "conversation_root"]).to_pylist()
    assert len(rows) == gen.NUM_SAMPLES
    for row in rows:
        k = int(row["sample_id"].split("-")[1])
        want = f"golden-conversation-{k // 3}" if version == "v3" else None
        assert row["conversation_root"] == want
    copy = tmp_path / "golden"
    shutil.copytree(root, copy)
    build_index(copy)
    result = run_sql(
        SqlConfig(
            root=copy,
            sql="SELECT count(DISTINCT conversation_root), count(conversation_root) FROM samples",
            query_name=None,
            source="index",
        )
    )
    assert result.rows[0] == ((8, 24) if version == "v3" else (0, 0))
