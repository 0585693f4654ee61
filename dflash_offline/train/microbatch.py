"""Records of the training data path: what the planner plans and what the prefetcher hands the loop.

Shape legend: T = tokens of one packed microbatch (its documents concatenated in one row),
F = features per token (num_layers * hidden_size), A = anchors of the microbatch, D = documents
(samples) in the microbatch.

Flow: ``LengthMixingPlanner`` -> ``StepPlan`` (one optimizer step, every rank's microbatches)
-> ``schedule_for_rank`` -> ``ScheduledMicrobatch`` (one rank's microbatch bound to the reader's rows,
with its anchor seed) -> ``Prefetcher`` -> ``PackedMicrobatch`` (the drafter's ``DrafterInputs`` on the
training device) -> ``RankSteps.regroup`` -> the loop, one step's microbatches at a time.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch

from dflash_offline.drafter.batch import DrafterInputs

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True, slots=True)
class MicrobatchPlan:
    """One microbatch of one optimizer step: samples of one bucket packed under the token budget (or, fused,
    a rank's microbatches of the step one after the other in one row: ``fuse_step``)."""

    index_in_step: int
    """Position of this microbatch among the step's ``grad_accum × world_size`` microbatches."""
    rank: int
    """Data-parallel rank that runs it."""
    rows: tuple[int, ...]
    """Positions of its samples in the ``IndexSnapshot`` (not rows of the reader's table: see
    ``schedule_for_rank``)."""
    sample_ids: tuple[str, ...]
    """The samples' ids, in packing order (the order of the documents in the packed row)."""
    bucket_ids: tuple[int, ...]
    """Bucket of each sample (all equal: a microbatch packs one bucket; several buckets when fused)."""
    num_tokens: int
    """Sum of the samples' token counts (≤ tokens_per_microbatch)."""
    is_padding: bool = False
    """True for a filler microbatch that repeats a real sample only so that every rank runs the same number
    of backward passes in an epoch's last step: the loop must give it zero loss weight."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """One optimizer step: the microbatches of every rank."""

    epoch: int
    step_in_epoch: int
    global_step: int
    """Optimizer steps before this one since training started (counts across resumes and epochs)."""
    num_steps_in_epoch: int
    """Steps in this epoch (the last one has ``step_in_epoch == num_steps_in_epoch - 1``)."""
    num_microbatches_per_rank: int
    """grad_accum, except possibly in an epoch's last step (fewer, equal on every rank)."""
    microbatches: tuple[MicrobatchPlan, ...]
    """world_size × num_microbatches_per_rank microbatches, ordered by (rank, position on that rank)."""

    def for_rank(self, rank: int) -> tuple[MicrobatchPlan, ...]:
        """This rank's microbatches (``num_microbatches_per_rank`` of them), in the order to run them."""
        return tuple(mb for mb in self.microbatches if mb.rank == rank)

    @property
    def num_tokens(self) -> int:
        """Tokens of the real (non-padding) samples of the step, over all ranks."""
        return sum(mb.num_tokens for mb in self.microbatches if not mb.is_padding)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerPosition:
    """Where the planner's next step starts (``LengthMixingPlanner.position``): the step after the
    last one reported done."""

    epoch: int
    step_in_epoch: int
    global_step: int
    """Optimizer steps completed since training started (counts across resumes and epochs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledMicrobatch:
    """A prefetcher job: one microbatch of this rank, bound to the reader's rows, with its anchor seed."""

    plan: MicrobatchPlan
    reader_rows: tuple[int, ...]
    """Rows of the samples in the ``CacheReader``'s SampleTable (the snapshot positions mapped through
    ``IndexSnapshot.reader_rows_N``), in packing order."""
    anchor_seed: int
    """Seed of this microbatch's anchor draw (``anchor_seed``): a pure function of (seed, epoch, the
    microbatch's sample ids), so the same microbatch gets the same anchors whatever rank or step position
    runs it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AnchorRequest:
    """What an ``anchor_fn`` sees: one packed microbatch on the CPU, and a generator seeded for it."""

    loss_mask_T: torch.Tensor
    """bool [T]: True on assistant tokens."""
    doc_ids_T: torch.Tensor
    """int32 [T]: document index 0..D-1 of each token."""
    positions_T: torch.Tensor
    """int32 [T]: position of each token within its document."""
    generator: torch.Generator
    """A CPU generator seeded with the microbatch's anchor seed (``ScheduledMicrobatch.anchor_seed``):
    draws made with it do not depend on thread timing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMicrobatch:
    """A microbatch ready for the drafter: its documents packed in one row, on the training device."""

    plan: MicrobatchPlan
    inputs: DrafterInputs
    """What ``DFlashDrafter.forward_train`` takes: token ids, features (bfloat16 [T, F], the target's
    captured hidden states), loss mask, document ids and positions (RoPE positions restart per document),
    the documents concatenated in ``plan.sample_ids`` order; the anchors chosen by the anchor_fn (empty
    without one) and, when the prefetcher was given the block size, their ``loss_rows_N``, computed on
    the host so that the forward needs no sync."""
    cu_seqlens_D1: torch.Tensor
    """int32 [D+1]: document start offsets, 0 first and T last (the varlen-attention convention)."""
    num_bytes: int
    """Bytes of the three per-token tensors as read from the cache (features, ids, mask)."""
    data_wait_s: float = 0.0
    """Seconds the consumer waited for this microbatch in the prefetcher (0 when it was ready)."""

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.inputs.num_tokens

    @property
    def num_documents(self) -> int:
        """D: the plan's samples (the prefetcher checked that the cache returned those)."""
        return len(self.plan.sample_ids)


def fuse_step(step: StepPlan) -> StepPlan:
    """The step with each rank's microbatches packed one after the other into one (``--fuse-microbatches``):
    one forward of their tokens and blocks instead of ``num_microbatches_per_rank``, the buckets they hold
    mixed within the step. The same samples in the same order, so an epoch still trains each exactly once;
    a rank's padding microbatches (an epoch's last step) are left out of its fused one, or stand for it
    when it has nothing else (every rank still runs one backward pass)."""
    fused: list[MicrobatchPlan] = []
    for rank in sorted({mb.rank for mb in step.microbatches}):
        mine = step.for_rank(rank)
        parts = [mb for mb in mine if not mb.is_padding] or [mine[0]]
        fused.append(
            MicrobatchPlan(
                index_in_step=len(fused),
                rank=rank,
                rows=tuple(r for mb in parts for r in mb.rows),
                sample_ids=tuple(i for mb in parts for i in mb.sample_ids),
                bucket_ids=tuple(b for mb in parts for b in mb.bucket_ids),
                num_tokens=sum(mb.num_tokens for mb in parts),
                is_padding=parts[0].is_padding,
            )
        )
    return replace(step, num_microbatches_per_rank=1, microbatches=tuple(fused))


def anchor_seed(seed: int, epoch: int, sample_ids: tuple[str, ...], *, padding: bool = False) -> int:
    """A 63-bit seed derived from the run seed, the epoch and the microbatch's content.

    Not from its position in the step: the rank balancing orders a step's microbatches differently
    for different world sizes, and one process with grad_accum 2 must draw the same anchors as two
    ranks with grad_accum 1. A sample is in one real microbatch per epoch, so seeds do not repeat."""
    payload = f"anchors/{seed}/{epoch}/{int(padding)}/{'/'.join(sample_ids)}".encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little") >> 1


def schedule_for_rank(
    steps: Iterable[StepPlan], *, rank: int, seed: int, reader_rows_N: np.ndarray
) -> Iterator[ScheduledMicrobatch]:
    """Turn step plans into this rank's prefetcher jobs, in the order the loop runs them.

    ``reader_rows_N`` maps snapshot positions to rows of the reader's SampleTable
    (``IndexSnapshot.reader_rows_N``). Lazy: it consumes ``steps`` one step at a time.
    """
    for step in steps:
        for mb in step.for_rank(rank):
            yield ScheduledMicrobatch(
                plan=mb,
                reader_rows=tuple(int(r) for r in reader_rows_N[list(mb.rows)]),
                anchor_seed=anchor_seed(seed, step.epoch, mb.sample_ids, padding=mb.is_padding),
            )


class RankSteps:
    """One rank's share of a stream of steps, and the steps again when their microbatches come back.

    ``jobs()`` gives the prefetcher this rank's microbatches (``schedule_for_rank``) and notes each step as
    its microbatches are drawn; ``regroup`` takes what the prefetcher returns, in job order, and yields
    each step's plan with its ``num_microbatches_per_rank`` items. The jobs are drawn in the prefetcher's
    threads, ahead of the consumer: a step is noted before its first microbatch can come back.
    """

    def __init__(
        self,
        steps: Iterable[StepPlan],
        *,
        rank: int,
        seed: int,
        reader_rows_N: np.ndarray,
        fuse: bool = False,
    ) -> None:
        self._steps = (fuse_step(step) for step in steps) if fuse else steps
        self._rank = rank
        self._seed = seed
        self._reader_rows_N = reader_rows_N
        self._drawn: deque[StepPlan] = deque()  # appended by a prefetch thread, taken by the consumer

    def jobs(self) -> Iterator[ScheduledMicrobatch]:
        return schedule_for_rank(
            self._noted(), rank=self._rank, seed=self._seed, reader_rows_N=self._reader_rows_N
        )

    def regroup(self, items: Iterable[_T]) -> Iterator[tuple[StepPlan, list[_T]]]:
        """(step, its microbatches' items) for each step, from ``items`` in job order."""
        rest = iter(items)
        for first in rest:
            step = self._drawn.popleft()
            group = [first, *itertools.islice(rest, step.num_microbatches_per_rank - 1)]
            assert len(group) == step.num_microbatches_per_rank, "the prefetcher ended inside a step"
            yield step, group

    def _noted(self) -> Iterator[StepPlan]:
        for step in self._steps:
            self._drawn.append(step)
            yield step
