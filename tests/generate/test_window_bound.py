"""``dflash generate --window-limit``: the planner waits while the disk window is full and goes on as
stores are retired; the window never exceeds its bound (the bytes on disk by less than one store);
validation samples land in stores that are never retired; every sample equals a plain generate's
(docs/follow.md)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_offline.cache.layout import CacheLayout, read_fingerprint
from dflash_offline.cache.manifest import read_table
from dflash_offline.cache.rows import utc_now
from dflash_offline.cache.verify import verify_cache
from dflash_offline.cache.window import (
    is_validation_store,
    read_retirements,
    read_seals,
    retire_store,
    routing_key,
    window_usage,
)
from dflash_offline.cache.window_records import StoreRetirement
from dflash_offline.generate.launch import format_summary
from dflash_offline.generate.run import run_generate
from dflash_offline.placement import Placement
from tests.tiny_caches import TinyCaches

from .helpers import features_by_id, tiny_config

VAL_FRACTION = 0.1
SMALL_FILES = dict(chunk_bytes=2048, shard_file_bytes=16384)
"""Small inner chunks and shard files: a store's fixed cost on disk (a chunk of each array) stays far
below the tiny stores of this test, as it does below real stores at the default geometry."""


def retire_sealed(root: Path, *, at_most: int) -> int:
    """What training does once a store's samples had their passes: retire sealed training stores."""
    retired = read_retirements(root)
    samples = read_table(root, "samples", ["shard", "num_tokens"]).to_pydict()
    done = 0
    for shard, seal in sorted(read_seals(root).items()):
        if done == at_most or seal.validation or shard in retired:
            continue
        tokens = sum(n for s, n in zip(samples["shard"], samples["num_tokens"], strict=True) if s == shard)
        record = StoreRetirement(
            shard=shard,
            run_id="trainer",
            num_samples=seal.num_samples,
            num_tokens=tokens,
            retired_at=utc_now(),
        )
        retire_store(root, record)
        done += 1
    return done


def disk_bytes(root: Path) -> int:
    """Bytes of every file of the training stores (the validation stores are apart from the window; a
    store being deleted may vanish while it is summed)."""
    total = 0
    for path in CacheLayout.at(root).shards_dir.rglob("*"):
        if is_validation_store(path.relative_to(CacheLayout.at(root).shards_dir).parts[0]):
            continue
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size if path.is_file() else 0
    return total


