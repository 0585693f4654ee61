"""Which checkpoint a ``dflash train`` invocation continues, and the config it goes on with: the newest
checkpoint that loads, once the run's ``ResumeContract`` (train/resume_contract.py) admits this invocation,
with the run's own microbatch layout where the invocation left it to the device's default."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from dflash_offline.config_fields import flag
from dflash_offline.placement import DistInfo
from dflash_offline.train.checkpoint import TrainState, load_latest_checkpoint
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.resume_contract import ResumeContract, check_resume
from dflash_offline.train.snapshot import IndexSnapshot


def checkpoint_to_resume(
    config: TrainConfig, info: DistInfo, train_snapshot: IndexSnapshot
) -> tuple[TrainConfig, TrainState | None]:
    """With ``resume="auto"``, the newest checkpoint that loads, once the run's ``ResumeContract`` admits
    this invocation (the one compatibility decision; its applied changes are announced by rank 0), and the
    config to go on with: the run's own microbatch layout where this invocation left it to the device's
    default. (config, None) when starting fresh."""
    state = load_latest_checkpoint(config.out_dir, is_main=info.is_main) if config.resume == "auto" else None
    if state is None:
        return config, None
    stored = ResumeContract.stored(config.out_dir, state.planner)
    config, adopted = _run_layout(config, stored)
    notes = check_resume(
        stored,
        ResumeContract.of(config, world_size=info.world_size, train_snapshot=train_snapshot),
        allow_topology_change=config.allow_topology_change,
        run_dir=config.out_dir,
    )
    if info.is_main:
        for note in [*adopted, *notes]:
            print(f"dflash train: {note}", file=sys.stderr, flush=True)
    return config, state


def _run_layout(config: TrainConfig, stored: ResumeContract) -> tuple[TrainConfig, list[str]]:
    """The fields of the microbatch layout left to the device's default take the resumed run's values (the
    default may have changed since, or the run began on another kind of device); a note for each."""
    anchors = (stored.options or {}).get("num_anchors")
    run_values: dict[str, int | None] = {
        "grad_accum": stored.grad_accum,
        "tokens_per_microbatch": stored.tokens_per_microbatch,
        "num_anchors": None if anchors is None else int(anchors),
    }
    changed: dict[str, Any] = {
        name: run_values[name]
        for name in config.layout_by_device
        if run_values[name] is not None and run_values[name] != getattr(config, name)
    }
    flags = {
        "grad_accum": flag(TrainConfig, "grad_accum"),
        "tokens_per_microbatch": flag(TrainConfig, "tokens_per_microbatch"),
        "num_anchors": flag(TrainConfig, "num_anchors"),
    }
    notes = [
        f"resuming with the run's own {flags[name]} {value} (left to the device's default, "
        f"{getattr(config, name)} here)"
        for name, value in changed.items()
    ]
    return (replace(config, **changed) if changed else config), notes
