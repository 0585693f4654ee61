"""The length-mixing planner: which samples form which microbatch of which optimizer step on which
rank, and the records it hands the loader."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch

from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.errors import ConfigError
from dflash_offline.train.config import DataConfig
from dflash_offline.train.snapshot import IndexSnapshot

# ─── Records of the data path ───────────────────────────────────────────────────────────────────────────────
# Records of the training data path: what the planner plans and what the prefetcher hands the loop.
#
# Shape legend: T = tokens of one packed microbatch (its documents concatenated in one row),
# F = features per token (num_layers * hidden_size), A = anchors of the microbatch, D = documents
# (samples) in the microbatch.
#
# Flow: ``LengthMixingPlanner`` -> ``StepPlan`` (one optimizer step, every rank's microbatches)
# -> ``schedule_for_rank`` -> ``ScheduledMicrobatch`` (one rank's microbatch bound to the reader's rows,
# with its anchor seed) -> ``Prefetcher`` -> ``PackedMicrobatch`` (the drafter's ``DrafterInputs`` on the
# training device) -> ``RankSteps.regroup`` -> the loop, one step's microbatches at a time.


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


# ─── The length-mixing planner ──────────────────────────────────────────────────────────────────────────────
# Length mixing: which samples form which microbatch of which optimizer step, on which rank.
#
# The plan of an epoch is a pure function of (seed, epoch, index snapshot, topology), so resume state is
# a few integers and every rank computes the same plan without talking to the others.
#
# 1. Packing. Within each bucket the samples are shuffled (seeded by seed, epoch, bucket) and packed
#    greedily in that order: consecutive samples join a microbatch while their token sum stays within
#    ``tokens_per_microbatch``. A microbatch therefore holds one bucket (documents of similar length).
# 2. Mixing. Every microbatch of every bucket gets a due point on its bucket's token progress: with
#    ``before`` the bucket's tokens packed ahead of it and ``t`` its own, due = (before + φ_b·t) / T_b,
#    T_b the bucket's tokens, φ_b ∈ [0.25, 0.75) a seeded phase. All microbatches are merged in due
#    order and cut into steps of ``grad_accum × world_size``. This is the stratified (low-variance) form
#    of drawing microbatches with probability ∝ remaining token mass: every bucket is consumed at the
#    same rate, so each step takes from every bucket a token share equal to that bucket's share of the
#    epoch, and after any number of steps bucket b's consumed tokens differ from its proportional share
#    by at most ``tokens_per_microbatch × (1 + share_b × num_buckets)`` (proved in
#    tests/train/test_planner.py). A multinomial draw would only match in expectation, and would now and
#    then fill a whole step from one bucket.
# 3. Ranks. Inside a step, microbatches go largest first onto the least-loaded rank that still has room;
#    every rank gets the same count (DDP needs every rank to run the same number of backward passes).
# 4. The epoch's last step, when fewer than ``grad_accum × world_size`` microbatches are left, is kept
#    with k = ceil(left / world_size) microbatches per rank; to make the count a multiple of the world
#    size, the largest multi-sample microbatches are split in two, and only if that is not enough,
#    filler microbatches repeating the shortest sample are added with ``is_padding=True`` (the loop
#    gives them zero loss weight). Every sample is then in exactly one real microbatch per epoch.
#
# Resume: ``state_dict()`` records the position after the last step the loop reported done
# (``step_done``), with what the plan was made from (seed, snapshot, token budget, topology).
# ``load_state_dict`` only restores the position: whether this planner may continue that state at all is
# the run's ``ResumeContract`` (train/resume_contract.py), compared before. A state made under another
# world size or grad_accum (which the contract admits with ``allow_topology_change``) continues the
# interrupted epoch: its rest is planned, with the new topology, over the samples the old topology had not
# reached yet (replayed from its own plan), so still exactly once.


PLANNER_STATE_VERSION = 1
_TAG_SHUFFLE = 0x5348  # separates the random streams of one (seed, epoch): shuffle vs. phases
_TAG_PHASE = 0x5048


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The settings that shape a plan besides seed, epoch and snapshot."""

    world_size: int
    grad_accum: int
    tokens_per_microbatch: int

    @property
    def microbatches_per_step(self) -> int:
        return self.world_size * self.grad_accum


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochSegment:
    """Steps of the current epoch that were run under an earlier topology before a resume."""

    topology: Topology
    num_steps: int


