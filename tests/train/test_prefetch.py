"""The prefetcher against a real cache: bit-exact content in plan order, reproducible anchors whatever
the thread timing, bounded look-ahead, errors carried to the consumer, prompt close."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import CachedSample
from dflash_offline.errors import CacheFormatError, ConfigError, ResumeError, WorkerError
from dflash_offline.train.loader import LOADER_STATE_VERSION, Prefetcher, in_place_feature_width
from dflash_offline.train.packing import HostBufferPool
from dflash_offline.train.planner import (
    AnchorRequest,
    LengthMixingPlanner,
    PackedMicrobatch,
    ScheduledMicrobatch,
    schedule_for_rank,
)
from dflash_offline.train.snapshot import IndexSnapshot, take_snapshot
from tests.train.cache_helpers import PACKED_TENSORS, WrittenSample, as_host_dict, make_samples, write_cache

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, WrittenSample]]:
    root = tmp_path_factory.mktemp("cache")
    written = write_cache(root, make_samples(80, seed=1))
    return root, written


def jobs_for(
    reader: CacheReader, *, rank: int = 1, epochs: int = 2
) -> tuple[IndexSnapshot, list[ScheduledMicrobatch]]:
    snap = take_snapshot(reader)
    planner = LengthMixingPlanner(snap, seed=3, tokens_per_microbatch=300, grad_accum=2, world_size=2)
    jobs = list(
        schedule_for_rank(planner.iterate(epochs), rank=rank, seed=3, reader_rows_N=snap.reader_rows_N)
    )
    return snap, jobs


def simple_anchor_fn(request: AnchorRequest) -> torch.Tensor:
    """Up to 5 loss positions per microbatch, drawn with the request's generator only."""
    eligible = torch.nonzero(request.loss_mask_T).flatten()
    order = torch.randperm(eligible.numel(), generator=request.generator)
    return torch.sort(eligible[order[:5]]).values


class JitterReader:
    """Delegates to a reader after a random sleep, so threads finish out of order."""

    def __init__(self, reader: CacheReader, seed: int) -> None:
        self.reader = reader
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def read_rows(self, rows: Sequence[int]) -> list[CachedSample]:
        with self.lock:
            delay = self.rng.random() * 0.01
        time.sleep(delay)
        return self.reader.read_rows(rows)


def expected_batch(job: ScheduledMicrobatch, written: dict[str, WrittenSample]) -> dict[str, torch.Tensor]:
    """The packed row built by hand from what was written."""
    docs = [written[sid] for sid in job.plan.sample_ids]
    ids, mask, feats, doc_ids, positions, starts = [], [], [], [], [], [0]
    for d, doc in enumerate(docs):
        n = len(doc.input_ids_T)
        ids += [int(x) for x in doc.input_ids_T]
        mask += [bool(x) for x in doc.loss_mask_T]
        feats.append(doc.features_TF)
        doc_ids += [d] * n
        positions += list(range(n))
        starts.append(starts[-1] + n)
    return {
        "input_ids_T": torch.tensor(ids, dtype=torch.int64),
        "loss_mask_T": torch.tensor(mask, dtype=torch.bool),
        "features_TF": torch.cat(feats),
        "doc_ids_T": torch.tensor(doc_ids, dtype=torch.int32),
        "positions_T": torch.tensor(positions, dtype=torch.int32),
        "cu_seqlens_D1": torch.tensor(starts, dtype=torch.int32),
    }


def assert_matches(
    batch: PackedMicrobatch, job: ScheduledMicrobatch, written: dict[str, WrittenSample]
) -> None:
    assert batch.plan == job.plan
    got = as_host_dict(batch)
    for name, want in expected_batch(job, written).items():
        assert got[name].dtype == want.dtype, name
        if want.dtype == torch.bfloat16:  # bit-exact, NaN payloads included
            assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name
        else:
            assert torch.equal(got[name], want), name
    assert batch.num_documents == len(job.plan.sample_ids)
    assert batch.num_tokens == job.plan.num_tokens == got["input_ids_T"].shape[0]


