"""``ShardWriter``: one writer session appending samples to its own Zarr group, then committing them.

Shape legend: T = tokens of one sample, F = features per token, R = rows of the staging block.

Flush policy (never a read-modify-write of a shard): rows are staged in RAM from a shard boundary
(``block_start``). When at least one shard's worth is staged, the whole shards are written, each as a
new shard file of every array (``shard_file.py``; zarr-python only creates the group's metadata); a
sample that straddles the last written boundary keeps its tail staged, and the next write starts
exactly at that boundary. ``flush()`` (explicit, once ``flush_seconds`` have
passed since the last commit or ``flush_bytes`` of samples wait uncommitted, or on ``close()``)
writes everything staged, the last shard partial,
commits every written sample in one manifest part, and moves the next block to the NEXT shard
boundary: the rows in between are a gap that is never stored. Every shard file is written once.

Commit rule: the Parquet part naming a sample is renamed into ``manifest/samples/`` only after every
shard file holding its rows has been renamed into place (and fsynced, with its folders, when
``fsync=True``).
A crash leaves unreferenced bytes, never a row that points at missing data.
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import re
import secrets
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from dflash_offline.cache.codecs import raw_token_bytes
from dflash_offline.cache.commit_policy import DEFAULT_FLUSH_BYTES, DEFAULT_FLUSH_SECONDS
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import CacheLayout, create_or_open_cache, fsync_dir
from dflash_offline.cache.lossy import encode_rows
from dflash_offline.cache.manifest import (
    committed_sample_ids,
    failed_sample_ids,
    record_run,
    records_to_table,
    write_part,
)
from dflash_offline.cache.rows import (
    FailureRow,
    Fp8Rows,
    SampleRow,
    SampleToWrite,
    ShardInfo,
    WriterStats,
    utc_now,
)
from dflash_offline.cache.shard_file import write_shard_file
from dflash_offline.cache.staging import (
    ChecksumTask,
    Generation,
    StagedSample,
    StagingBuffers,
    checksum_samples,
    new_buffers,
    set_num_rows_all,
)
from dflash_offline.cache.zarr_format import ARRAYS, create_shard_group
from dflash_offline.errors import CacheFormatError, SampleError

__all__ = ["ShardWriter", "committed_sample_ids", "failed_sample_ids", "new_session_id", "record_run"]

MIB = 1 << 20
DEFAULT_CHUNK_BYTES = MIB
"""Inner chunk ≈ 1 MiB: compression needs ≥ 1 MB to reach its ratio (docs/facts.md#compression)."""
DEFAULT_SHARD_BYTES = 32 * MIB
"""One shard file ≈ 32 MiB: few files, and a whole-shard write amortises zarr's per-call overhead."""
_SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def new_session_id() -> str:
    """A fresh session id: UTC time (sortable) plus random hex (unique across hosts)."""
    return f"{utc_now():%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def shard_geometry(
    feature_width: int, *, chunk_bytes: int, shard_bytes: int, row_bytes: int | None = None
) -> tuple[int, int]:
    """(chunk_rows, shard_rows): an inner chunk of at least ``chunk_bytes`` and a shard of about
    ``shard_bytes`` (a whole number of chunks). ``row_bytes``: stored feature bytes a token (default
    bf16's 2 × feature_width)."""
    row_bytes = feature_width * 2 if row_bytes is None else row_bytes
    chunk_rows = max(1, math.ceil(chunk_bytes / row_bytes))
    chunks_per_shard = max(1, round(shard_bytes / (chunk_rows * row_bytes)))
    return chunk_rows, chunk_rows * chunks_per_shard


def shard_name(worker: int, session: str) -> str:
    """The shard (store) a worker's writer session writes: ``w<worker>-<session>``."""
    return f"w{worker:03d}-{session}"