@dataclass(frozen=True, kw_only=True, slots=True)
class _RawMicrobatch:
    """A planned microbatch before numbering: snapshot positions, tokens, rank."""

    positions: tuple[int, ...]
    """Snapshot positions of the samples, in packing order."""
    sample_tokens: tuple[int, ...]
    """Tokens of each sample."""
    num_tokens: int
    """sum(sample_tokens), computed once (it is read many times per microbatch)."""
    rank: int = -1
    is_padding: bool = False


class LengthMixingPlanner:
    """Plans length-mixed optimizer steps over an ``IndexSnapshot``; see the module docstring."""

    def __init__(
        self,
        snapshot: IndexSnapshot,
        *,
        seed: int,
        tokens_per_microbatch: int,
        grad_accum: int,
        world_size: int,
    ) -> None:
        for name, value in (
            ("tokens_per_microbatch", tokens_per_microbatch),
            ("grad_accum", grad_accum),
            ("world_size", world_size),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if seed < 0:
            raise ConfigError(f"seed must be non-negative, got {seed}")
        if len(snapshot) == 0:
            raise ConfigError(
                "the cache has no committed samples yet: run `dflash generate` (or wait for its first commit)"
            )
        longest = int(np.argmax(snapshot.num_tokens_N))
        if int(snapshot.num_tokens_N[longest]) > tokens_per_microbatch:
            raise ConfigError(
                f"sample {snapshot.sample_ids[longest]!r} has {int(snapshot.num_tokens_N[longest])} tokens, "
                f"more than {field_ref(DataConfig, 'tokens_per_microbatch')} "
                f"{tokens_per_microbatch}: raise the budget to at least "
                f"{int(snapshot.num_tokens_N[longest])} or generate the cache "
                "with a lower max_length"
            )
        self.snapshot = snapshot
        self.seed = seed
        self.topology = Topology(
            world_size=world_size,
            grad_accum=grad_accum,
            tokens_per_microbatch=tokens_per_microbatch,
        )
        self._positions_by_bucket = {
            int(b): np.flatnonzero(snapshot.bucket_ids_N == b) for b in np.unique(snapshot.bucket_ids_N)
        }
        # Where the next step starts: the position after the last step reported done.
        self._epoch = 0
        self._step_in_epoch = 0
        self._global_step = 0
        self._segments: tuple[EpochSegment, ...] = ()
        self._steps_cache: dict[tuple[Any, ...], list[list[_RawMicrobatch]]] = {}
        self._count_cache: dict[int, int] = {}

    # ---- the pure plan ---------------------------------------------------------------------------

    def _raw_steps(
        self, epoch: int, topology: Topology, segments: tuple[EpochSegment, ...] = ()
    ) -> list[list[_RawMicrobatch]]:
        """The steps of ``epoch`` under ``topology`` after ``segments`` ran under theirs."""
        key = (epoch, topology, segments)
        cached = self._steps_cache.get(key)
        if cached is not None:
            return cached
        available = np.ones(len(self.snapshot), dtype=bool)
        for segment in segments:
            earlier = self._raw_steps_over(epoch, segment.topology, available)
            for step in earlier[: segment.num_steps]:
                for mb in step:
                    if not mb.is_padding:
                        available[list(mb.positions)] = False
        steps = self._raw_steps_over(epoch, topology, available)
        if len(self._steps_cache) >= 2:  # the current and next epoch are all a run needs
            self._steps_cache.pop(next(iter(self._steps_cache)))
        self._steps_cache[key] = steps
        return steps

    def _raw_steps_over(
        self, epoch: int, topology: Topology, available: np.ndarray
    ) -> list[list[_RawMicrobatch]]:
        tokens_N = self.snapshot.num_tokens_N
        due_parts, bucket_parts, packed = [], [], []
        phase_rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, _TAG_PHASE]))
        bucket_order = phase_rng.permutation(len(self._positions_by_bucket))
        for b_index, (bucket, positions) in enumerate(sorted(self._positions_by_bucket.items())):
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, bucket, _TAG_SHUFFLE]))
            order = positions[rng.permutation(len(positions))]
            order = order[available[order]]
            phase = float(phase_rng.uniform(0.25, 0.75))
            if len(order) == 0:
                continue
            # On one rank every microbatch is rank 0 from the start (re-ranking each cost ≈ 0.2 s per 1M).
            rank = 0 if topology.world_size == 1 else -1
            mbs = _pack(order, tokens_N[order], topology.tokens_per_microbatch, rank=rank)
            mb_tokens = np.asarray([mb.num_tokens for mb in mbs], dtype=np.float64)
            before = np.cumsum(mb_tokens) - mb_tokens
            due_parts.append((before + phase * mb_tokens) / mb_tokens.sum())
            bucket_parts.append(np.full(len(mbs), bucket_order[b_index]))
            packed.extend(mbs)
        if not packed:  # every sample was consumed before a topology change
            return []
        due = np.concatenate(due_parts)
        tie = np.concatenate(bucket_parts)
        sequence = [packed[i] for i in np.lexsort((tie, due))]
        per_step = topology.microbatches_per_step
        steps = [sequence[i : i + per_step] for i in range(0, len(sequence), per_step)]
        if steps and len(steps[-1]) < per_step:
            steps[-1] = _fill_last_step(steps[-1], topology.world_size)
        return [_assign_ranks(step, topology.world_size) for step in steps]

    def _num_raw_steps(self, epoch: int) -> int:
        """Steps of ``epoch`` planned from scratch under the current topology: counted from the
        packing alone (merging, the last step's fill and rank assignment never change the count),
        so that the LR schedule's total does not plan every epoch in full at start-up."""
        count = self._count_cache.get(epoch)
        if count is None:
            cached = self._steps_cache.get((epoch, self.topology, ()))
            if cached is not None:
                count = len(cached)
            else:
                tokens_N = self.snapshot.num_tokens_N
                budget = self.topology.tokens_per_microbatch
                num_mbs = 0
                for bucket, positions in sorted(self._positions_by_bucket.items()):
                    rng = np.random.default_rng(
                        np.random.SeedSequence([self.seed, epoch, bucket, _TAG_SHUFFLE])
                    )
                    order = positions[rng.permutation(len(positions))]
                    num_mbs += len(_pack_bounds(tokens_N[order], budget)) - 1
                per_step = self.topology.microbatches_per_step
                count = -(-num_mbs // per_step)
            self._count_cache[epoch] = count
        return count

    def _to_step_plans(
        self,
        raw: list[list[_RawMicrobatch]],
        *,
        epoch: int,
        first_step: int,
        first_global: int,
        skip: int = 0,
    ) -> Iterator[StepPlan]:
        """The step plans of ``raw[skip:]``, built one at a time (an epoch of a large index holds
        millions of sample ids: a run's first step must not wait for all of them)."""
        ids, buckets = self.snapshot.sample_ids, self.snapshot.bucket_ids_N
        num_steps = first_step + len(raw)
        for i in range(skip, len(raw)):
            step = raw[i]
            ordered = sorted(step, key=lambda mb: mb.rank)  # stable: keeps each rank's due order
            microbatches = tuple(
                MicrobatchPlan(
                    index_in_step=j,
                    rank=mb.rank,
                    rows=mb.positions,
                    sample_ids=tuple(ids[p] for p in mb.positions),
                    bucket_ids=tuple(int(buckets[p]) for p in mb.positions),
                    num_tokens=mb.num_tokens,
                    is_padding=mb.is_padding,
                )
                for j, mb in enumerate(ordered)
            )
            yield StepPlan(
                epoch=epoch,
                step_in_epoch=first_step + i,
                global_step=first_global + i,
                num_steps_in_epoch=num_steps,
                num_microbatches_per_rank=len(step) // self.topology.world_size,
                microbatches=microbatches,
            )

    def steps_per_epoch(self, epoch: int | None = None) -> int:
        """Steps of ``epoch`` (default: the current one), including steps run before a topology change.
        Packing depends on the shuffle, so the count can differ by a step or so between epochs."""
        epoch = self._epoch if epoch is None else epoch
        if epoch == self._epoch and self._segments:
            done = sum(s.num_steps for s in self._segments)
            return done + len(self._raw_steps(epoch, self.topology, self._segments))
        return self._num_raw_steps(epoch)

    def total_steps(self, num_epochs: int) -> int:
        """The global step count at the end of epoch ``num_epochs - 1`` (for the LR schedule)."""
        if num_epochs <= self._epoch:
            return self._global_step
        total = self._global_step - self._step_in_epoch + self.steps_per_epoch(self._epoch)
        return total + sum(self._num_raw_steps(e) for e in range(self._epoch + 1, num_epochs))

    # ---- resumable iteration ---------------------------------------------------------------------

    def iterate(self, num_epochs: int | None = None) -> Iterator[StepPlan]:
        """Steps from the current position (see ``step_done``) to the end of epoch ``num_epochs - 1``
        (forever when None). Iterating does not move the position: a prefetcher runs ahead of training."""
        epoch, step_in_epoch, global_step, segments = (
            self._epoch,
            self._step_in_epoch,
            self._global_step,
            self._segments,
        )
        while num_epochs is None or epoch < num_epochs:
            done = sum(s.num_steps for s in segments)
            raw = self._raw_steps(epoch, self.topology, segments)
            yield from self._to_step_plans(
                raw,
                epoch=epoch,
                first_step=done,
                first_global=global_step - (step_in_epoch - done),
                skip=step_in_epoch - done,
            )
            global_step += len(raw) - (step_in_epoch - done)
            epoch, step_in_epoch, segments = epoch + 1, 0, ()

    def __iter__(self) -> Iterator[StepPlan]:
        return self.iterate()

    def step_done(self, step: StepPlan) -> None:
        """Record that the optimizer step ``step`` finished: ``state_dict`` now resumes after it."""
        if step.step_in_epoch + 1 >= step.num_steps_in_epoch:
            self._epoch, self._step_in_epoch, self._segments = step.epoch + 1, 0, ()
        else:
            self._epoch, self._step_in_epoch = step.epoch, step.step_in_epoch + 1
        self._global_step = step.global_step + 1

    @property
    def position(self) -> PlannerPosition:
        """Where the next step to run sits."""
        return PlannerPosition(
            epoch=self._epoch, step_in_epoch=self._step_in_epoch, global_step=self._global_step
        )

    # ---- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": PLANNER_STATE_VERSION,
            "seed": self.seed,
            "snapshot_id": self.snapshot.snapshot_id,
            "num_samples": len(self.snapshot),
            **_topology_dict(self.topology),
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "global_step": self._global_step,
            "epoch_segments": [
                {**_topology_dict(s.topology), "num_steps": s.num_steps} for s in self._segments
            ],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Resume at ``d``'s position. ``d`` was checked against this run before (train/resume_contract.py:
        the same seed, snapshot and token budget; the version is the checkpoint format's); a ``d`` planned
        under another world size or grad_accum continues its epoch over that epoch's remaining samples."""
        old = _topology_from_dict(d)
        assert d["version"] == PLANNER_STATE_VERSION, "load_latest_checkpoint refuses another version"
        planned = (d["seed"], d["snapshot_id"], old.tokens_per_microbatch)
        this = (self.seed, self.snapshot.snapshot_id, self.topology.tokens_per_microbatch)
        assert planned == this, "the resume contract admits only a state of this seed, snapshot and budget"
        epoch, step_in_epoch, global_step = int(d["epoch"]), int(d["step_in_epoch"]), int(d["global_step"])
        segments = tuple(
            EpochSegment(topology=_topology_from_dict(s), num_steps=int(s["num_steps"]))
            for s in d.get("epoch_segments", [])
        )
        if old != self.topology and step_in_epoch > 0:
            done_before = sum(s.num_steps for s in segments)
            segments = (*segments, EpochSegment(topology=old, num_steps=step_in_epoch - done_before))
        self._epoch, self._step_in_epoch, self._global_step = epoch, step_in_epoch, global_step
        self._segments = segments


def _topology_dict(t: Topology) -> dict[str, Any]:
    return {
        "world_size": t.world_size,
        "grad_accum": t.grad_accum,
        "tokens_per_microbatch": t.tokens_per_microbatch,
    }


def _topology_from_dict(d: dict[str, Any]) -> Topology:
    return Topology(
        world_size=int(d["world_size"]),
        grad_accum=int(d["grad_accum"]),
        tokens_per_microbatch=int(d["tokens_per_microbatch"]),
    )


def _pack_bounds(tokens_N: np.ndarray, budget: int) -> np.ndarray:
    """int64 [M + 1] bounds of greedy in-order packing: consecutive samples share a microbatch while
    their sum fits ``budget`` (each sample fits alone); microbatch j is [bounds[j], bounds[j+1]).
    Vectorised: one binary search gives, for every sample, where a microbatch starting there would
    end; the microbatches are then the chain of those ends from 0 (a Python step a microbatch, not a
    sample: ``ndarray.item`` per step, not ``tolist()`` of every sample's end, which took as long
    as the search)."""
    n = len(tokens_N)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    cum = np.cumsum(tokens_N, dtype=np.int64)
    end_of = np.searchsorted(cum, cum - tokens_N + budget, side="right").item
    bounds = [0]
    start = 0
    while start < n:
        start = end_of(start)
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)


