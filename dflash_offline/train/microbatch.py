"""Records of the training data path: what the planner plans and what the prefetcher hands the loop.

Shape legend: T = tokens of one packed microbatch (its documents concatenated in one row),
F = features per token (num_layers * hidden_size), A = anchors of the microbatch, D = documents
(samples) in the microbatch.

Flow: ``LengthMixingPlanner`` -> ``StepPlan`` (one optimizer step, every rank's microbatches)
-> ``schedule_for_rank`` -> ``ScheduledMicrobatch`` (one rank's microbatch with its step context and
resolved cache rows) -> ``Prefetcher`` -> ``PackedMicrobatch`` (tensors on the training device).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class MicrobatchPlan:
    """One microbatch of one optimizer step: samples of one bucket packed under the token budget."""

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
    """Bucket of each sample (all equal: a microbatch packs one bucket)."""
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
class StepContext:
    """Where a microbatch sits in training; travels with it through the prefetcher."""

    epoch: int
    step_in_epoch: int
    global_step: int
    microbatch_in_rank: int
    """0 .. num_microbatches_in_rank-1: position among this rank's microbatches of the step."""
    num_microbatches_in_rank: int
    """How many microbatches this rank runs in the step (the loop syncs gradients on the last one)."""
    step_num_tokens: int
    """Real tokens of the whole step over all ranks (for a step-wide loss normalisation)."""
    anchor_seed: int
    """Seed of this microbatch's anchor draw: a pure function of (seed, epoch, the microbatch's sample
    ids), so the same microbatch gets the same anchors whatever rank or step position runs it."""

    @property
    def is_last_in_step(self) -> bool:
        return self.microbatch_in_rank == self.num_microbatches_in_rank - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledMicrobatch:
    """A prefetcher job: one microbatch of this rank, with its step context and cache rows."""

    plan: MicrobatchPlan
    step: StepContext
    reader_rows: tuple[int, ...]
    """Rows of the samples in the ``CacheReader``'s SampleTable (the snapshot positions mapped through
    ``IndexSnapshot.reader_rows_N``), in packing order."""


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
    """A CPU generator seeded with the microbatch's anchor seed (``StepContext.anchor_seed``): draws
    made with it do not depend on thread timing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedMicrobatch:
    """A microbatch ready for the drafter: its documents packed in one row, on the training device."""

    plan: MicrobatchPlan
    step: StepContext
    input_ids_T: torch.Tensor
    """int64 [T]: token ids, documents concatenated in ``plan.sample_ids`` order."""
    features_TF: torch.Tensor
    """bfloat16 [T, F]: the target's captured hidden states."""
    loss_mask_T: torch.Tensor
    """bool [T]: True on assistant tokens."""
    doc_ids_T: torch.Tensor
    """int32 [T]: document index 0..D-1 of each token."""
    positions_T: torch.Tensor
    """int32 [T]: position of each token within its document (RoPE positions restart per document)."""
    cu_seqlens_D1: torch.Tensor
    """int32 [D+1]: document start offsets, 0 first and T last (the varlen-attention convention)."""
    anchors_A: torch.Tensor
    """int64 [A]: indices into T chosen by the anchor_fn (empty without one)."""
    loss_rows_N: torch.Tensor | None = None
    """int64 [N]: the block positions of ``anchors_A`` that carry loss (``drafter.loss.loss_rows``),
    when the prefetcher was given the block size; computed on the host, so the forward needs no sync."""
    num_documents: int
    num_tokens: int
    num_bytes: int
    """Bytes of the three per-token tensors as read from the cache (features, ids, mask)."""
    data_wait_s: float = 0.0
    """Seconds the consumer waited for this microbatch in the prefetcher (0 when it was ready)."""

    @property
    def bucket_ids(self) -> tuple[int, ...]:
        return self.plan.bucket_ids


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
        mine = step.for_rank(rank)
        step_tokens = step.num_tokens
        for i, mb in enumerate(mine):
            context = StepContext(
                epoch=step.epoch,
                step_in_epoch=step.step_in_epoch,
                global_step=step.global_step,
                microbatch_in_rank=i,
                num_microbatches_in_rank=len(mine),
                step_num_tokens=step_tokens,
                anchor_seed=anchor_seed(seed, step.epoch, mb.sample_ids, padding=mb.is_padding),
            )
            rows = tuple(int(r) for r in reader_rows_N[list(mb.rows)])
            yield ScheduledMicrobatch(plan=mb, step=context, reader_rows=rows)
