"""The writer thread of a target worker: waits for a batch's copy, then appends its samples.

The forward loop and the writer meet at a bounded queue: when encoding or disk is slower than the
target, ``submit`` blocks (back-pressure) instead of letting host memory grow. An exception in the
thread is kept and re-raised in the forward loop at the next ``submit`` or at ``close``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_offline.cache.rolling import RollingWriter
from dflash_offline.cache.rows import Fp8Rows, SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.errors import WorkerError
from dflash_offline.generate.capture_step import CapturedBatch
from dflash_offline.generate.plan import bucket_of


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchWritten:
    """What the writer did with one captured batch (reported to the coordinator)."""

    job_index: int
    new_samples: int
    new_tokens: int
    failures: int


_STOP = object()


class WriterThread:
    """Consumes ``CapturedBatch`` records in order and appends their new samples to a ``ShardWriter``."""

    def __init__(
        self,
        writer: ShardWriter | RollingWriter,
        *,
        bucket_edges: tuple[int, ...],
        depth: int,
        on_written: Callable[[BatchWritten], None],
        idle_flush_seconds: float | None = None,
    ) -> None:
        self._writer = writer
        # Under a disk window a worker may get no job for long (the window is full): what it staged
        # must then be committed by itself, or the planner would wait for it forever.
        self._idle_flush_seconds = idle_flush_seconds
        self._bucket_edges = bucket_edges
        self._on_written = on_written
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._error_traceback = ""
        self.busy_seconds = 0.0
        self.blocked_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=f"writer-{writer.shard}", daemon=True)
        self._thread.start()

    def submit(self, batch: CapturedBatch) -> None:
        """Queue a batch; blocks while ``depth`` batches are already waiting."""
        self._raise_if_failed()
        start = time.perf_counter()
        while True:
            try:
                self._queue.put(batch, timeout=0.5)
                break
            except queue.Full:
                self._raise_if_failed()
        self.blocked_seconds += time.perf_counter() - start

    def close(self) -> None:
        """Write everything queued, stop the thread, and re-raise its error if it had one."""
        if self._thread.is_alive():
            while self._thread.is_alive():
                try:
                    self._queue.put(_STOP, timeout=0.5)
                    break
                except queue.Full:
                    continue
            self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WorkerError(f"the writer thread failed:\n{self._error_traceback}") from self._error

    def _run(self) -> None:
        import traceback

        while True:
            try:
                item = self._queue.get(timeout=self._idle_flush_seconds)
            except queue.Empty:
                self._flush_idle(traceback)
                continue
            if item is _STOP:
                return
            assert isinstance(item, CapturedBatch)
            if self._error is not None:
                item.release()  # keep draining so that submit() never blocks on a dead thread
                continue
            try:
                start = time.perf_counter()
                result = self._write(item)
                self.busy_seconds += time.perf_counter() - start
                self._on_written(result)
            except BaseException as e:
                self._error = e
                self._error_traceback = traceback.format_exc()

    def _flush_idle(self, traceback: Any) -> None:
        if self._error is not None or not isinstance(self._writer, RollingWriter):
            return
        try:
            self._writer.flush_idle()
        except BaseException as e:
            self._error = e
            self._error_traceback = traceback.format_exc()

    def _write(self, batch: CapturedBatch) -> BatchWritten:
        batch.wait()
        new_samples = new_tokens = failures = 0
        try:
            nonfinite = batch.nonfinite_B.tolist()
            for i, sample in enumerate(batch.job.samples):
                if batch.job.already_done[i]:
                    continue  # committed (or failed) in an earlier session: computed only for batching
                if nonfinite[i]:
                    self._writer.add_failure(
                        sample_id=sample.sample_id,
                        source_index=sample.source_index,
                        reason="nonfinite_features",
                        detail=f"{nonfinite[i]} of {sample.num_tokens} tokens have a NaN or Inf feature",
                    )
                    failures += 1
                    continue
                rows_TW = batch.rows_NW[batch.offsets[i] : batch.offsets[i + 1]]
                self._writer.add(
                    SampleToWrite(
                        sample_id=sample.sample_id,
                        source_index=sample.source_index,
                        input_ids_T=sample.input_ids_T,
                        loss_mask_T=sample.loss_mask_T,
                        features_TF=rows_TW if batch.fp8 is None else None,
                        fp8_rows=None if batch.fp8 is None else Fp8Rows(layout=batch.fp8, rows_TW=rows_TW),
                        bucket_id=bucket_of(sample.num_tokens, self._bucket_edges),
                        conversation_root=sample.conversation_root,
                    )
                )
                new_samples += 1
                new_tokens += sample.num_tokens
        finally:
            batch.release()  # add() copied the rows: the pinned buffer can be reused
        return BatchWritten(
            job_index=batch.job.job_index, new_samples=new_samples, new_tokens=new_tokens, failures=failures
        )