@pytest.mark.parametrize("jitter", [True, False])
def test_batches_arrive_in_plan_order_bit_exact(
    cache: tuple[Path, dict[str, WrittenSample]], jitter: bool
) -> None:
    """With jitter, reads finish out of order (and take the copying path); without, the real reader
    decodes straight into the packed buffers."""
    root, written = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)
        assert len(jobs) > 10
        source = JitterReader(reader, 0) if jitter else reader
        assert (in_place_feature_width(source) is None) == jitter
        with Prefetcher(source, jobs, device="cpu", prefetch=3, num_threads=3) as prefetcher:
            batches = list(prefetcher)
            stats = prefetcher.stats
    assert len(batches) == len(jobs)
    for batch, job in zip(batches, jobs):
        assert_matches(batch, job, written)
        assert batch.inputs.anchors_A.numel() == 0
        assert batch.inputs.anchors_A.dtype == torch.int64
    assert stats.num_batches == len(jobs)
    assert stats.num_samples == sum(len(j.plan.sample_ids) for j in jobs)
    assert stats.num_tokens == sum(j.plan.num_tokens for j in jobs)
    assert stats.bytes_read == sum(b.num_bytes for b in batches) == stats.num_tokens * (16 * 2 + 4 + 1)
    assert stats.wait_s == pytest.approx(sum(b.data_wait_s for b in batches))


def test_anchors_do_not_depend_on_thread_timing(cache: tuple[Path, dict[str, WrittenSample]]) -> None:
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader, epochs=1)
        runs = []
        for threads, depth, seed in ((1, 1, 0), (4, 4, 1), (3, 2, 2)):
            with Prefetcher(
                JitterReader(reader, seed),
                jobs,
                device="cpu",
                prefetch=depth,
                num_threads=threads,
                anchor_fn=simple_anchor_fn,
            ) as prefetcher:
                runs.append([b.inputs.anchors_A for b in prefetcher])
    for run in runs[1:]:
        assert len(run) == len(runs[0])
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
    anchors = runs[0]
    assert any(a.numel() > 0 for a in anchors)
    assert len({tuple(a.tolist()) for a in anchors if a.numel()}) > 1, "each microbatch has its own seed"


class GatedReader:
    """Counts reads and holds each one until ``release`` is set; ``inside`` is the number of reads in
    progress. Every change is announced on ``changed``."""

    def __init__(self, reader: CacheReader) -> None:
        self.reader = reader
        self.calls = 0
        self.inside = 0
        self.changed = threading.Condition()
        self.release = threading.Event()

    def read_rows(self, rows: Sequence[int]) -> list[CachedSample]:
        with self.changed:
            self.calls += 1
            self.inside += 1
            self.changed.notify_all()
        try:
            assert self.release.wait(timeout=60), "the test never released the read"
            return self.reader.read_rows(rows)
        finally:
            with self.changed:
                self.inside -= 1
                self.changed.notify_all()


def waiting_for_a_slot(prefetcher: Prefetcher) -> int:
    """Worker threads blocked on the prefetcher's condition and not yet woken: the only wait in a
    worker's loop is for a free look-ahead slot (``Condition._waiters`` holds one lock per thread in
    ``wait()`` that no ``notify`` has released yet)."""
    with prefetcher._cond:
        return len(prefetcher._cond._waiters)  # type: ignore[attr-defined]


