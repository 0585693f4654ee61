"""The loader: cache rows -> packed microbatches on the training device, ahead of time (the
prefetcher)."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dflash_offline.cache.fp8 import Fp8Layout
from dflash_offline.cache.lossy import LossyLayout, decode_rows
from dflash_offline.cache.nf4 import Nf4Layout
from dflash_offline.cache.rows import CachedSample
from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.drafter.loss import loss_rows
from dflash_offline.errors import CacheDamageError, CacheFormatError, ConfigError, ResumeError, WorkerError
from dflash_offline.train.config import LaunchConfig
from dflash_offline.train.packing import HostBufferPool, pack_into, pack_layout
from dflash_offline.train.planner import AnchorRequest, PackedMicrobatch, ScheduledMicrobatch

# ─── The prefetcher ─────────────────────────────────────────────────────────────────────────────────────────
# The asynchronous prefetcher: cache rows -> packed microbatches on the training device, ahead of time.
#
# Worker threads take prefetcher jobs (``ScheduledMicrobatch``) in plan order, read the samples from
# the cache, pack them into one row (documents concatenated; document ids, per-document positions and
# varlen offsets alongside), draw anchors with the microbatch's own seeded generator, and, on CUDA, copy
# the result from pinned host memory to the GPU on a side stream. The consumer gets the microbatches in
# plan order whatever the thread timing (a reorder buffer), and its stream waits on each batch's copy
# event before using it, so the main stream never reads an unfinished copy.
#
# Bounded memory: at most ``prefetch`` microbatches are claimed, in flight or waiting, at any time (a
# slot is freed when the consumer takes a batch). Each packed microbatch lives in one host buffer
# (train/packing.py): on CUDA a pinned block from PyTorch's caching host allocator (reused once the copy
# that read it has finished), on the CPU a ``HostBufferPool`` buffer (reused once nothing holds it).
# When the reader supports ``features_out`` (see ``RowReader``) it decodes straight into that buffer.
#
# Errors: an exception in a worker (a failed read, a checksum mismatch, a failing anchor_fn) or in the
# job iterator is re-raised in the consumer as ``WorkerError`` carrying the thread's traceback, after the
# batches planned before it were delivered (a ``CacheDamageError`` is re-raised as itself: damaged data
# is the user's to act on, and its message names the samples). ``close()`` (also on ``with`` exit)
# stops the threads promptly; a worker in the middle of a read finishes that read and exits. The worker
# threads hold the prefetcher, so an abandoned one is never collected: always use ``with`` or call
# ``close()``.
#
# Resume: ``state_dict()`` is the prefetcher's position in its job stream (the batches handed over);
# ``load_state_dict`` on a fresh prefetcher over the same stream continues after them, so the batches it
# yields are exactly those the first one had not yet handed over (jobs before the position are never
# read again; batches its threads had prepared ahead of the position are dropped).
#
# Shape legend: T = tokens of the packed microbatch, F = features per token, D = documents, A = anchors.


LOADER_STATE_VERSION = 1

AnchorFn = Callable[[AnchorRequest], torch.Tensor]
"""Returns int64 [A] indices into T (drawn with ``request.generator`` only, so they are reproducible)."""

_JOIN_TIMEOUT_S = 30.0


class RowReader(Protocol):
    """What the prefetcher needs of a ``CacheReader``: thread-safe reads of table rows.

    Optional fast path: when ``read_rows`` also takes ``features_out`` (a C-contiguous uint16
    [sum of T, F] array) and the reader has ``fingerprint.feature_width``, the reader writes sample i's
    features to rows [T_0 + ... + T_{i-1}, + T_i) of it, in request order, and returns samples whose
    ``features_TF`` are bf16 views of those rows. That saves a copy of every feature byte (a 2.5×
    faster read-and-pack on the 2-core machine, warm page cache, uncompressed cache)."""

    def read_rows(self, rows: Sequence[int]) -> list[CachedSample]: ...


def device_decode_layout(reader: object) -> LossyLayout | None:
    """The row layout when ``reader`` is a lossy (fp8, nf4) cache that can hand over its stored rows
    (``read_rows(..., stored_out=...)``), else None."""
    try:
        accepts = "stored_out" in inspect.signature(reader.read_rows).parameters  # type: ignore[attr-defined]
        layout = reader.storage.lossy  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return None
    return layout if accepts and isinstance(layout, (Fp8Layout, Nf4Layout)) else None


def in_place_feature_width(reader: object) -> int | None:
    """Feature width when ``reader`` supports the ``features_out`` fast path, else None."""
    try:
        accepts = "features_out" in inspect.signature(reader.read_rows).parameters  # type: ignore[attr-defined]
        return int(reader.fingerprint.feature_width) if accepts else None  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefetchStats:
    """Counters since the prefetcher started (a consistent copy; totals over all worker threads)."""

    num_batches: int
    """Microbatches handed to the consumer."""
    num_samples: int
    num_tokens: int
    bytes_read: int
    """Bytes of features, ids and masks read from the cache (decoded size)."""
    wait_s: float
    """Seconds the consumer spent waiting for data, summed."""
    max_wait_s: float
    read_s: float
    """Thread-seconds inside ``reader.read_rows``."""
    pack_s: float
    """Thread-seconds packing, pinning, drawing anchors and issuing the device copy."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Failure:
    """An exception raised by a worker thread or the job iterator, with where it happened."""

    index: int
    """Job index the failure belongs to: batches before it are still delivered."""
    error: BaseException
    traceback: str
    thread: str


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ready:
    """A packed batch waiting in the reorder buffer."""

    batch: PackedMicrobatch
    copy_done: torch.cuda.Event | None
    """Recorded on the side stream after the device copies; None on the CPU."""


