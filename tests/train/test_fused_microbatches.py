"""``--fuse-microbatches``: a rank's microbatches of a step packed into one row. The fused plan is checked
against the plan it fuses (the same samples, exactly once an epoch, every rank one microbatch, several
buckets a step), and a run trains with it end to end. That a fused row trains as its microbatches would is
the drafter's document isolation (tests/drafter/test_model.py: every block equals the block drafted alone
from its own document)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_offline.drafter.batch import DrafterInputs
from dflash_offline.train.launch import run_training
from dflash_offline.train.metrics import read_metrics
from dflash_offline.train.planner import RankSteps, fuse_step
from dflash_offline.train.step import OptimizerStep
from tests.train.helpers import train_config
from tests.train.plan_helpers import epoch_plan, real_rows
from tests.train.test_planner import make_snapshot, planner


@pytest.mark.parametrize(("world_size", "grad_accum"), [(1, 4), (3, 2), (4, 3)])
def test_a_fused_step_holds_each_ranks_microbatches_in_one_row(world_size: int, grad_accum: int) -> None:
    snap = make_snapshot()
    p = planner(snap, world_size=world_size, grad_accum=grad_accum, tokens_per_microbatch=4096)
    mixed = 0
    for epoch in range(2):
        steps = epoch_plan(p, epoch)
        fused = [fuse_step(step) for step in steps]
        # The same real samples, in the same order: exactly once an epoch.
        assert real_rows(fused) == real_rows(steps)
        assert sorted(real_rows(fused)) == list(range(len(snap)))
        for step, f in zip(steps, fused, strict=True):
            assert (f.epoch, f.step_in_epoch, f.global_step) == (
                step.epoch,
                step.step_in_epoch,
                step.global_step,
            )
            assert f.num_microbatches_per_rank == 1
            assert sorted(mb.rank for mb in f.microbatches) == list(range(world_size))
            assert f.num_tokens == step.num_tokens
            for mb in f.microbatches:
                parts = [m for m in step.for_rank(mb.rank) if not m.is_padding]
                if parts:
                    assert not mb.is_padding
                    assert mb.rows == tuple(r for m in parts for r in m.rows)
                    assert mb.num_tokens == sum(m.num_tokens for m in parts) <= grad_accum * 4096
                else:  # a rank with nothing but filler in the epoch's last step keeps one filler
                    assert mb.is_padding
                    assert mb.rows == step.for_rank(mb.rank)[0].rows
                assert mb.bucket_ids == tuple(int(snap.bucket_ids_N[r]) for r in mb.rows)
            mixed += any(len(set(mb.bucket_ids)) > 1 for mb in f.microbatches)
    if grad_accum > 1:
        assert mixed > 0.9 * sum(len(epoch_plan(p, e)) for e in range(2)), "a fused row mixes buckets"


def test_rank_steps_hand_the_prefetcher_one_job_a_step_when_fused() -> None:
    snap = make_snapshot(200)
    steps = epoch_plan(planner(snap, world_size=2, grad_accum=3, tokens_per_microbatch=4096), 0)
    rank_steps = RankSteps(steps, rank=1, seed=7, reader_rows_N=np.arange(len(snap)), fuse=True)
    jobs = list(rank_steps.jobs())
    assert len(jobs) == len(steps)
    regrouped = list(rank_steps.regroup(jobs))
    assert [len(items) for _, items in regrouped] == [1] * len(steps)
    assert [job.plan.rows for job in jobs] == [fuse_step(s).for_rank(1)[0].rows for s in steps]


def test_a_run_trains_with_fused_microbatches(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row a step reaches the optimizer step (three without fusing), holding several buckets."""
    rows_per_step: list[int] = []
    original = OptimizerStep.__call__

    def counted(self: OptimizerStep, inputs: list[DrafterInputs], *args: Any, **kwargs: Any) -> Any:
        rows_per_step.append(len(inputs))
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(OptimizerStep, "__call__", counted)
    config = train_config(tiny_cache, tmp_path / "run", grad_accum=3, tokens_per_microbatch=300)
    run_training(config.with_options(fuse_microbatches=True))
    assert rows_per_step == [1] * config.optimizer.max_steps
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows][-1] == config.optimizer.max_steps
    assert max(len(set(r["buckets"])) for r in rows) > 1, "a step's one row holds several buckets"
    assert rows[-1]["loss"] < rows[0]["loss"]
    rows_per_step.clear()
    # Unfused, each step's three microbatches reach it as three rows (a few steps show it: a step's count
    # does not depend on the run's length).
    run_training(config.with_options(out_dir=tmp_path / "unfused", max_steps=3))
    assert rows_per_step == [3] * 3