def settle(prefetcher: Prefetcher, gated: GatedReader, *, reads_started: int) -> None:
    """Wait until at least ``reads_started`` reads began and every worker thread is either held inside
    a read (before ``release``) or waiting for a slot: from then on nothing moves until the test acts,
    so counts read afterwards are final, however the threads were scheduled."""
    deadline = time.monotonic() + 60
    while True:
        with gated.changed:
            calls, inside = gated.calls, gated.inside
        held = 0 if gated.release.is_set() else inside  # a released read is still moving
        waiting = waiting_for_a_slot(prefetcher)
        if calls >= reads_started and held + waiting == len(prefetcher._threads):
            return
        assert time.monotonic() < deadline, (
            f"the prefetch threads never settled: {calls} reads started (expected ≥ {reads_started}), "
            f"{inside} in progress, {waiting} threads waiting for a slot"
        )
        with gated.changed:
            gated.changed.wait(timeout=0.01)  # a read starting or ending, or a thread parking


def test_look_ahead_is_bounded_by_prefetch_depth(cache: tuple[Path, dict[str, WrittenSample]]) -> None:
    """4 threads, depth 2: two reads start and the other threads wait for a slot; finished batches
    keep their slots until consumed; each consumed batch frees exactly one."""
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)
        gated = GatedReader(reader)
        with Prefetcher(gated, jobs, device="cpu", prefetch=2, num_threads=4) as prefetcher:
            settle(prefetcher, gated, reads_started=2)
            assert (gated.calls, gated.inside) == (2, 2), "two slots: no more than two reads at once"
            gated.release.set()
            settle(prefetcher, gated, reads_started=2)
            assert gated.calls == 2, "nothing consumed yet: no more than 2 batches prepared"
            assert next(prefetcher).plan == jobs[0].plan
            settle(prefetcher, gated, reads_started=3)
            assert gated.calls == 3, "one batch consumed: one more read"
            assert [next(prefetcher).plan for _ in range(2)] == [j.plan for j in jobs[1:3]]
            settle(prefetcher, gated, reads_started=5)
            assert gated.calls == 5


class FailingReader:
    def __init__(self, reader: CacheReader, bad_sample: str) -> None:
        self.reader = reader
        self.bad_sample = bad_sample

    def read_rows(self, rows: Sequence[int]) -> list[CachedSample]:
        samples = self.reader.read_rows(rows)
        if any(s.sample_id == self.bad_sample for s in samples):
            raise OSError(f"simulated disk error reading {self.bad_sample}")
        return samples


def test_a_failing_read_is_raised_in_the_consumer_after_the_earlier_batches(
    cache: tuple[Path, dict[str, WrittenSample]],
) -> None:
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)
        bad_index = 7
        reader_with_fault = FailingReader(reader, jobs[bad_index].plan.sample_ids[0])
        got = []
        with Prefetcher(reader_with_fault, jobs, device="cpu", prefetch=4, num_threads=3) as prefetcher:
            with pytest.raises(WorkerError, match="simulated disk error") as info:  # noqa: PT012
                for batch in prefetcher:
                    got.append(batch)
            with pytest.raises(StopIteration):
                next(prefetcher)
    assert [b.plan for b in got] == [j.plan for j in jobs[:bad_index]]
    assert isinstance(info.value.__cause__, OSError)
    assert "read_rows" in str(info.value), "the worker's traceback travels with the error"


def test_a_failing_job_iterator_and_a_bad_anchor_fn_are_raised(
    cache: tuple[Path, dict[str, WrittenSample]],
) -> None:
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)

        def broken_jobs() -> Iterator[ScheduledMicrobatch]:
            yield from jobs[:3]
            raise RuntimeError("planner exploded")

        with Prefetcher(reader, broken_jobs(), device="cpu", num_threads=2) as prefetcher:
            assert len([next(prefetcher) for _ in range(3)]) == 3
            with pytest.raises(WorkerError, match="planner exploded"):
                next(prefetcher)

        def bad_anchor_fn(request: AnchorRequest) -> torch.Tensor:
            raise ValueError("anchor bug")

        with (
            Prefetcher(reader, jobs, device="cpu", anchor_fn=bad_anchor_fn) as prefetcher,
            pytest.raises(WorkerError, match="anchor bug"),
        ):
            next(prefetcher)