class SlowTrainer(threading.Thread):
    """Watches the window while generate runs and retires one sealed store every ``every`` looks."""

    def __init__(self, cache: Path, *, every: int) -> None:
        super().__init__(daemon=True)
        self.cache, self.every = cache, every
        self.stop = threading.Event()
        self.most_committed = self.most_disk = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        looks = 0
        try:
            while not self.stop.wait(0.05):
                if not (self.cache / "cache.json").exists():
                    continue
                looks += 1
                self.most_committed = max(self.most_committed, window_usage(self.cache).stored_bytes)
                self.most_disk = max(self.most_disk, disk_bytes(self.cache))
                if looks % self.every == 0:
                    retire_sealed(self.cache, at_most=1)
        except BaseException as e:
            self.error = e


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_window_bound_holds_while_training_retires_stores(tmp_path: Path, tiny_caches: TinyCaches) -> None:
    # The session's tiny_cache is the plain generate to compare with (written by tiny_config): its 80
    # records hold about 19 jobs' tokens, twice the window's 10, so generate has to wait for the trainer.
    shared = tiny_caches.get(records=80, seed=5)
    reference, data = shared.root, shared.data
    token_bytes = read_fingerprint(reference).storage.token_bytes
    job_bytes = 768 * token_bytes  # tiny_config's tokens_per_batch
    limit = 10 * job_bytes
    store_size = limit // 4  # the default for 2 workers: limit / (2 × workers)

    cache = tmp_path / "window"
    config = tiny_config(
        cache,
        data,
        window_limit=limit,
        val_fraction=VAL_FRACTION,
        flush_seconds=0.2,
        placement=Placement(num_cpu_workers=2, threads_per_worker=1),
        **SMALL_FILES,
    )
    trainer = SlowTrainer(cache, every=10)  # slow: the window fills and generate has to wait
    trainer.start()
    try:
        summary = run_generate(config)
    finally:
        trainer.stop.set()
        trainer.join()
    assert trainer.error is None
    assert summary.status == "finished"

    assert trainer.most_committed <= limit
    assert trainer.most_disk <= limit + store_size, (trainer.most_disk, limit, store_size)
    waits = read_table(cache, "waits").to_pydict()
    assert waits["side"]  # the window was full at times
    assert set(waits["side"]) == {"generate"}
    assert summary.window_wait_seconds == pytest.approx(sum(waits["seconds"]))
    assert "for training to free the disk window" in format_summary(summary, cache_dir=str(cache))
    assert read_retirements(cache)  # and training freed it

    # Validation samples sit in stores of their own, none retired.
    rows = read_table(cache, "samples", ["sample_id", "shard", "checksum", "conversation_root"]).to_pydict()
    shard_of = dict(zip(rows["sample_id"], rows["shard"], strict=True))
    root_of = dict(zip(rows["sample_id"], rows["conversation_root"], strict=True))
    val_ids = {i for i in shard_of if routing_key(sample_id=i, conversation_root=root_of[i]) < VAL_FRACTION}
    assert val_ids
    assert {i for i, s in shard_of.items() if is_validation_store(s)} == val_ids
    assert not any(is_validation_store(s) for s in read_retirements(cache))
    # Every store is sealed at the end, so training can retire all of them.
    assert set(read_seals(cache)) == set(shard_of.values())

    # Same samples as a plain generate: every checksum in the manifest, every surviving sample's bytes.
    ref_rows = read_table(reference, "samples", ["sample_id", "checksum"]).to_pydict()
    assert dict(zip(rows["sample_id"], rows["checksum"], strict=True)) == dict(
        zip(ref_rows["sample_id"], ref_rows["checksum"], strict=True)
    )
    ref, got = features_by_id(reference), features_by_id(cache)
    assert set(got) <= set(ref)
    assert val_ids <= set(got)
    for sample_id, (features, ids, mask) in got.items():
        features_ref, ids_ref, mask_ref = ref[sample_id]
        assert np.array_equal(ids, ids_ref)
        assert np.array_equal(mask, mask_ref)
        assert torch.equal(features.view(torch.int16), features_ref.view(torch.int16)), sample_id
    assert verify_cache(cache, progress=False).ok


def test_a_window_that_open_stores_could_fill_is_refused(tiny_caches: TinyCaches) -> None:
    """Training retires only sealed stores: a window that two workers' open stores and a job could fill
    would leave generate and training waiting for each other forever."""
    from dflash_offline.errors import ConfigError
    from dflash_offline.generate.window_setup import check_window

    shared = tiny_caches.get(records=80, seed=5)  # the session's tiny_cache: written by tiny_config
    reference, data = shared.root, shared.data
    fingerprint = read_fingerprint(reference)
    token_bytes = fingerprint.storage.token_bytes
    # 2 workers, --max-len 256, 768 tokens a job: the default stores (limit / 4) fit below the limit
    # once it exceeds 2 × (2 × 256 + 768) tokens' bytes.
    smallest = 2 * (2 * 256 + 768) * token_bytes + 1
    check_window(tiny_config(reference, data, window_limit=smallest + 4), fingerprint, 2)
    with pytest.raises(ConfigError, match=f"too small for 2 workers.*give at least {smallest}B"):
        check_window(tiny_config(reference, data, window_limit=smallest - 4), fingerprint, 2)
    with pytest.raises(ConfigError, match=r"or a smaller `GenerateConfig\.store_size`$"):
        check_window(tiny_config(reference, data, window_limit=10**6, store_size=400_000), fingerprint, 2)
