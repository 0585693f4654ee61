"""Whether ``dflash train`` may continue a run: the resume contract, one record compared once.

A resume continues a run's drafter, optimizer and sample plan where its checkpoint left them, so it must
ask for the same tensors, loss and samples. ``ResumeContract`` holds everything that decides it, and
``RULES`` says what each of its fields allows. Each section of ``TrainConfig`` declares the rule of its
options (train/config.py: ``RESUME_RULE``; ``OPTION_RULES``), and ``RULES`` is derived from them:

- ``FIXED``: the options that define the drafter's tensors or its loss, the seed and token budget that shape
  the sample plan, the validation split, the training subset (``DataConfig.train_samples``) and the training
  samples themselves: a change is refused;
- ``TOPOLOGY``: the world size and ``grad_accum``: changed only with ``allow_topology_change`` (the
  planner then plans the rest of the interrupted epoch over its remaining samples, each still once);
- ``APPLIED``: the optimizer hyper-parameters, the run length and the validation schedule: taken over from
  the command line, each change announced;
- ``FREE``: options (threads, prefetch, checkpointing, logging, ...) that change neither the drafter nor
  the plan nor the schedule: a resume takes them as given, outside ``RULES``.

The stored contract is what the run saved: its options in ``RUN/config.json``, its plan (seed, token
budget, topology, training samples) in the checkpoint's planner state, since a topology change between two
checkpoints is recorded there. ``check_resume`` compares it with this invocation's once, after the
checkpoint is read and before any of it is applied, and names every field that differs in one
``ResumeError`` line, each by its field (``config_fields.field_ref``; the command line shows the flag).

Not compatibility, so decided where the files are read: whether a checkpoint loads at all
(train/checkpoint.py: a corrupt newest one is set aside for the previous one; a format this version does
not read is refused), and whether a run directory or a checkpoint exists (train/checkpoint.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.config_fields import field_ref
from dflash_offline.errors import ConfigError, ResumeError
from dflash_offline.train.config import (
    OPTION_RULES,
    OPTIONS,
    OPTIONS_ADDED_SINCE,
    CheckpointConfig,
    LaunchConfig,
    Rule,
    TrainConfig,
    saved_options,
)
from dflash_offline.train.snapshot import SNAPSHOT_FILE, IndexSnapshot

_PLAN_FIELDS = ("seed", "tokens_per_microbatch", "snapshot", "world_size", "grad_accum")
"""The fields of ``RULES`` that the checkpoint records (the others are options of config.json)."""

_RUN_RULES: Mapping[str, Rule] = {"snapshot": Rule.FIXED, "world_size": Rule.TOPOLOGY}
"""The fields of ``RULES`` that are not options: the training samples, and the ranks (the options ``gpus``
and ``num_cpu_workers`` only count them)."""

FIXED_OPTIONS = tuple(
    name for name, rule in OPTION_RULES.items() if rule is Rule.FIXED and name not in _PLAN_FIELDS
)
"""``TrainConfig`` options that define the drafter's tensors or its loss, or which samples are trained on
(the validation split, the training subset), or where its weights started."""

ADDED_OPTIONS: Mapping[str, Any] = {k: v for k, v in OPTIONS_ADDED_SINCE.items() if k in FIXED_OPTIONS}
"""The options of ``FIXED_OPTIONS`` that some runs' config.json lacks, by the value that means what those
runs did (config.py: ``OPTIONS_ADDED_SINCE``): a config.json without one is read with it."""

APPLIED_OPTIONS = tuple(name for name, rule in OPTION_RULES.items() if rule is Rule.APPLIED)
"""``TrainConfig`` options a resume takes over (the LR schedule is recomputed from them)."""

RULES: Mapping[str, Rule] = {
    **{name: Rule.FIXED for name in FIXED_OPTIONS},
    **{name: _RUN_RULES.get(name) or OPTION_RULES[name] for name in _PLAN_FIELDS},
    **{name: Rule.APPLIED for name in APPLIED_OPTIONS},
}
"""Every compared field of ``ResumeContract`` (an option by its ``TrainConfig`` name), in message order."""

_LABELS: Mapping[str, str] = {
    **{
        name: field_ref(OPTIONS[name].owner, name) for name in RULES if name not in ("world_size", "snapshot")
    },
    "world_size": f"{field_ref(LaunchConfig, 'gpus')}/{field_ref(LaunchConfig, 'num_cpu_workers')} "
    "(world size)",
}
"""How a refusal names each field of ``RULES`` but the snapshot (its file name is read when needed);
built at import, so a renamed option fails there."""


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class SnapshotIdentity:
    """Which samples a run trains on."""

    snapshot_id: str
    """``IndexSnapshot.snapshot_id`` of the training samples (the run's snapshot less its validation
    split)."""
    num_samples: int
    """How many they are."""

    def __repr__(self) -> str:  # as the refusal shows it
        return f"{self.snapshot_id[:12]}… ({self.num_samples} training samples)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeContract:
    """What a run is resumed against (see the module docstring)."""

    options: Mapping[str, Any] | None
    """Option name → value (as ``RUN/config.json`` holds it) of every option in
    ``FIXED_OPTIONS`` and ``APPLIED_OPTIONS``. A stored contract holds those its config.json had, and is
    None when that file does not read: then only the fields below are compared (the checkpoint's own)."""
    seed: int
    tokens_per_microbatch: int
    grad_accum: int
    """Microbatches per rank and step."""
    world_size: int
    """Ranks of the run (``gpus`` or ``num_cpu_workers``, or torchrun's)."""
    snapshot: SnapshotIdentity

    @classmethod
    def of(cls, config: TrainConfig, *, world_size: int, train_snapshot: IndexSnapshot) -> ResumeContract:
        """This invocation's contract."""
        saved = saved_options(config.to_dict())
        return cls(
            options={name: saved[name] for name in (*FIXED_OPTIONS, *APPLIED_OPTIONS)},
            seed=config.data.seed,
            tokens_per_microbatch=config.data.tokens_per_microbatch,
            grad_accum=config.topology.grad_accum,
            world_size=world_size,
            snapshot=SnapshotIdentity(
                snapshot_id=train_snapshot.snapshot_id, num_samples=len(train_snapshot)
            ),
        )

    @classmethod
    def stored(cls, run_dir: Path, planner_state: Mapping[str, Any]) -> ResumeContract:
        """The contract the run saved: its options in ``run_dir/config.json``, its plan in the state of the
        checkpoint's planner (``LengthMixingPlanner.state_dict``)."""
        try:
            saved = saved_options(json.loads((run_dir / "config.json").read_text()))
        except (OSError, json.JSONDecodeError, ConfigError):
            saved = None
        options = (
            None
            if saved is None
            else {name: saved[name] for name in (*FIXED_OPTIONS, *APPLIED_OPTIONS) if name in saved}
        )
        if options is not None:
            options = {**ADDED_OPTIONS, **options}
        return cls(
            options=options,
            seed=int(planner_state["seed"]),
            tokens_per_microbatch=int(planner_state["tokens_per_microbatch"]),
            grad_accum=int(planner_state["grad_accum"]),
            world_size=int(planner_state["world_size"]),
            snapshot=SnapshotIdentity(
                snapshot_id=str(planner_state["snapshot_id"]), num_samples=int(planner_state["num_samples"])
            ),
        )

    def compared(self) -> dict[str, Any]:
        """The value of each ``RULES`` field it holds, by name."""
        return {**(self.options or {}), **{name: getattr(self, name) for name in _PLAN_FIELDS}}


@dataclass(frozen=True, kw_only=True, slots=True)
class ContractChange:
    """One field of the contract that differs between the stored run and this invocation."""

    name: str
    """The ``RULES`` key."""
    rule: Rule
    before: Any
    """The stored value."""
    now: Any
    """This invocation's value."""


def contract_changes(stored: ResumeContract, current: ResumeContract) -> list[ContractChange]:
    """Every field of ``RULES`` whose stored value differs from ``current``'s, in ``RULES`` order (an
    option the stored contract does not hold is not compared)."""
    before, now = stored.compared(), current.compared()
    return [
        ContractChange(name=name, rule=rule, before=before[name], now=now[name])
        for name, rule in RULES.items()
        if name in before and before[name] != now[name]
    ]


def check_resume(
    stored: ResumeContract, current: ResumeContract, *, allow_topology_change: bool, run_dir: Path
) -> list[str]:
    """The one resume decision: raise ``ResumeError`` naming every refused change (each field with both
    values, in one line), else return one note per applied change."""
    if stored.options is not None:
        missing = [name for name in FIXED_OPTIONS if name not in stored.options]
        if missing:
            raise ResumeError(
                f"{run_dir / 'config.json'} lacks {missing}: this dflash-offline did not write it; "
                f"train into a new {field_ref(TrainConfig, 'out_dir')} (or pass "
                f"{field_ref(CheckpointConfig, 'resume')} never to start over there)"
            )
    changes = contract_changes(stored, current)
    refused = [
        c for c in changes if c.rule is Rule.FIXED or (c.rule is Rule.TOPOLOGY and not allow_topology_change)
    ]
    if refused:
        raise ResumeError(_refusal(refused, run_dir))
    return [
        f"resuming with {_label(c.name)} {c.now!r} (the previous run used {c.before!r}): applied from the "
        "resumed step on"
        for c in changes
        if c.rule is Rule.APPLIED
    ]


def _refusal(refused: list[ContractChange], run_dir: Path) -> str:
    """One line: what the run was trained with, what this invocation asks for, and the ways on."""
    before = _and([f"{_label(c.name)} {c.before!r}" for c in refused])
    now = _and([f"{_label(c.name)} {c.now!r}" for c in refused])
    ways = [f"resume with the same {_and([_label(c.name) for c in refused])}"]
    if all(c.rule is Rule.TOPOLOGY for c in refused):
        ways.append(
            f"pass {field_ref(CheckpointConfig, 'allow_topology_change')} to plan the rest of the epoch over "
            "its remaining samples"
        )
    ways.append(
        f"train into a new {field_ref(TrainConfig, 'out_dir')} (or pass "
        f"{field_ref(CheckpointConfig, 'resume')} never to start over there)"
    )
    return f"{run_dir} was trained with {before}, this run asks for {now}; {', or '.join(ways)}"


def _label(name: str) -> str:
    """How the message names a field of ``RULES``: its option's field marker (the command line
    shows the flag)."""
    if name == "snapshot":
        return f"index snapshot ({SNAPSHOT_FILE})"
    return _LABELS[name]


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