class ShardWriter:
    """Append-only writer of one session's shard group. Not thread-safe: one thread owns it."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: CacheFingerprint,
        *,
        worker: int,
        session: str | None = None,
        fsync: bool = False,
        flush_seconds: float = DEFAULT_FLUSH_SECONDS,
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        known_sample_ids: Collection[str] | None = None,
        encode_threads: int | None = None,
    ) -> None:
        self.layout: CacheLayout = create_or_open_cache(root, fingerprint)
        self.fingerprint = fingerprint
        self.worker = int(worker)
        self.session = session or new_session_id()
        if not _SESSION_RE.match(self.session):
            raise SampleError(
                f"session {self.session!r} must be letters, digits, '_', '.', '-' (it names files)"
            )
        self.shard = shard_name(self.worker, self.session)
        self.fsync = fsync
        if flush_seconds < 0 or flush_bytes < 1:
            raise SampleError(
                f"flush_seconds {flush_seconds} must be >= 0 and flush_bytes {flush_bytes} >= 1"
            )
        self.flush_seconds = flush_seconds
        self.flush_bytes = int(flush_bytes)
        self.feature_width = fingerprint.feature_width
        self.storage = fingerprint.storage
        self.chunk_rows, self.shard_rows = shard_geometry(
            self.feature_width,
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            row_bytes=self.storage.row_bytes,
        )
        # Read before anything of this session is created: a manifest that cannot be read stops us early.
        self._known = set(committed_sample_ids(root) if known_sample_ids is None else known_sample_ids)
        self._create_group()
        self._init_staging(encode_threads)

    def _create_group(self) -> None:
        """Create this session's shard group and commit its ``ShardInfo`` (fsynced when asked)."""
        group = self.layout.shard_group(self.shard)
        if group.exists():
            raise CacheFormatError(
                f"shard group {group} already exists: each writer session needs a new session id"
            )
        self._group = group
        self._formats = create_shard_group(
            group,
            storage=self.storage,
            chunk_rows=self.chunk_rows,
            shard_rows=self.shard_rows,
            attributes={"shard": self.shard, "worker": self.worker, "session": self.session},
        )
        created_at = utc_now()
        self.info = ShardInfo(
            shard=self.shard,
            worker=self.worker,
            session=self.session,
            feature_width=self.feature_width,
            chunk_rows=self.chunk_rows,
            shard_rows=self.shard_rows,
            codec=self.fingerprint.codec,
            created_at=created_at,
        )
        if self.fsync:
            self._fsync_tree(group)
        write_part(
            self.layout.table_dir("shards") / f"{self.shard}.parquet",
            records_to_table("shards", [self.info]),
            fsync=self.fsync,
        )

    def _init_staging(self, encode_threads: int | None) -> None:
        """The empty staging block, the bookkeeping of uncommitted rows and the shard-file pool."""
        # Staging block: rows [block_start, next_row) of the arrays, held in RAM until written.
        self._block_start = 0
        self._next_row = 0
        capacity = self.shard_rows * 2
        self._features_RF = np.empty((capacity, self.storage.width), dtype=self.storage.dtype)
        self._ids_R = np.empty(capacity, dtype=np.int32)
        self._mask_R = np.empty(capacity, dtype=np.uint8)
        self._staged: list[StagedSample] = []  # rows staged in RAM (the first may be partly written)
        self._written: list[StagedSample] = []  # every row written, not yet committed
        self._checksummed_upto = 0  # absolute row: every sample staged below it has a checksum (task)
        self._checksums: dict[int, int] = {}  # row_start -> checksum, of samples not yet committed
        self._unsynced: set[Path] = set()  # shard files written since the last commit
        self._failures: list[FailureRow] = []
        self._written_rows = 0  # rows of the arrays as resized so far
        self._part = 0
        self._last_commit = time.monotonic()
        self._uncommitted_bytes = 0  # raw bytes of samples added since the last commit
        self._closed = False
        self._stats = dict(
            samples=0, tokens=0, loss_tokens=0, raw_bytes=0, stored_bytes=0, failures=0, flushes=0
        )
        # Shard files are encoded and written on a pool (numcodecs releases the GIL), each shard a task
        # of its own, so that the caller's thread only stages rows: measured on an H200 host, the
        # writer thread encoding shard after shard (8 threads inside a shard) was busy 85 % of the
        # time at 0.6 GB/s, the bottleneck of generate. Commits wait for every task they cover.
        # Two cores stay free for the caller's threads (a GPU worker's forward loop and its writer).
        self._threads = encode_threads or min(16, max(1, (os.cpu_count() or 1) - 2))
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self._threads, thread_name_prefix="dflash-shard"
        )
        self._meta_pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="dflash-shape")
        # Each write hands the staging buffers themselves to its tasks (no copy, no fresh pages: new
        # memory faults in at only 1-5 GB/s on these VMs) and staging continues in spare buffers;
        # a generation's buffers become spare again once its shard files are written.
        self._generations: collections.deque[Generation] = collections.deque()
        self._spare: list[StagingBuffers] = []
        self._prefaulted: Future[StagingBuffers] | None = None
        self._buffer_sets = 1  # staging buffer sets allocated so far

    # ----------------------------------------------------------------------------------------------
    @property
    def stats(self) -> WriterStats:
        return WriterStats(shard=self.shard, **self._stats)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        # The caller failed: still commit what was validated, but never hide the original error.
        try:
            self.close()
        except Exception as close_error:
            exc.add_note(f"and closing shard writer {self.shard} failed too: {close_error!r}")

    # ----------------------------------------------------------------------------------------------
    def _validate(self, sample: SampleToWrite) -> tuple[np.ndarray, np.ndarray]:
        where = f"sample {sample.sample_id!r} (source_index {sample.source_index})"
        if not isinstance(sample.sample_id, str) or not sample.sample_id:
            raise SampleError(f"{where}: sample_id must be a non-empty string")
        if sample.fp8_rows is not None:
            self._validate_fp8_rows(sample.fp8_rows, where)
        else:
            assert sample.features_TF is not None  # SampleToWrite holds exactly one of the two
            width = int(sample.features_TF.shape[1])
            if width != self.feature_width:
                raise SampleError(
                    f"{where}: features are {width} wide, the cache stores {self.feature_width} "
                    f"({len(self.fingerprint.layer_ids)} layers × hidden {self.fingerprint.hidden_size}); "
                    f"capture the layers in the fingerprint or write to another cache"
                )
        if sample.sample_id in self._known:
            raise SampleError(f"{where}: sample_id is already in the cache; skip committed ids when resuming")
        ids = np.asarray(sample.input_ids_T)
        if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max)):
            raise SampleError(
                f"{where}: input_ids must be non-negative integers that fit int32 (got {ids.dtype})"
            )
        mask = np.asarray(sample.loss_mask_T)
        if mask.dtype.kind not in "biu" or (mask.size and mask.max() > 1):
            raise SampleError(f"{where}: loss_mask must hold 0/1 values (got dtype {mask.dtype})")
        expected_bucket = bisect.bisect_left(self.fingerprint.bucket_edges, sample.num_tokens)
        if sample.bucket_id != expected_bucket:
            raise SampleError(
                f"{where}: bucket_id {sample.bucket_id} but {sample.num_tokens} tokens fall in bucket "
                f"{expected_bucket} of edges {list(self.fingerprint.bucket_edges)}"
            )
        return ids.astype(np.int32, copy=False), mask.astype(np.uint8, copy=False)

    def _validate_fp8_rows(self, rows: Fp8Rows, where: str) -> None:
        """Pre-encoded rows are stored as they are: only into a lossy cache of exactly their layout (two
        layouts can share a row width, e.g. 1 scale + 2 outliers against 9 scale groups a layer)."""
        if self.storage.lossy is None:
            raise SampleError(
                f"{where}: pre-encoded rows, but this cache's codec {self.fingerprint.codec!r} stores "
                f"bf16 features; hand the features over as features_TF"
            )
        if rows.layout != self.storage.lossy:
            raise SampleError(
                f"{where}: rows encoded with {rows.layout}, this cache ({self.fingerprint.codec!r}) "
                f"stores {self.storage.lossy}; encode with the cache's layout (CacheFingerprint.storage)"
            )
        rows.check(where, int(rows.rows_TW.shape[0]))  # as built, unless the tensor changed since

    def _reserve(self, rows: int) -> None:
        capacity = self._features_RF.shape[0]
        if rows <= capacity:
            return
        new_capacity = max(rows, 2 * capacity)
        used = self._next_row - self._block_start
        for name in ("_features_RF", "_ids_R", "_mask_R"):
            old = getattr(self, name)
            new = np.empty((new_capacity, *old.shape[1:]), dtype=old.dtype)
            new[:used] = old[:used]
            setattr(self, name, new)

    def add(self, sample: SampleToWrite) -> None:
        """Validate and stage one sample (nothing is written for an invalid one). Whole shards are
        written as soon as a shard's worth is staged; they are committed (one manifest part) by the
        next ``flush()``, which happens by itself once ``flush_seconds`` have passed since the last
        commit, so that a long run produces a few parts per worker and minute, not one per shard."""
        if self._closed:
            raise SampleError(f"shard writer {self.shard} is closed")
        ids_T, mask_T = self._validate(sample)
        num_tokens = sample.num_tokens
        offset = self._next_row - self._block_start
        self._reserve(offset + num_tokens)
        # Copy now: the caller may reuse its (pinned) buffer as soon as add() returns.
        features_TF = self._features_RF[offset : offset + num_tokens]
        # The stored (and checksummed) bytes: bf16 bits, or for the lossy codecs the fp8 rows.
        if sample.fp8_rows is not None:  # encoded where the features were (generate's capture step)
            features_TF[:] = sample.fp8_rows.rows_TW.numpy()
        else:
            assert sample.features_TF is not None
            if self.storage.lossy is not None:
                # Encoded here, on the caller's thread: ≈ 34k tokens/s a core for 5 × 576 features, which
                # is why generate hands over rows encoded on its device (bench/RESULTS.md, "The
                # writer's serial path").
                where = f"sample {sample.sample_id!r} (source_index {sample.source_index})"
                encoded = encode_rows(sample.features_TF.detach(), self.storage.lossy, where=where)
                features_TF[:] = encoded.numpy()
            else:
                features_TF[:] = sample.features_TF.detach().view(torch.uint16).numpy()
        self._ids_R[offset : offset + num_tokens] = ids_T
        self._mask_R[offset : offset + num_tokens] = mask_T
        self._staged.append(
            StagedSample(
                sample_id=sample.sample_id,
                source_index=int(sample.source_index),
                row_start=self._next_row,
                num_tokens=num_tokens,
                num_loss_tokens=int(np.count_nonzero(mask_T)),
                bucket_id=int(sample.bucket_id),
                conversation_root=sample.conversation_root,
            )
        )
        self._known.add(sample.sample_id)
        self._next_row += num_tokens
        self._uncommitted_bytes += num_tokens * raw_token_bytes(self.feature_width)
        staged_rows = self._next_row - self._block_start
        if staged_rows >= self.shard_rows // 2:  # a session that fills half a shard will swap buffers
            self._prefault_next(self._features_RF.shape[0])
        if staged_rows >= self.shard_rows:
            self._write(whole_shards_only=True)
        self._maybe_flush()

    def add_failure(self, *, sample_id: str, source_index: int, reason: str, detail: str) -> None:
        """Record a sample that could not be cached; committed with the next manifest part."""
        if self._closed:
            raise SampleError(f"shard writer {self.shard} is closed")
        self._failures.append(
            FailureRow(
                sample_id=sample_id,
                source_index=int(source_index),
                reason=reason,
                detail=detail,
                worker=self.worker,
                session=self.session,
                created_at=utc_now(),
            )
        )
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if (
            self._uncommitted_bytes >= self.flush_bytes
            or time.monotonic() - self._last_commit >= self.flush_seconds
        ):
            self.flush()

    @property
    def has_uncommitted(self) -> bool:
        """Samples or failures were added that no manifest part names yet."""
        return bool(self._staged or self._written or self._failures)

    def flush(self) -> list[SampleRow]:
        """Write every staged row (the last shard partial), fsync if asked, then commit one manifest
        part; returns the rows committed. The next sample starts at the next shard boundary."""
        if self._closed:
            return []
        self._write(whole_shards_only=False)
        return self._commit()

    def close(self) -> WriterStats:
        """Flush and close; idempotent."""
        try:
            if not self._closed:
                self.flush()
                self._closed = True
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._meta_pool is not None:
                self._meta_pool.shutdown(wait=True)
                self._meta_pool = None
        return self.stats

    # ----------------------------------------------------------------------------------------------
    def _write(self, *, whole_shards_only: bool) -> None:
        try:
            self._write_unguarded(whole_shards_only=whole_shards_only)
        except BaseException:
            # A failed write may have left part of a shard on disk: never write to this group again
            # (a retry would rewrite a shard). Committed rows stay valid; start a new session to go on.
            self._closed = True
            raise

    def _write_unguarded(self, *, whole_shards_only: bool) -> None:
        start, end = self._block_start, self._next_row
        if whole_shards_only:
            stop = start + (end - start) // self.shard_rows * self.shard_rows
        else:
            stop = end
        futures = self._write_rows(start, stop) if stop > start else ()
        # Every staged sample is whole in the current buffers (a straddling one too): checksum it now.
        checksums = self._checksum_staged(start, on_pool=bool(futures))
        done = 0
        while (
            done < len(self._staged) and self._staged[done].row_start + self._staged[done].num_tokens <= stop
        ):
            done += 1
        self._written += self._staged[:done]
        self._staged = self._staged[done:]
        tail, used = end - stop, stop - start
        if futures:
            old = StagingBuffers(features_RF=self._features_RF, ids_R=self._ids_R, mask_R=self._mask_R)
            self._generations.append(Generation(futures=futures, buffers=old, checksums=checksums))
            new = self._spare_buffers(old.features_RF.shape[0])
            for src, dst in zip(
                (old.features_RF, old.ids_R, old.mask_R),
                (new.features_RF, new.ids_R, new.mask_R),
                strict=True,
            ):
                dst[:tail] = src[used : used + tail]
            self._features_RF, self._ids_R, self._mask_R = new.features_RF, new.ids_R, new.mask_R
            while len(self._generations) > self._threads:  # bound the memory held by queued writes
                self._finish_generation()
            self._prefault_next(new.features_RF.shape[0])
        if whole_shards_only:
            # The tail (rows of samples straddling `stop`) stays staged; the next write starts at `stop`.
            self._block_start = stop
        else:
            assert not self._staged
            self._block_start = self._next_row = math.ceil(end / self.shard_rows) * self.shard_rows

    def _write_rows(self, start: int, stop: int) -> tuple[Future[int], ...]:
        """Queue rows [start, stop) (start on a shard boundary) as new shard files of every array; the
        tasks read the staging buffers, which the caller must not touch until they are done."""
        assert start % self.shard_rows == 0
        staged: dict[str, np.ndarray] = {
            "features": self._features_RF,
            "input_ids": self._ids_R,
            "loss_mask": self._mask_R,
        }
        assert self._pool is not None
        futures = []
        for index in range(start // self.shard_rows, (stop - 1) // self.shard_rows + 1):
            lo, hi = index * self.shard_rows, min(stop, (index + 1) * self.shard_rows)
            for name in ARRAYS:
                fmt = self._formats[name]
                rows = staged[name][lo - start : hi - start]
                futures.append(self._pool.submit(write_shard_file, fmt, index, rows, pool=None, fsync=False))
                self._unsynced.add(fmt.shard_path(index))
        if stop > self._written_rows:  # the shape other readers bound their reads by; never trusted here
            # On a thread of its own, in order (a smaller shape never lands after a larger one): three
            # zarr.json rewrites took longer than staging the shard they describe.
            assert self._meta_pool is not None
            futures.append(
                self._meta_pool.submit(set_num_rows_all, tuple(self._formats[n] for n in ARRAYS), stop)
            )
            self._written_rows = stop
        return tuple(futures)

    def _checksum_staged(self, start: int, *, on_pool: bool) -> tuple[ChecksumTask, ...]:
        """Checksum the staged samples not yet checksummed (rows from absolute row ``start`` in the
        current buffers): on the pool, in up to one task per thread, when the buffers are about to be
        handed to a generation (which keeps them until its tasks are done); else here and now.
        Off the caller's thread, crc32c (≈ 12 GB/s a core, GIL released) no longer adds to add()."""
        pending = [s for s in self._staged if s.row_start >= self._checksummed_upto]
        if not pending:
            return ()
        self._checksummed_upto = pending[-1].row_start + pending[-1].num_tokens
        buffers = StagingBuffers(features_RF=self._features_RF, ids_R=self._ids_R, mask_R=self._mask_R)
        if not on_pool:
            for s, crc in zip(pending, checksum_samples(buffers, start, pending), strict=True):
                self._checksums[s.row_start] = crc
            return ()
        assert self._pool is not None
        per_task = max(self.chunk_rows, sum(s.num_tokens for s in pending) // self._threads)
        tasks, first, rows = [], 0, 0
        for i, s in enumerate(pending):
            rows += s.num_tokens
            if rows >= per_task or i == len(pending) - 1:
                samples = tuple(pending[first : i + 1])
                future = self._pool.submit(checksum_samples, buffers, start, samples)
                row_starts = tuple(p.row_start for p in samples)
                tasks.append(ChecksumTask(row_starts=row_starts, future=future))
                first, rows = i + 1, 0
        return tuple(tasks)

    def _spare_buffers(self, capacity: int) -> StagingBuffers:
        """Staging buffers of at least ``capacity`` rows: a finished generation's, else new ones."""
        while self._generations and self._generations[0].done():
            self._finish_generation()
        while self._spare:
            buffers = self._spare.pop()
            if buffers.features_RF.shape[0] >= capacity:
                return buffers
        if self._prefaulted is not None:
            buffers, self._prefaulted = self._prefaulted.result(), None
            if buffers.features_RF.shape[0] >= capacity:
                return buffers
        self._buffer_sets += 1
        return new_buffers(capacity, self.storage.width, self.storage.dtype, touch_rows=0)

    def _prefault_next(self, capacity: int) -> None:
        """Have the pool allocate and touch the next staging buffers while none is spare: fresh pages
        fault in at 0.4 GB/s on the development machine (1-5 GB/s on the H200 VMs), against ≈ 10 GB/s
        for the copy into a touched buffer, and the first ``threads + 2`` sets are all fresh. Never
        more sets than the writer can hold at once (``threads`` generations, the current, one spare), and
        only the first shard's rows touched (staging fills one shard plus a straddling tail)."""
        if self._spare or self._prefaulted is not None or self._buffer_sets >= self._threads + 2:
            return
        assert self._pool is not None
        self._buffer_sets += 1
        self._prefaulted = self._pool.submit(
            new_buffers, capacity, self.storage.width, self.storage.dtype, touch_rows=self.shard_rows
        )

    def _finish_generation(self) -> None:
        """Wait for the oldest queued writes; their buffers become spare (re-raises a failed write)."""
        generation = self._generations.popleft()
        try:
            for future in generation.futures:
                self._stats["stored_bytes"] += future.result()
            for task in generation.checksums:
                self._checksums.update(zip(task.row_starts, task.future.result(), strict=True))
        except BaseException:
            self._closed = True  # as in _write: never write to this group again
            raise
        self._spare.append(generation.buffers)

    def _sync_written(self) -> None:
        """fsync every shard file written since the last commit, the folders naming them, and the
        arrays' zarr.json (their resized shape)."""
        folders = {path.parent for path in self._unsynced}
        for path in sorted(self._unsynced):
            _fsync_file(path)
        for name in ARRAYS:
            _fsync_file(self._group / name / "zarr.json")
            folders |= {self._group / name / "c", self._group / name}
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(folder)
        self._unsynced.clear()

    def _wait_for_writes(self) -> None:
        """Block until every queued shard file is written (re-raising a failed write)."""
        while self._generations:
            self._finish_generation()

    def _commit(self) -> list[SampleRow]:
        """Commit the written samples and the failures: one manifest part each (data first)."""
        self._wait_for_writes()
        written, failures = self._written, self._failures
        if not written and not failures:
            return []
        if self.fsync and self._unsynced:
            self._sync_written()
        self._unsynced.clear()
        now = utc_now()
        rows = [
            SampleRow(
                sample_id=s.sample_id,
                source_index=s.source_index,
                shard=self.shard,
                row_start=s.row_start,
                num_tokens=s.num_tokens,
                num_loss_tokens=s.num_loss_tokens,
                bucket_id=s.bucket_id,
                checksum=self._checksums.pop(s.row_start),
                worker=self.worker,
                session=self.session,
                created_at=now,
                conversation_root=s.conversation_root,
            )
            for s in written
        ]
        if rows:
            path = self.layout.part_path("samples", self.shard, self._part)
            write_part(path, records_to_table("samples", rows), fsync=self.fsync)
        if failures:
            path = self.layout.part_path("failures", self.shard, self._part)
            write_part(path, records_to_table("failures", failures), fsync=self.fsync)
        self._written, self._failures = [], []
        self._part += 1
        self._last_commit = time.monotonic()
        self._uncommitted_bytes = 0
        tokens = sum(r.num_tokens for r in rows)
        stats = self._stats
        stats["samples"] += len(rows)
        stats["tokens"] += tokens
        stats["loss_tokens"] += sum(r.num_loss_tokens for r in rows)
        stats["raw_bytes"] += tokens * raw_token_bytes(self.feature_width)
        stats["failures"] += len(failures)
        stats["flushes"] += 1
        return rows

    def _fsync_tree(self, folder: Path) -> None:
        for dirpath, _dirnames, filenames in os.walk(folder):
            for name in filenames:
                _fsync_file(Path(dirpath) / name)
            fsync_dir(Path(dirpath))
        fsync_dir(folder.parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
