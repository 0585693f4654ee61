"""One capture step: pad a job, run the truncated target, strip padding on the device, copy to host.

Shape legend: B = samples in the job, S = padded length, F = features per token,
N = real (unpadded) tokens of the job, W = elements of one host row (F bf16 values, or the fp8 row bytes).

The device never waits for the host: padding is stripped with an index computed on the host (no
boolean-mask sync), the non-finite check is a device reduction, and the features go to a pinned
host buffer with a non-blocking copy whose completion is an event the writer thread waits on.

For the fp8 codecs the rows are encoded here, on the device the features are on, before the copy:
encoding on the CPU in ``ShardWriter.add`` ran on the writer's serial path and halved generate's rate
on an H200 (bench/RESULTS.md, "The writer's serial path"), and the copy carries the
row bytes W (≈ 0.5 × the bf16 features) instead. CPU workers take the same path.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dflash_offline.cache.lossy import LossyLayout, encode_rows
from dflash_offline.generate.plan import CaptureJob


def bf16_elements(num_bytes: int) -> int:
    """The pool's bf16 elements that hold ``num_bytes`` (encoded fp8 rows use a buffer as bytes)."""
    return -(-num_bytes // 2)


class PinnedBufferPool:
    """A fixed set of reusable host buffers (page-locked on CUDA: 55 GB/s D2H vs 1.3 GB/s pageable,
    docs/facts.md#generate). The pool size bounds host memory whatever the data set size."""

    def __init__(self, *, num_buffers: int, elements: int, pin: bool) -> None:
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self.elements = elements
        for _ in range(num_buffers):
            self._free.put(torch.empty(elements, dtype=torch.bfloat16, pin_memory=pin))

    def acquire(self, elements: int) -> torch.Tensor:
        """A free buffer (blocking until one is released) of at least ``elements`` bf16 values."""
        buffer = self._free.get()
        if buffer.numel() < elements:
            # A job larger than planned for (a single over-budget sample): grow this buffer once.
            buffer = torch.empty(elements, dtype=torch.bfloat16, pin_memory=buffer.is_pinned())
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


@dataclass(frozen=True, kw_only=True, slots=True)
class CapturedBatch:
    """A job's features on the host, handed from the forward loop to the writer thread."""

    job: CaptureJob
    rows_NW: torch.Tensor
    """Host view (pinned on CUDA) of the features; sample i is rows offsets[i]:offsets[i+1]. bfloat16
    [N, F] when ``fp8`` is None, else uint8 [N, fp8.row_bytes]: the stored fp8 rows (``fp8.py``), with
    the rows of non-finite samples meaningless (those are counted in ``nonfinite_B``, never stored)."""
    fp8: LossyLayout | None
    """The layout ``rows_NW`` is encoded with, or None for bf16 features."""
    offsets: tuple[int, ...]
    """B + 1 token offsets into ``rows_NW``."""
    nonfinite_B: torch.Tensor
    """int32 [B] host: count of tokens with a NaN/Inf feature per sample."""
    ready: torch.cuda.Event | None
    """Recorded after the copies; the writer synchronises on it before reading (None on CPU)."""
    release: Callable[[], None]
    """Returns the host buffer to the pool once the writer has copied the rows."""

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass(frozen=True, kw_only=True, slots=True)
class PaddedInputs:
    """Host-side tensors of one job: right-padded ids, attention mask, and the strip index."""

    input_ids_BS: torch.Tensor
    attention_mask_BS: torch.Tensor
    keep_N: torch.Tensor
    """int64 [N]: flat positions b*S + t of real tokens, in sample order."""
    sample_of_N: torch.Tensor
    """int64 [N]: which sample each real token belongs to."""
    offsets: tuple[int, ...]


def pad_job(job: CaptureJob, *, pad_id: int) -> PaddedInputs:
    lengths = [s.num_tokens for s in job.samples]
    num_samples, seq_len = len(lengths), job.padded_length
    ids_BS = np.full((num_samples, seq_len), pad_id, dtype=np.int64)
    mask_BS = np.zeros((num_samples, seq_len), dtype=np.int64)
    keep: list[np.ndarray] = []
    owner: list[np.ndarray] = []
    for b, sample in enumerate(job.samples):
        length = lengths[b]
        ids_BS[b, :length] = sample.input_ids_T
        mask_BS[b, :length] = 1
        keep.append(b * seq_len + np.arange(length, dtype=np.int64))
        owner.append(np.full(length, b, dtype=np.int64))
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)]))
    return PaddedInputs(
        input_ids_BS=torch.from_numpy(ids_BS),
        attention_mask_BS=torch.from_numpy(mask_BS),
        keep_N=torch.from_numpy(np.concatenate(keep)),
        sample_of_N=torch.from_numpy(np.concatenate(owner)),
        offsets=offsets,
    )