def test_rows_that_no_longer_match_the_plan_are_refused(cache: tuple[Path, dict[str, WrittenSample]]) -> None:
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)
        shifted = [
            ScheduledMicrobatch(
                plan=j.plan, reader_rows=tuple((r + 1) % 80 for r in j.reader_rows), anchor_seed=j.anchor_seed
            )
            for j in jobs
        ]
        with (
            Prefetcher(reader, shifted, device="cpu") as prefetcher,
            pytest.raises(WorkerError, match="table changed under the run") as info,
        ):
            next(prefetcher)
    assert isinstance(info.value.__cause__, CacheFormatError)


def test_early_close_stops_every_thread_promptly(cache: tuple[Path, dict[str, WrittenSample]]) -> None:
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader, epochs=50)  # far more than we consume
        prefetcher = Prefetcher(JitterReader(reader, 5), jobs, device="cpu", prefetch=4, num_threads=4)
        for _, _batch in zip(range(3), prefetcher):
            pass
        start = time.monotonic()
        prefetcher.close()
        assert time.monotonic() - start < 10
        assert not any(t.is_alive() for t in prefetcher._threads)
        with pytest.raises(StopIteration):
            next(prefetcher)
        prefetcher.close()  # idempotent
        # Blocked in a read: close still returns once the read finishes.
        gated = GatedReader(reader)
        blocked = Prefetcher(gated, jobs, device="cpu", prefetch=2, num_threads=2)
        settle(blocked, gated, reads_started=2)
        assert gated.inside == 2

        def release_once_closing() -> None:
            while not blocked._closed:  # close() sets it, then joins the threads
                time.sleep(0.001)
            gated.release.set()

        releaser = threading.Thread(target=release_once_closing)
        releaser.start()
        blocked.close()
        releaser.join()
        assert not any(t.is_alive() for t in blocked._threads)
        assert gated.calls == 2


def test_consumer_blocked_on_an_empty_plan_ends() -> None:
    class NeverRead:
        def read_rows(self, rows: Sequence[int]) -> list[CachedSample]:
            raise AssertionError("no job, no read")

    with Prefetcher(NeverRead(), [], device="cpu", num_threads=3) as prefetcher:
        assert list(prefetcher) == []
    with pytest.raises(ConfigError, match="prefetch"):
        Prefetcher(NeverRead(), [], device="cpu", prefetch=0)


@pytest.mark.gpu
def test_cuda_batches_match_cpu_batches(cache: tuple[Path, dict[str, WrittenSample]]) -> None:
    root, written = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)
        with Prefetcher(
            reader, jobs, device="cuda", prefetch=3, num_threads=3, anchor_fn=simple_anchor_fn
        ) as pf:
            cuda_batches = []
            for batch in pf:
                assert batch.inputs.features_TF.is_cuda
                assert batch.inputs.anchors_A.is_cuda
                # Work on the consumer's stream right away: it must see the finished copy.
                checksum = batch.inputs.features_TF.view(torch.int16).to(torch.int64).sum()
                cuda_batches.append((batch, checksum))
        with Prefetcher(reader, jobs, device="cpu", anchor_fn=simple_anchor_fn) as pf:
            cpu_batches = list(pf)
    for (batch, checksum), cpu, job in zip(cuda_batches, cpu_batches, jobs):
        assert_matches(batch, job, written)
        assert torch.equal(batch.inputs.anchors_A.cpu(), cpu.inputs.anchors_A)
        assert int(checksum) == int(cpu.inputs.features_TF.view(torch.int16).to(torch.int64).sum())


def test_written_numbers_are_consistent(cache: tuple[Path, dict[str, WrittenSample]]) -> None:
    """Guards the fixture itself: the cache holds all four buckets and several shard files."""
    root, written = cache
    with CacheReader.open(root) as reader:
        assert len(reader.samples) == len(written) == 80
        assert set(np.unique(reader.samples.bucket_id).tolist()) == {0, 1, 2, 3}


