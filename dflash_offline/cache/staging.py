"""The writer's staging records and the pool tasks that read them (``writer.py`` has the policy).

Shape legend: R = rows of a staging block.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from dflash_offline.cache.checksum import sample_checksum
from dflash_offline.cache.zarr_format import ArrayFormat, set_num_rows


@dataclass(frozen=True, kw_only=True, slots=True)
class StagingBuffers:
    """One set of staging buffers (rows of the three arrays)."""

    features_RF: np.ndarray
    ids_R: np.ndarray
    mask_R: np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """Shard-file writes and checksums in flight, and the staging buffers they read from."""

    futures: tuple[Future[int], ...]
    buffers: StagingBuffers
    checksums: tuple[ChecksumTask, ...]

    def done(self) -> bool:
        return all(f.done() for f in self.futures) and all(c.future.done() for c in self.checksums)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChecksumTask:
    """The checksums of consecutive staged samples, computed on the pool from a generation's buffers."""

    row_starts: tuple[int, ...]
    """Absolute first row of each sample (its key until commit)."""
    future: Future[list[int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedSample:
    """A sample whose rows are staged (possibly partly written) but not yet committed."""

    sample_id: str
    source_index: int
    row_start: int
    """Absolute first row in the shard group's arrays."""
    num_tokens: int
    num_loss_tokens: int
    bucket_id: int
    conversation_root: str | None
    """``SampleToWrite.conversation_root``."""


def set_num_rows_all(formats: tuple[ArrayFormat, ...], num_rows: int) -> int:
    for fmt in formats:
        set_num_rows(fmt, num_rows)
    return 0  # stored bytes, as a shard file's task returns


def new_buffers(capacity: int, width: int, dtype: np.dtype, *, touch_rows: int) -> StagingBuffers:
    """Staging buffers of ``capacity`` rows, the first ``touch_rows`` of them faulted in."""
    buffers = StagingBuffers(
        features_RF=np.empty((capacity, width), dtype=dtype),
        ids_R=np.empty(capacity, dtype=np.int32),
        mask_R=np.empty(capacity, dtype=np.uint8),
    )
    for array in (buffers.features_RF, buffers.ids_R, buffers.mask_R):
        array[:touch_rows].fill(0)  # faults those pages in now (numpy releases the GIL for the fill)
    return buffers


def checksum_samples(buffers: StagingBuffers, start: int, samples: Sequence[StagedSample]) -> list[int]:
    """``sample_checksum`` of each staged sample; row 0 of the buffers is absolute row ``start``."""
    crcs = []
    for s in samples:
        lo, hi = s.row_start - start, s.row_start - start + s.num_tokens
        crcs.append(sample_checksum(buffers.features_RF[lo:hi], buffers.ids_R[lo:hi], buffers.mask_R[lo:hi]))
    return crcs