def _pack(order_N: np.ndarray, tokens_N: np.ndarray, budget: int, *, rank: int = -1) -> list[_RawMicrobatch]:
    """Greedy in-order packing (see ``_pack_bounds``) as microbatches of snapshot positions."""
    bounds_M1 = _pack_bounds(tokens_N, budget)
    totals = np.diff(np.concatenate([[0], np.cumsum(tokens_N, dtype=np.int64)])[bounds_M1]).tolist()
    bounds = bounds_M1.tolist()
    positions, tokens = order_N.tolist(), tokens_N.tolist()
    return [
        _RawMicrobatch(
            positions=tuple(positions[a:b]), sample_tokens=tuple(tokens[a:b]), num_tokens=total, rank=rank
        )
        for (a, b), total in zip(itertools.pairwise(bounds), totals, strict=True)
    ]


def _fill_last_step(step: list[_RawMicrobatch], world_size: int) -> list[_RawMicrobatch]:
    """Make the count a multiple of ``world_size``: split multi-sample microbatches, then pad."""
    target = math.ceil(len(step) / world_size) * world_size
    step = list(step)
    while len(step) < target:
        splittable = [i for i, mb in enumerate(step) if len(mb.positions) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: (step[j].num_tokens, -j))
        step[i : i + 1] = _split_in_two(step[i])
    return step + [_padding_like(step)] * (target - len(step))


