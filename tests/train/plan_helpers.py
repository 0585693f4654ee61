"""Planner tests' views of a plan, computed from the plan alone, and a brute-force check of the
guarantees the planner states (train/planner.py's module docstring)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from dflash_offline.train.planner import LengthMixingPlanner, StepPlan
from dflash_offline.train.snapshot import IndexSnapshot


def epoch_plan(planner: LengthMixingPlanner, epoch: int) -> list[StepPlan]:
    """Every step of ``epoch`` from a planner at the start of a run (through ``iterate``, as the loop
    takes them)."""
    return [step for step in planner.iterate(epoch + 1) if step.epoch == epoch]


def bucket_token_shares(snapshot: IndexSnapshot) -> dict[int, float]:
    """Fraction of the snapshot's tokens in each bucket, counted sample by sample."""
    tokens: Counter[int] = Counter()
    for n, b in zip(snapshot.num_tokens_N.tolist(), snapshot.bucket_ids_N.tolist(), strict=True):
        tokens[int(b)] += int(n)
    total = sum(tokens.values())
    return {b: tokens[b] / total for b in sorted(tokens)}


def rank_tokens(step: StepPlan, rank: int) -> int:
    """Tokens of ``rank``'s microbatches in ``step`` (fillers included: they cost a backward pass)."""
    return sum(mb.num_tokens for mb in step.microbatches if mb.rank == rank)


def real_rows(steps: Sequence[StepPlan]) -> list[int]:
    """Snapshot positions of every real (non-filler) sample of ``steps``, in plan order."""
    return [r for s in steps for mb in s.microbatches if not mb.is_padding for r in mb.rows]


def check_epoch(
    snapshot: IndexSnapshot,
    steps: Sequence[StepPlan],
    *,
    epoch: int,
    tokens_per_microbatch: int,
    grad_accum: int,
    world_size: int,
) -> None:
    """Assert what the planner guarantees for one whole epoch planned under one topology.

    Every sample in exactly one real microbatch; each microbatch one bucket within the token budget,
    its ids and buckets those of its rows; full steps of ``grad_accum × world_size`` microbatches but
    the last, which has an equal count per rank and is the only one with fillers (a single sample of
    the step, repeated); ranks balanced within the step's largest microbatch; after every step, each
    bucket's consumed tokens within ``tokens_per_microbatch × (1 + share × num_buckets)`` of its share."""
    n = len(snapshot)
    tokens = snapshot.num_tokens_N.tolist()
    buckets = snapshot.bucket_ids_N.tolist()
    assert sorted(real_rows(steps)) == list(range(n)), "every sample exactly once per epoch"
    assert [s.step_in_epoch for s in steps] == list(range(len(steps)))
    assert {s.num_steps_in_epoch for s in steps} == {len(steps)}
    first = steps[0].global_step
    assert [s.global_step for s in steps] == list(range(first, first + len(steps)))
    shares = bucket_token_shares(snapshot)
    consumed = dict.fromkeys(shares, 0)
    for i, step in enumerate(steps):
        assert step.epoch == epoch
        k = step.num_microbatches_per_rank
        if i < len(steps) - 1:
            assert k == grad_accum, "every step but the last is full"
        assert 1 <= k <= grad_accum
        assert len(step.microbatches) == k * world_size
        assert [mb.index_in_step for mb in step.microbatches] == list(range(k * world_size))
        assert Counter(mb.rank for mb in step.microbatches) == dict.fromkeys(range(world_size), k)
        real_of_step = {r for mb in step.microbatches if not mb.is_padding for r in mb.rows}
        for mb in step.microbatches:
            assert mb.num_tokens == sum(tokens[r] for r in mb.rows) <= tokens_per_microbatch
            assert len({buckets[r] for r in mb.rows}) == 1, "a microbatch packs one bucket"
            assert mb.sample_ids == tuple(snapshot.sample_ids[r] for r in mb.rows)
            assert mb.bucket_ids == tuple(int(buckets[r]) for r in mb.rows)
            if mb.is_padding:
                assert i == len(steps) - 1, "only the epoch's last step is padded"
                assert len(mb.rows) == 1
                assert mb.rows[0] in real_of_step
            else:
                consumed[buckets[mb.rows[0]]] += mb.num_tokens
        loads = [rank_tokens(step, r) for r in range(world_size)]
        assert max(loads) - min(loads) <= max(mb.num_tokens for mb in step.microbatches)
        total = sum(consumed.values())
        for b, share in shares.items():
            assert abs(consumed[b] - share * total) <= tokens_per_microbatch * (1 + share * len(shares))