def capture_job(
    capture: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    job: CaptureJob,
    *,
    device: torch.device,
    pool: PinnedBufferPool,
    pad_id: int,
    fp8: LossyLayout | None,
) -> CapturedBatch:
    """Run the target on one job and start the copy of its unpadded features (encoded as ``fp8`` rows
    on the device when given: the cache's layout, ``FeatureStorage.lossy``) to the host."""
    padded = pad_job(job, pad_id=pad_id)
    on_cuda = device.type == "cuda"
    ids_BS = padded.input_ids_BS.to(device, non_blocking=on_cuda)
    mask_BS = padded.attention_mask_BS.to(device, non_blocking=on_cuda)
    keep_N = padded.keep_N.to(device, non_blocking=on_cuda)
    sample_of_N = padded.sample_of_N.to(device, non_blocking=on_cuda)
    with torch.inference_mode():
        features_BSF = capture(ids_BS, mask_BS)
        num_features = features_BSF.shape[-1]
        # Cast before the check: what is stored is bf16, and a float32 value near its maximum can
        # round to inf.
        features_NF = features_BSF.reshape(-1, num_features).index_select(0, keep_N).to(torch.bfloat16)
        bad_N = (~torch.isfinite(features_NF)).any(dim=1).to(torch.int32)
        nonfinite_B = torch.zeros(len(job.samples), dtype=torch.int32, device=device)
        nonfinite_B.index_add_(0, sample_of_N, bad_N)
        if fp8 is None:
            rows_NW = features_NF
        else:
            # encode_rows' own finiteness check would wait for the device: zero the non-finite values
            # instead. Their samples are counted in nonfinite_B, recorded as failures by the writer
            # thread and never stored; rows are encoded token by token, so no other sample's rows change.
            finite_NF = torch.nan_to_num(features_NF, nan=0.0, posinf=0.0, neginf=0.0)
            rows_NW = encode_rows(finite_NF, fp8, check_finite=False)
    num_tokens, row_elements = rows_NW.shape
    # The pool's buffers are bf16; encoded rows use one as bytes (W bytes a row: half an element each).
    row_bytes = row_elements * rows_NW.element_size()
    buffer = pool.acquire(bf16_elements(num_tokens * row_bytes))
    host = buffer if fp8 is None else buffer.view(torch.uint8)
    host_NW = host[: num_tokens * row_elements].view(num_tokens, row_elements)
    host_NW.copy_(rows_NW, non_blocking=on_cuda)
    nonfinite_host_B = torch.empty(len(job.samples), dtype=torch.int32, pin_memory=on_cuda)
    nonfinite_host_B.copy_(nonfinite_B, non_blocking=on_cuda)
    ready: torch.cuda.Event | None = None
    if on_cuda:
        ready = torch.cuda.Event()
        ready.record()
    return CapturedBatch(
        job=job,
        rows_NW=host_NW,
        fp8=fp8,
        offsets=padded.offsets,
        nonfinite_B=nonfinite_host_B,
        ready=ready,
        release=lambda: pool.release(buffer),
    )