def _split_in_two(mb: _RawMicrobatch) -> list[_RawMicrobatch]:
    """Two microbatches from one (≥ 2 samples), cut where the token halves are closest to equal."""
    prefix = np.cumsum(mb.sample_tokens)[:-1]
    cut = int(np.argmin(np.abs(2 * prefix - mb.num_tokens))) + 1
    return [
        _RawMicrobatch(
            positions=mb.positions[:cut],
            sample_tokens=mb.sample_tokens[:cut],
            num_tokens=sum(mb.sample_tokens[:cut]),
        ),
        _RawMicrobatch(
            positions=mb.positions[cut:],
            sample_tokens=mb.sample_tokens[cut:],
            num_tokens=sum(mb.sample_tokens[cut:]),
        ),
    ]


def _padding_like(step: list[_RawMicrobatch]) -> _RawMicrobatch:
    """A filler microbatch repeating the step's shortest sample (cheapest backward pass)."""
    tokens, position = min(
        (t, p) for mb in step for p, t in zip(mb.positions, mb.sample_tokens) if not mb.is_padding
    )
    return _RawMicrobatch(positions=(position,), sample_tokens=(tokens,), num_tokens=tokens, is_padding=True)


def _assign_ranks(step: list[_RawMicrobatch], world_size: int) -> list[_RawMicrobatch]:
    """Largest first onto the least-loaded rank with room; each rank gets len(step) / world_size."""
    per_rank = len(step) // world_size
    assert per_rank * world_size == len(step), "a step's microbatch count is a multiple of world_size"
    if world_size == 1:  # every microbatch on rank 0 (what the loop below gives, without its cost)
        return [mb if mb.rank == 0 else replace(mb, rank=0) for mb in step]
    loads, counts = [0] * world_size, [0] * world_size
    ranks = [0] * len(step)
    for i in sorted(range(len(step)), key=lambda j: (-step[j].num_tokens, j)):
        rank = min((r for r in range(world_size) if counts[r] < per_rank), key=lambda r: (loads[r], r))
        ranks[i] = rank
        loads[rank] += step[i].num_tokens
        counts[rank] += 1
    return [replace(mb, rank=rank) for mb, rank in zip(step, ranks)]