def test_host_buffers_are_reused_only_once_nothing_holds_them() -> None:
    pool = HostBufferPool(max_buffers=2)
    a = pool.take(1000)
    b = pool.take(1000)
    assert a.data_ptr() != b.data_ptr(), "a buffer in use is never handed out twice"
    view = a[10:20]
    a_ptr = a.data_ptr()
    del a
    c = pool.take(900)
    assert c.data_ptr() != a_ptr, "a view of the buffer still holds it"
    del view, c
    d = pool.take(900)
    assert d.data_ptr() == a_ptr, "released: the same buffer comes back"
    del b, d
    before = pool.num_allocations
    for _ in range(10):
        pool.take(1000)  # dropped at once: always the same buffers
    assert pool.num_allocations == before


def test_prefetcher_recycles_buffers_without_corrupting_held_batches(
    cache: tuple[Path, dict[str, WrittenSample]],
) -> None:
    root, written = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader, epochs=4)
        held: list[tuple[torch.Tensor, ScheduledMicrobatch]] = []
        with Prefetcher(reader, jobs, device="cpu", prefetch=2, num_threads=2) as prefetcher:
            for i, (batch, job) in enumerate(zip(prefetcher, jobs)):
                if i in (0, 7, 20):
                    held.append(
                        (batch.inputs.features_TF[1:], job)
                    )  # a view keeps its buffer out of the pool
            allocations = prefetcher._pool.num_allocations
    assert len(jobs) > 40
    # In use at once: 2 claimed + 1 consumed + the held ones; a few growth steps come on top.
    assert allocations <= 3 + len(held) + 6 < len(jobs) // 3, "dropped batches' buffers are reused"
    for view, job in held:
        want = expected_batch(job, written)["features_TF"][1:]
        assert torch.equal(view.view(torch.int16), want.view(torch.int16))


class InPlaceReader:
    """The ``features_out`` fast path of ``RowReader``, emulated over the real reader; with
    ``honour=False`` it takes the argument but returns fresh tensors (the prefetcher must copy)."""

    def __init__(self, reader: CacheReader, *, honour: bool) -> None:
        self.reader = reader
        self.fingerprint = reader.fingerprint
        self.honour = honour
        self.calls_with_out = 0

    def read_rows(self, rows: Sequence[int], features_out: np.ndarray | None = None) -> list[CachedSample]:
        samples = self.reader.read_rows(rows)
        if features_out is None or not self.honour:
            return samples
        self.calls_with_out += 1
        out, start = [], 0
        for s in samples:
            rows_TF = features_out[start : start + s.num_tokens]
            rows_TF[:] = s.features_TF.view(torch.int16).numpy().view(np.uint16)
            out.append(dataclasses.replace(s, features_TF=torch.from_numpy(rows_TF).view(torch.bfloat16)))
            start += s.num_tokens
        return out


@pytest.mark.parametrize("honour", [True, False])
def test_in_place_feature_reads_are_bit_exact(
    cache: tuple[Path, dict[str, WrittenSample]], honour: bool
) -> None:
    root, written = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader)
        in_place = InPlaceReader(reader, honour=honour)
        with Prefetcher(in_place, jobs, device="cpu", prefetch=3, num_threads=2) as prefetcher:
            batches = list(prefetcher)
    assert in_place.calls_with_out == (len(jobs) if honour else 0)
    for batch, job in zip(batches, jobs):
        assert_matches(batch, job, written)


def ahead(prefetcher: Prefetcher, done: Callable[[Prefetcher], bool]) -> None:
    """Wait until the prefetcher's threads reached ``done`` (batches prepared, a failure recorded)."""
    deadline = time.monotonic() + 60
    while True:
        with prefetcher._cond:
            if done(prefetcher):
                return
            assert time.monotonic() < deadline, "the prefetch threads never got ahead"
            prefetcher._cond.wait(timeout=0.01)