class Prefetcher:
    """Iterates ``PackedMicrobatch`` in job order, prepared ``prefetch`` batches ahead by threads.

    ``device``: where batches are delivered (CUDA: pinned host buffers, copies on a side stream).
    ``num_threads``: worker threads (each reads, packs and copies one microbatch at a time; the
    reader's own pool parallelises inside a read). ``anchor_fn``: called in the worker with an
    ``AnchorRequest`` whose generator is seeded by the microbatch's ``anchor_seed``.
    ``pin_memory``: override (default: pin when the device is CUDA). ``host_pool``: share a pool of
    CPU buffers between prefetchers (one per epoch, say) so buffers are not faulted in again.
    ``decode_on_device``: for a lossy (fp8, nf4) cache, copy the stored rows (0.27–0.51 of bf16's
    bytes) to the device and decode them there, on the side stream (default: on CUDA); otherwise the
    reader decodes on the CPU. Both give the same bf16 bits (``cache/lossy.py``: exact arithmetic).
    ``loss_block_size``: with anchors, also hand over ``loss_rows_N`` for blocks of this size
    (``drafter.loss.loss_rows``, computed here on the host: on the device it would be a sync).
    """

    def __init__(
        self,
        reader: RowReader,
        jobs: Iterable[ScheduledMicrobatch],
        *,
        device: torch.device | str,
        prefetch: int = 4,
        num_threads: int = 4,
        anchor_fn: AnchorFn | None = None,
        pin_memory: bool | None = None,
        host_pool: HostBufferPool | None = None,
        decode_on_device: bool | None = None,
        loss_block_size: int | None = None,
    ) -> None:
        if prefetch < 1 or num_threads < 1:
            raise ConfigError(
                f"{field_ref(LaunchConfig, 'prefetch')} and prefetch threads must be ≥ 1, got {prefetch} and "
                f"{num_threads}"
            )
        self._reader = reader
        self._jobs: Iterator[ScheduledMicrobatch] = iter(jobs)
        self._device = torch.device(device)
        self._prefetch = prefetch
        self._anchor_fn = anchor_fn
        self._loss_block_size = loss_block_size
        is_cuda = self._device.type == "cuda"
        self._pin = is_cuda if pin_memory is None else pin_memory
        self._stream = torch.cuda.Stream(device=self._device) if is_cuda else None
        # The pool keeps as many buffers as were ever in use at once: batches in flight or waiting
        # (≤ prefetch) plus those the loop holds (a whole step's microbatches, say); capped.
        self._pool = host_pool or HostBufferPool(max_buffers=2 * prefetch + 8)
        self._feature_width = in_place_feature_width(reader)
        self._fp8 = (
            device_decode_layout(reader)
            if (is_cuda if decode_on_device is None else decode_on_device)
            else None
        )
        if self._fp8 is not None and self._feature_width is None:
            self._fp8 = None  # a reader without the features_out fast path: let it decode
        self._cond = threading.Condition()
        self._jobs_lock = threading.Lock()  # the job iterator is not thread-safe; kept apart from _cond
        # State under _cond:
        self._claimed = 0  # slots taken by workers (a job index each, once the iterator gave one)
        self._next_index = 0  # index the next job from the iterator gets (under _jobs_lock)
        self._consumed = 0  # index of the next batch the consumer gets (its position in the job stream)
        self._first = 0  # the position a loaded state started at (``load_state_dict``)
        self._paused = False  # load_state_dict is stopping the workers to move the position
        self._total: int | None = None  # job count, once the iterator is exhausted
        self._ready: dict[int, _Ready] = {}
        self._failure: _Failure | None = None
        self._closed = False
        self._counters = dict(num_samples=0, num_tokens=0, bytes_read=0, read_s=0.0, pack_s=0.0)
        self._wait_s = 0.0
        self._max_wait_s = 0.0
        self._num_threads = num_threads
        self._threads: list[threading.Thread] = []
        self._start_workers()

    def _start_workers(self) -> None:
        self._threads = [
            threading.Thread(target=self._work, name=f"dflash-prefetch-{i}", daemon=True)
            for i in range(self._num_threads)
        ]
        for thread in self._threads:
            thread.start()

    # ---- consumer side ----------------------------------------------------------------------------

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[PackedMicrobatch]:
        return self

    def __next__(self) -> PackedMicrobatch:
        start = time.perf_counter()
        with self._cond:
            index = self._consumed
            while True:
                if self._closed:
                    raise StopIteration
                failure = self._failure
                if failure is not None and failure.index <= index:
                    self._closed = True  # a failed prefetcher delivers nothing more
                    self._cond.notify_all()
                    if isinstance(failure.error, CacheDamageError):
                        raise failure.error  # the data, not the code: its one-line message says it all
                    raise WorkerError(
                        f"prefetch thread {failure.thread} failed on batch {failure.index}: "
                        f"{type(failure.error).__name__}: {failure.error}\n{failure.traceback}"
                    ) from failure.error
                if index in self._ready:
                    ready = self._ready.pop(index)
                    break
                if self._total is not None and index >= self._total:
                    raise StopIteration
                self._cond.wait()
            self._consumed += 1
            self._cond.notify_all()  # a slot is free
        batch = ready.batch
        if ready.copy_done is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(ready.copy_done)
            for tensor in _device_tensors(batch):
                # Allocated on the side stream: tell the caching allocator the consumer's stream uses it.
                tensor.record_stream(stream)
        waited = time.perf_counter() - start
        self._wait_s += waited
        self._max_wait_s = max(self._max_wait_s, waited)
        return dataclasses.replace(batch, data_wait_s=waited)

    @property
    def stats(self) -> PrefetchStats:
        with self._cond:
            c = dict(self._counters)
            consumed = self._consumed - self._first
        return PrefetchStats(
            num_batches=consumed,
            num_samples=int(c["num_samples"]),
            num_tokens=int(c["num_tokens"]),
            bytes_read=int(c["bytes_read"]),
            wait_s=self._wait_s,
            max_wait_s=self._max_wait_s,
            read_s=float(c["read_s"]),
            pack_s=float(c["pack_s"]),
        )

    # ---- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position in the job stream: how many batches were handed to the consumer."""
        with self._cond:
            return {"version": LOADER_STATE_VERSION, "num_delivered": self._consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the first ``state["num_delivered"]`` jobs of this prefetcher's job stream, which is
        the stream the state was taken from (a resume rebuilds it from the same plan). Called before the
        first batch is taken. The workers are stopped, the jobs before the position are skipped unread (or
        dropped, when a worker had prepared them already) and the workers start again at the position."""
        if state.get("version") != LOADER_STATE_VERSION:
            raise ResumeError(
                f"loader state version {state.get('version')!r}: this dflash-offline reads version "
                f"{LOADER_STATE_VERSION}; resume with the version that wrote it or start a new run"
            )
        position = int(state["num_delivered"])
        with self._cond:
            if self._consumed != self._first:
                raise RuntimeError("load_state_dict after a batch was taken: load before iterating")
            self._paused = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        # Alone now: every job drawn so far is ready, failed, or was never prepared (a worker that stopped).
        while self._next_index < position and self._total is None:
            try:
                next(self._jobs)
            except StopIteration:
                self._total = self._next_index
            except BaseException as exc:
                self._fail(self._next_index, exc)
                break
            else:
                self._next_index += 1
        if self._total is not None and position > self._total:
            raise ResumeError(
                f"loader state at batch {position}, but its jobs end after {self._total}: the job stream "
                "is not the one the state was taken from"
            )
        with self._cond:
            self._ready = {i: ready for i, ready in self._ready.items() if i >= position}
            if self._failure is not None and self._failure.index < position:
                self._failure = None
            # Jobs drawn at or after the position were prepared (or failed): each keeps its slot.
            assert self._closed or all(
                i in self._ready or (self._failure is not None and i >= self._failure.index)
                for i in range(position, self._next_index)
            ), "a worker stopped between drawing a job and storing its batch"
            self._consumed = self._first = position
            self._claimed = max(position, self._next_index)
            self._paused = False
        if not self._closed:
            self._start_workers()

    def close(self) -> None:
        """Stop the workers and drop prepared batches; idempotent; returns within seconds."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        current = threading.current_thread()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for thread in self._threads:
            if thread is not current:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # ---- worker side ------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stopping() and self._claimed - self._consumed >= self._prefetch:
                    self._cond.wait()
                if self._stopping():
                    return
                self._claimed += 1
            with self._jobs_lock:
                index = self._next_index
                try:
                    job = next(self._jobs)
                except StopIteration:
                    with self._cond:
                        self._claimed -= 1
                        self._total = index
                        self._cond.notify_all()
                    return
                except BaseException as exc:
                    self._fail(index, exc)
                    return
                self._next_index += 1
            try:
                ready = self._prepare(job)
            except BaseException as exc:
                self._fail(index, exc)
                return
            with self._cond:
                if not self._closed:
                    self._ready[index] = ready
                self._cond.notify_all()

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._pin:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pool.take(nbytes)

    def _stopping(self) -> bool:
        return self._closed or self._paused or self._failure is not None or self._total is not None

    def _fail(self, index: int, exc: BaseException) -> None:
        failure = _Failure(
            index=index,
            error=exc,
            traceback="".join(traceback.format_exception(exc)),
            thread=threading.current_thread().name,
        )
        with self._cond:
            if self._failure is None or index < self._failure.index:
                self._failure = failure
            self._cond.notify_all()

    def _prepare(self, job: ScheduledMicrobatch) -> _Ready:
        """Read, check, pack, choose anchors, move to the device: one microbatch, in this worker thread."""
        t0 = time.perf_counter()
        samples, num_tokens, layout, buffer_B = self._read(job)
        t1 = time.perf_counter()
        _check_against_plan(job, samples, num_tokens)
        host = pack_into(samples, buffer_B, layout)
        anchors_A, loss_rows_N = self._anchors_and_loss_rows(job, host, num_tokens)
        tensors, copy_done = self._to_device(layout, buffer_B, host, anchors_A, loss_rows_N)
        width = int(tensors["features_TF"].shape[1])
        num_bytes = num_tokens * width * 2 + sum(s.input_ids_T.nbytes + s.loss_mask_T.nbytes for s in samples)
        batch = PackedMicrobatch(
            plan=job.plan,
            inputs=DrafterInputs(
                input_ids_T=tensors["input_ids_T"],
                features_TF=tensors["features_TF"],
                loss_mask_T=tensors["loss_mask_T"],
                doc_ids_T=tensors["doc_ids_T"],
                positions_T=tensors["positions_T"],
                anchors_A=tensors["anchors_A"],
                loss_rows_N=tensors.get("loss_rows_N"),
            ),
            cu_seqlens_D1=tensors["cu_seqlens_D1"],
            num_bytes=num_bytes,
        )
        t2 = time.perf_counter()
        with self._cond:
            c = self._counters
            c["num_samples"] += len(samples)
            c["num_tokens"] += batch.num_tokens
            c["bytes_read"] += num_bytes
            c["read_s"] += t1 - t0
            c["pack_s"] += t2 - t1
        return _Ready(batch=batch, copy_done=copy_done)

    def _read(self, job: ScheduledMicrobatch) -> tuple[list[Any], int, Any, torch.Tensor]:
        """The job's samples, their token count, the packed layout and its (pinned) host buffer."""
        if self._fp8 is not None:
            # fp8 cache, device decode: the stored rows go into the (pinned) buffer as they are.
            num_tokens = job.plan.num_tokens
            layout = pack_layout(
                num_tokens, len(job.reader_rows), self._fp8.num_features, stored_width=self._fp8.row_bytes
            )
            buffer_B = self._host_buffer(layout.nbytes)
            stored_out = layout.carve(buffer_B)["stored_TW"].numpy()
            samples = self._reader.read_rows(job.reader_rows, stored_out=stored_out)  # type: ignore[call-arg]
        elif self._feature_width is not None:
            # The reader decodes features straight into the packed buffer (one copy fewer).
            num_tokens = job.plan.num_tokens
            layout = pack_layout(num_tokens, len(job.reader_rows), self._feature_width)
            buffer_B = self._host_buffer(layout.nbytes)
            features_out = layout.carve(buffer_B)["features_TF"].view(torch.int16).numpy().view(np.uint16)
            samples = self._reader.read_rows(job.reader_rows, features_out=features_out)  # type: ignore[call-arg]
        else:
            samples = self._reader.read_rows(job.reader_rows)
            num_tokens = sum(sample.num_tokens for sample in samples)
            layout = pack_layout(num_tokens, len(samples), int(samples[0].features_TF.shape[1]))
            buffer_B = self._host_buffer(layout.nbytes)
        return list(samples), num_tokens, layout, buffer_B

    def _anchors_and_loss_rows(
        self, job: ScheduledMicrobatch, host: dict[str, torch.Tensor], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The anchors (seeded by the microbatch's content, so every rank and resume draws the same) and
        their loss rows."""
        anchors_A = torch.empty(0, dtype=torch.int64)
        if self._anchor_fn is not None:
            generator = torch.Generator().manual_seed(job.anchor_seed)
            request = AnchorRequest(
                loss_mask_T=host["loss_mask_T"],
                doc_ids_T=host["doc_ids_T"],
                positions_T=host["positions_T"],
                generator=generator,
            )
            anchors_A = self._anchor_fn(request).to(torch.int64)
            assert anchors_A.ndim == 1, f"anchor_fn must return a 1-D tensor, got {tuple(anchors_A.shape)}"
            assert anchors_A.numel() == 0 or (int(anchors_A.min()) >= 0 and int(anchors_A.max()) < num_tokens)
        loss_rows_N = None
        if self._loss_block_size is not None:
            loss_rows_N = loss_rows(host["loss_mask_T"], host["doc_ids_T"], anchors_A, self._loss_block_size)
        return anchors_A, loss_rows_N

    def _to_device(
        self,
        layout: Any,
        buffer_B: torch.Tensor,
        host: dict[str, torch.Tensor],
        anchors_A: torch.Tensor,
        loss_rows_N: torch.Tensor | None,
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """The packed tensors on the training device, and the side stream's copy event (None off CUDA)."""
        copy_done = None
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                # One copy for every per-token tensor (they share the buffer), one for the anchors.
                tensors = layout.carve(buffer_B.to(self._device, non_blocking=True))
                self._decode_stored(tensors)
                tensors["anchors_A"] = anchors_A.pin_memory().to(self._device, non_blocking=True)
                if loss_rows_N is not None:
                    tensors["loss_rows_N"] = loss_rows_N.pin_memory().to(self._device, non_blocking=True)
                copy_done = torch.cuda.Event()
                copy_done.record(self._stream)
        elif self._device.type != "cpu":
            tensors = layout.carve(buffer_B.to(self._device))
            self._decode_stored(tensors)
            tensors["anchors_A"] = anchors_A.to(self._device)
            if loss_rows_N is not None:
                tensors["loss_rows_N"] = loss_rows_N.to(self._device)
        else:
            tensors = {**host, "anchors_A": anchors_A}
            if loss_rows_N is not None:
                tensors["loss_rows_N"] = loss_rows_N
            self._decode_stored(tensors)
        return tensors, copy_done

    def _decode_stored(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace ``stored_TW`` (fp8 rows on the device) by the decoded bf16 ``features_TF``, issued on
        the current stream (the side stream on CUDA, after the copy that filled it)."""
        stored_TW = tensors.pop("stored_TW", None)
        if stored_TW is None:
            return
        assert self._fp8 is not None
        features_TF = torch.empty(
            (stored_TW.shape[0], self._fp8.num_features), dtype=torch.bfloat16, device=stored_TW.device
        )
        tensors["features_TF"] = decode_rows(stored_TW, self._fp8, features_TF)


def _device_tensors(batch: PackedMicrobatch) -> list[torch.Tensor]:
    """Every tensor of ``batch`` (on the device it was delivered to)."""
    x = batch.inputs
    tensors = [x.input_ids_T, x.features_TF, x.loss_mask_T, x.doc_ids_T, x.positions_T, x.anchors_A]
    return [*tensors, batch.cu_seqlens_D1, *([] if x.loss_rows_N is None else [x.loss_rows_N])]


def _check_against_plan(job: ScheduledMicrobatch, samples: list[Any], num_tokens: int) -> None:
    """The cache returned the samples and token count the run's snapshot planned (else it changed)."""
    got = tuple(s.sample_id for s in samples)
    if got != job.plan.sample_ids:
        raise CacheFormatError(
            f"the cache returned samples {got} for rows {job.reader_rows}, the plan expects "
            f"{job.plan.sample_ids}: the reader's table changed under the run (do not refresh the "
            "reader a run trains from)"
        )
    if num_tokens != job.plan.num_tokens:
        raise CacheFormatError(
            f"samples {got} hold {num_tokens} tokens in the cache, {job.plan.num_tokens} in the "
            "run's snapshot: the cache was rebuilt under the run"
        )
