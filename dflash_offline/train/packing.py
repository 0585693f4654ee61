"""Packing a microbatch's samples into one row, in one host buffer, and a pool to reuse those buffers
(the prefetcher's: train/loader.py).

Shape legend: T = tokens of the packed row, F = features per token, D = documents (samples).

All per-token tensors of a packed microbatch are views into ONE uint8 buffer (each field 64-byte
aligned), so that the host-to-device transfer is a single copy and a pinned allocation is one block.

Why a pool on the CPU path: a packed row is tens of MB (8192 tokens × 5 × 576 × 2 B = 47 MB), above
glibc's largest mmap threshold (32 MB), so every fresh buffer is a new mapping whose pages fault in on
first write. On the 2-core development machine packing into fresh buffers ran at 0.4–1.5 GB/s and into
reused ones at 4–8 GB/s. A pooled buffer is handed out again only when no tensor outside the pool
still uses its storage (PyTorch's storage use count, the liveness test PyTorch's own CUDA-graph trees
use): a batch the consumer still holds, or any view of it, keeps its buffer out of the pool.
The CUDA path allocates pinned buffers instead; PyTorch's caching host allocator reuses those once the
copies that read them have finished."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_offline.cache.rows import CachedSample

_ALIGN = 64
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldSlot:
    """Where one tensor of a packed microbatch lives in its buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer (a multiple of 64)."""
    nbytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PackLayout:
    """The byte layout of one packed microbatch."""

    fields: tuple[FieldSlot, ...]
    nbytes: int
    """Buffer size needed."""

    def carve(self, buffer_B: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of ``buffer_B`` (uint8, on any device), one per field."""
        return {
            f.name: buffer_B[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in self.fields
        }


def pack_layout(
    num_tokens: int, num_documents: int, width: int, *, stored_width: int | None = None
) -> PackLayout:
    """``stored_width``: carry the features as W stored bytes a token (``stored_TW``, uint8 [T, W], an
    fp8 cache's rows, decoded on the device after the copy) instead of ``features_TF``."""
    features: tuple[str, torch.dtype, tuple[int, ...]] = (
        ("features_TF", torch.bfloat16, (num_tokens, width))
        if stored_width is None
        else ("stored_TW", torch.uint8, (num_tokens, stored_width))
    )
    specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = (
        features,
        ("input_ids_T", torch.int64, (num_tokens,)),
        ("loss_mask_T", torch.bool, (num_tokens,)),
        ("doc_ids_T", torch.int32, (num_tokens,)),
        ("positions_T", torch.int32, (num_tokens,)),
        ("cu_seqlens_D1", torch.int32, (num_documents + 1,)),
    )
    fields, offset = [], 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        fields.append(FieldSlot(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return PackLayout(fields=tuple(fields), nbytes=max(offset, _ALIGN))


def pack_into(
    samples: Sequence[CachedSample], buffer_B: torch.Tensor, layout: PackLayout
) -> dict[str, torch.Tensor]:
    """Concatenate ``samples`` into ``buffer_B`` (a CPU uint8 tensor of at least ``layout.nbytes``).

    Returns the ``PackedMicrobatch`` tensor fields except ``anchors_A``, as views of the buffer:
    features_TF bf16 [T, F], input_ids_T int64 [T], loss_mask_T bool [T], doc_ids_T int32 [T],
    positions_T int32 [T] (position inside its document), cu_seqlens_D1 int32 [D+1].
    """
    assert samples, "a microbatch holds at least one sample"
    out = layout.carve(buffer_B)
    lengths_D = np.asarray([s.num_tokens for s in samples], dtype=np.int64)
    starts_D = np.cumsum(lengths_D) - lengths_D
    num_tokens = int(lengths_D.sum())
    # numpy, not torch.cat/copy_: on the 2-core machine torch's copies of the reader's buffers ran at
    # 0.3–1 GB/s against 3–12 GB/s for numpy's memcpy (which releases the GIL too). bf16 moves as int16.
    if "stored_TW" in out:  # encoded rows (fp8), decoded on the device
        stored_TW = out["stored_TW"]
        parts = []
        for s in samples:
            assert s.stored_TW is not None, "a stored-bytes layout needs samples read with stored_out"
            parts.append(s.stored_TW)
        if not all(p.data_ptr() == stored_TW[st].data_ptr() for p, st in zip(parts, starts_D.tolist())):
            np.concatenate([p.numpy() for p in parts], axis=0, out=stored_TW.numpy())
    else:
        features_TF = out["features_TF"]
        in_place = all(
            s.features_TF.data_ptr() == features_TF[start].data_ptr()
            for s, start in zip(samples, starts_D.tolist())
        )
        if not in_place:  # else the reader decoded straight into the buffer (``features_out``)
            np.concatenate(
                [s.features_TF.view(torch.int16).numpy() for s in samples],
                axis=0,
                out=features_TF.view(torch.int16).numpy(),
            )
    np.concatenate([s.input_ids_T.numpy() for s in samples], out=out["input_ids_T"].numpy(), casting="safe")
    mask_T = out["loss_mask_T"].view(torch.uint8).numpy()
    np.concatenate([s.loss_mask_T.numpy() for s in samples], out=mask_T, casting="safe")
    np.minimum(mask_T, 1, out=mask_T)  # a bool tensor must hold 0/1 bytes whatever the cache holds
    out["doc_ids_T"].numpy()[:] = np.repeat(np.arange(len(samples), dtype=np.int32), lengths_D)
    out["positions_T"].numpy()[:] = np.arange(num_tokens, dtype=np.int64) - np.repeat(starts_D, lengths_D)
    cu_seqlens_D1 = out["cu_seqlens_D1"].numpy()
    cu_seqlens_D1[0] = 0
    np.cumsum(lengths_D, out=cu_seqlens_D1[1:], dtype=np.int32)
    return out


class HostBufferPool:
    """A few reusable CPU uint8 buffers; ``take`` hands out one that nothing else uses any more.

    Thread-safe. Holds at most ``max_buffers``; when all are in use a fresh, unpooled buffer is returned
    (memory stays bounded by the pool plus what the consumer holds). Without PyTorch's storage use
    count (a private API) every ``take`` is a fresh buffer.
    """

    def __init__(self, max_buffers: int) -> None:
        self._max = max_buffers if _storage_use_count is not None else 0
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._idle_count: list[int] = []  # use count of each buffer when only the pool holds it
        self.num_allocations = 0
        """Buffers allocated so far (pooled or not): stays near max_buffers when reuse works."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 [nbytes] view of a free buffer (the view itself marks the buffer as in use)."""
        with self._lock:
            free = [i for i, buf in enumerate(self._buffers) if self._is_idle(i)]
            fitting = [i for i in free if self._buffers[i].numel() >= nbytes]
            if fitting:
                best = min(fitting, key=lambda i: self._buffers[i].numel())
                return self._buffers[best][:nbytes]  # created under the lock: others see it in use
            self.num_allocations += 1
            # As large as the largest buffer so far (microbatches are packed up to one token budget, so
            # sizes converge at once), with headroom for the next slightly larger one.
            largest = max((buf.numel() for buf in self._buffers), default=0)
            buffer = torch.empty(max(nbytes + nbytes // 8, largest), dtype=torch.uint8)
            if len(self._buffers) >= self._max and free:
                smallest = min(free, key=lambda i: self._buffers[i].numel())
                self._buffers.pop(smallest)
                self._idle_count.pop(smallest)
            if len(self._buffers) < self._max:
                self._buffers.append(buffer)
                self._idle_count.append(self._use_count(buffer))
            return buffer[:nbytes]

    def _is_idle(self, i: int) -> bool:
        return self._use_count(self._buffers[i]) == self._idle_count[i]

    @staticmethod
    def _use_count(buffer: torch.Tensor) -> int:
        assert _storage_use_count is not None
        return int(_storage_use_count(buffer.untyped_storage()._cdata))