@pytest.mark.parametrize("cut", [0, 1, 6, -1, None])
def test_a_loaded_state_yields_exactly_the_remaining_batches(
    cache: tuple[Path, dict[str, WrittenSample]], cut: int | None
) -> None:
    """Reference: one uninterrupted prefetcher. A second hands over ``cut`` batches and gives its state; a
    fresh one over the same jobs, whose threads had already prepared batches before the position, loads
    it and yields the reference's batches from there: same plans, same bytes, same anchors."""
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader, epochs=1)
        cut = len(jobs) + cut if cut is not None and cut < 0 else len(jobs) if cut is None else cut
        source = JitterReader(reader, 3)
        options: dict[str, Any] = dict(device="cpu", prefetch=3, num_threads=3, anchor_fn=simple_anchor_fn)
        with Prefetcher(source, iter(jobs), **options) as whole:
            reference = [as_host_dict(b) | {"plan": b.plan} for b in whole]  # type: ignore[operator]
        with Prefetcher(source, iter(jobs), **options) as first:
            for _, _batch in zip(range(cut), first):
                pass
            state = json.loads(json.dumps(first.state_dict()))
        assert state["num_delivered"] == cut
        with Prefetcher(source, iter(jobs), **options) as resumed:
            ahead(resumed, lambda p: len(p._ready) >= min(3, len(jobs)))
            resumed.load_state_dict(state)
            rest = [as_host_dict(b) | {"plan": b.plan} for b in resumed]  # type: ignore[operator]
            assert resumed.state_dict()["num_delivered"] == len(jobs)
            assert resumed.stats.num_batches == len(jobs) - cut
    assert len(rest) == len(reference) - cut
    for got, want in zip(rest, reference[cut:]):
        assert got["plan"] == want["plan"]
        for name in PACKED_TENSORS:  # bit-exact: bf16 compared as its bits
            assert torch.equal(bits(got[name]), bits(want[name])), name


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor


def test_a_failed_read_before_the_loaded_position_is_not_raised(
    cache: tuple[Path, dict[str, WrittenSample]],
) -> None:
    """A job before the position is never handed over, so its read failing ahead of the load is no error;
    one after it still is, after the batches before it."""
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader, epochs=1)
        early = FailingReader(reader, jobs[1].plan.sample_ids[0])
        with Prefetcher(early, iter(jobs), device="cpu", prefetch=4, num_threads=2) as resumed:
            ahead(resumed, lambda p: p._failure is not None)
            resumed.load_state_dict({"version": LOADER_STATE_VERSION, "num_delivered": 4})
            assert [b.plan for b in resumed] == [j.plan for j in jobs[4:]]
        late = FailingReader(reader, jobs[6].plan.sample_ids[0])
        with Prefetcher(late, iter(jobs), device="cpu", prefetch=4, num_threads=2) as resumed:
            resumed.load_state_dict({"version": LOADER_STATE_VERSION, "num_delivered": 4})
            assert [next(resumed).plan for _ in range(2)] == [j.plan for j in jobs[4:6]]
            with pytest.raises(WorkerError, match="simulated disk error"):
                next(resumed)


def test_a_state_of_another_version_or_past_the_jobs_is_refused(
    cache: tuple[Path, dict[str, WrittenSample]],
) -> None:
    root, _ = cache
    with CacheReader.open(root, num_threads=2) as reader:
        _, jobs = jobs_for(reader, epochs=1)
        with Prefetcher(reader, iter(jobs), device="cpu") as prefetcher:
            with pytest.raises(ResumeError, match="loader state version 2"):
                prefetcher.load_state_dict({"version": 2, "num_delivered": 0})
            with pytest.raises(ResumeError, match=f"jobs end after {len(jobs)}"):
                prefetcher.load_state_dict({"version": LOADER_STATE_VERSION, "num_delivered": len(jobs) + 1})
