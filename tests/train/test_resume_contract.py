"""Whether a run may resume, decided once (train/resume_contract.py): every option of ``dflash train``
changed alone against a run saved on disk (its config.json and its checkpoint's planner state), with the
verdict written out here for each; then several at once, a config.json that does not read, and the
planner version that the checkpoint loader refuses."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_offline.config_fields import cli_field, option_fields
from dflash_offline.errors import ResumeError
from dflash_offline.train.checkpoint import TrainState, load_latest_checkpoint, save_checkpoint
from dflash_offline.train.config import OPTIONS_ADDED_SINCE, Rule, TrainConfig, resume_rule
from dflash_offline.train.planner import LengthMixingPlanner
from dflash_offline.train.resume_contract import ResumeContract, check_resume
from dflash_offline.train.snapshot import IndexSnapshot, snapshot_from_columns
from tests.train.helpers import flat_config_json

WORLD_SIZE = 4

REFUSED = "refused"
TOPOLOGY = "refused unless --allow-topology-change"
ANNOUNCED = "announced"
FREE = "free"

# (field, another value, the verdict, the flag its message names). ``world_size`` is the launch's, not a
# field: its row changes the ranks; ``snapshot`` changes the samples trained on.
CHANGES: list[tuple[str, Any, str, str]] = [
    ("target", "random:tiny", REFUSED, "`DrafterTrainConfig.target`"),
    ("num_layers", 2, REFUSED, "`DrafterTrainConfig.num_layers`"),
    ("block_size", 16, REFUSED, "`DrafterTrainConfig.block_size`"),
    ("num_anchors", 64, REFUSED, "`DataConfig.num_anchors`"),
    ("gamma", 5.0, REFUSED, "`DrafterTrainConfig.gamma`"),
    ("mask_token_id", 3, REFUSED, "`DrafterTrainConfig.mask_token_id`"),
    ("algorithm", "sgd", REFUSED, "`OptimizerConfig.algorithm`"),
    ("feature_scale", "layer", REFUSED, "`DrafterTrainConfig.feature_scale`"),
    ("val_fraction", 0.3, REFUSED, "`DataConfig.val_fraction`"),
    ("val_samples", 5, REFUSED, "`DataConfig.val_samples`"),
    ("val_group", "root-id", REFUSED, "`DataConfig.val_group`"),
    ("train_samples", 20, REFUSED, "`DataConfig.train_samples`"),
    ("init_from", Path("/elsewhere/run/drafter"), REFUSED, "`DrafterTrainConfig.init_from`"),
    ("seed", 8, REFUSED, "`DataConfig.seed`"),
    ("tokens_per_microbatch", 5000, REFUSED, "`DataConfig.tokens_per_microbatch`"),
    ("snapshot", None, REFUSED, "index snapshot (snapshot.parquet)"),
    ("world_size", 2, TOPOLOGY, "`LaunchConfig.gpus`/`LaunchConfig.num_cpu_workers` (world size)"),
    ("grad_accum", 1, TOPOLOGY, "`TopologyConfig.grad_accum`"),
    ("lr", 1e-3, ANNOUNCED, "`OptimizerConfig.lr`"),
    ("weight_decay", 0.1, ANNOUNCED, "`OptimizerConfig.weight_decay`"),
    ("warmup_ratio", 0.1, ANNOUNCED, "`OptimizerConfig.warmup_ratio`"),
    ("grad_clip", 0.5, ANNOUNCED, "`OptimizerConfig.grad_clip`"),
    ("epochs", 9, ANNOUNCED, "`OptimizerConfig.epochs`"),
    ("max_steps", 30, ANNOUNCED, "`OptimizerConfig.max_steps`"),
    ("val_every", 5, ANNOUNCED, "`ValidationConfig.val_every`"),
    ("val_chain_tokens", 64, ANNOUNCED, "`ValidationConfig.val_chain_tokens`"),
    ("early_stop", 3, ANNOUNCED, "`ValidationConfig.early_stop`"),
    ("final_norm_init", 0.5, FREE, ""),
    ("autocast", "off", FREE, ""),
    ("prefetch", 8, FREE, ""),
    ("loader_threads", 1, FREE, ""),
    ("deterministic", False, FREE, ""),
    ("checkpoint_every", 7, FREE, ""),
    ("keep_checkpoints", 5, FREE, ""),
    ("resume", "never", FREE, ""),
    ("allow_topology_change", True, FREE, ""),
    ("attention", "sdpa", FREE, ""),
    ("export_initial", True, FREE, ""),
    ("log_every", 4, FREE, ""),
    ("compile", "on", FREE, ""),
    ("tensorboard_dir", Path("tb-elsewhere"), FREE, ""),
    ("tensorboard", False, FREE, ""),
    ("on_damaged", "skip", FREE, ""),
    ("export_at_end", False, FREE, ""),
    ("follow", True, FREE, ""),  # a follow run's segments are plain runs (follow off): train/follow.py
    ("passes", 3, FREE, ""),  # follow.json holds a follow run's passes and refuses another value
    ("layout_by_device", ("num_anchors",), FREE, ""),
    ("fuse_microbatches", True, FREE, ""),
    ("cache_dir", Path("moved-cache"), FREE, ""),  # the samples are the snapshot's row
    ("out_dir", Path("run"), FREE, ""),
    ("gpus", (0, 1), FREE, ""),  # the ranks are the world_size row
    ("num_cpu_workers", 2, FREE, ""),
    ("threads_per_worker", 3, FREE, ""),
    ("progress", False, FREE, ""),
]


def snapshot(num_samples: int = 40) -> IndexSnapshot:
    rng = np.random.default_rng(num_samples)
    tokens = rng.integers(10, 300, num_samples)
    return snapshot_from_columns([f"s:{i:03d}" for i in range(num_samples)], tokens, np.zeros(num_samples))


def base_config(tmp_path: Path) -> TrainConfig:
    return TrainConfig.from_options(
        cache_dir=tmp_path / "cache",
        out_dir=tmp_path / "run",
        num_layers=1,
        block_size=8,
        num_anchors=32,
        tokens_per_microbatch=4096,
        grad_accum=2,
        max_steps=12,
        deterministic=True,
    )


def saved_run(config: TrainConfig, train_snapshot: IndexSnapshot) -> dict[str, Any]:
    """Save the run as ``dflash train`` does (its config.json); the planner state of a checkpoint."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    (config.out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    planner = LengthMixingPlanner(
        train_snapshot,
        seed=config.data.seed,
        tokens_per_microbatch=config.data.tokens_per_microbatch,
        grad_accum=config.topology.grad_accum,
        world_size=WORLD_SIZE,
    )
    for step in planner.iterate(1):  # a few steps into the epoch
        planner.step_done(step)
        if step.global_step == 1:
            break
    return planner.state_dict()


def resume_with(tmp_path: Path, field: str, value: Any, *, allow_topology_change: bool = False) -> list[str]:
    """``check_resume`` of the base run against an invocation with ``field`` set to ``value``."""
    config = base_config(tmp_path)
    planner_state = saved_run(config, snapshot())
    train_snapshot, world_size = snapshot(), WORLD_SIZE
    if field == "snapshot":
        train_snapshot = snapshot(41)
    elif field == "world_size":
        world_size = value
    else:
        config = config.with_options(**{field: value})
    return check_resume(
        ResumeContract.stored(config.out_dir, planner_state),
        ResumeContract.of(config, world_size=world_size, train_snapshot=train_snapshot),
        allow_topology_change=allow_topology_change,
        run_dir=config.out_dir,
    )


def test_the_same_invocation_resumes_without_a_note(tmp_path: Path) -> None:
    assert resume_with(tmp_path, "lr", base_config(tmp_path).optimizer.lr) == []


def option_value(config: TrainConfig, name: str) -> Any:
    """The value of the option ``name`` of ``config``, in whichever section holds it."""
    (option,) = [o for o in option_fields(TrainConfig) if o.name == name]
    return getattr(config if option.section is None else getattr(config, option.section), name)


def test_every_option_has_a_verdict() -> None:
    """A new ``dflash train`` option is classified here (and in RULES when a resume must judge it)."""
    options = {o.name for o in option_fields(TrainConfig)}
    assert options == {field for field, *_ in CHANGES} - {"snapshot", "world_size"}


def test_every_option_has_the_rule_its_verdict_shows() -> None:
    """Each section of ``TrainConfig`` declares the resume rule of its options (the contract is derived from
    them), the one this table's verdict shows; a section added without one is refused when the module
    loads."""
    rule_of_verdict = {REFUSED: Rule.FIXED, TOPOLOGY: Rule.TOPOLOGY, ANNOUNCED: Rule.APPLIED, FREE: Rule.FREE}
    expected = {field: rule_of_verdict[verdict] for field, _, verdict, _ in CHANGES}
    for o in option_fields(TrainConfig):
        assert resume_rule(o.owner, o.field) is expected[o.name], o.name

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        new_option: int = cli_field(0, min=1)

    with pytest.raises(ValueError, match=r"Undeclared declares no resume rule"):
        resume_rule(Undeclared, dataclasses.fields(Undeclared)[0])


def test_an_option_has_its_sections_rule_but_the_two_commented_overrides() -> None:
    """A reader learns an option's rule from its section: the only options whose rule is their own are the
    optimizer's algorithm (its state is the checkpoint's) and the final norm's initial weight (read only by
    a fresh run)."""
    sections = {o.owner for o in option_fields(TrainConfig)}
    assert {s.__name__: s.RESUME_RULE for s in sections} == {
        "TrainConfig": Rule.FREE,
        "DrafterTrainConfig": Rule.FIXED,
        "DataConfig": Rule.FIXED,
        "TopologyConfig": Rule.TOPOLOGY,
        "OptimizerConfig": Rule.APPLIED,
        "ValidationConfig": Rule.APPLIED,
        "CheckpointConfig": Rule.FREE,
        "LaunchConfig": Rule.FREE,
        "LoggingConfig": Rule.FREE,
        "WindowConfig": Rule.FREE,
    }
    overrides = {
        o.name: resume_rule(o.owner, o.field)
        for o in option_fields(TrainConfig)
        if resume_rule(o.owner, o.field) is not o.owner.RESUME_RULE
    }
    assert overrides == {"algorithm": Rule.FIXED, "final_norm_init": Rule.FREE}


def test_an_option_newer_than_old_runs_declares_what_its_absence_meant() -> None:
    assert OPTIONS_ADDED_SINCE == {
        "feature_scale": "none",  # features fed to fc unscaled
        "final_norm_init": 1.0,  # the final norm's weight before the recipe change
        "init_from": None,  # random initial weights
        "train_samples": None,  # every sample not held out
        "follow": False,
        "passes": 2,
    }


@pytest.mark.parametrize(("field", "value", "verdict", "flag"), CHANGES, ids=[row[0] for row in CHANGES])
def test_each_change_gets_its_verdict(
    tmp_path: Path, field: str, value: Any, verdict: str, flag: str
) -> None:
    if verdict == FREE:
        assert resume_with(tmp_path, field, value) == []
        return
    if verdict == ANNOUNCED:
        before = option_value(base_config(tmp_path), field)
        assert resume_with(tmp_path, field, value) == [
            f"resuming with {flag} {value!r} (the previous run used {before!r}): applied from the resumed "
            "step on"
        ]
        return
    with pytest.raises(ResumeError) as refused:
        resume_with(tmp_path, field, value)
    message = str(refused.value)
    assert "\n" not in message
    assert f"was trained with {flag} " in message
    assert f"this run asks for {flag} " in message
    assert f"resume with the same {flag}," in message
    if field != "snapshot":  # both values, as the option spells them
        before = WORLD_SIZE if field == "world_size" else option_value(base_config(tmp_path), field)
        shown = str(value) if isinstance(value, Path) else value  # as config.json holds it
        assert f"{flag} {before!r}, this run asks for {flag} {shown!r};" in message
    else:
        assert f"{flag} {snapshot().snapshot_id[:12]}… (40 training samples), this run asks for " in message
        assert f"{flag} {snapshot(41).snapshot_id[:12]}… (41 training samples);" in message
    allowed = "`CheckpointConfig.allow_topology_change` to plan the rest of the epoch" in message
    assert allowed == (verdict == TOPOLOGY)
    if verdict == TOPOLOGY:
        assert resume_with(tmp_path, field, value, allow_topology_change=True) == []
    else:
        with pytest.raises(ResumeError, match=re.escape(flag)):
            resume_with(tmp_path, field, value, allow_topology_change=True)


def test_every_refused_change_is_named_in_one_line(tmp_path: Path) -> None:
    config = base_config(tmp_path)
    planner_state = saved_run(config, snapshot())
    changed = config.with_options(num_layers=3, seed=5, grad_accum=4, lr=1.0)
    with pytest.raises(ResumeError) as refused:
        check_resume(
            ResumeContract.stored(config.out_dir, planner_state),
            ResumeContract.of(changed, world_size=2, train_snapshot=snapshot()),
            allow_topology_change=False,
            run_dir=config.out_dir,
        )
    world = "`LaunchConfig.gpus`/`LaunchConfig.num_cpu_workers` (world size)"
    layers, seed, accum = (
        "`DrafterTrainConfig.num_layers`",
        "`DataConfig.seed`",
        "`TopologyConfig.grad_accum`",
    )
    assert str(refused.value) == (
        f"{config.out_dir} was trained with {layers} 1, {seed} 0, {world} 4 and {accum} 2, this run asks for "
        f"{layers} 3, {seed} 5, {world} 2 and {accum} 4; resume with the same {layers}, {seed}, {world} and "
        f"{accum}, or train into a new `TrainConfig.out_dir` (or pass `CheckpointConfig.resume` never to "
        "start over there)"
    )


def test_a_config_json_that_does_not_read_leaves_the_checkpoints_plan_to_compare(tmp_path: Path) -> None:
    config = base_config(tmp_path)
    planner_state = saved_run(config, snapshot())
    (config.out_dir / "config.json").write_text('{"num_layers": 1, "blo')  # cut short
    stored = ResumeContract.stored(config.out_dir, planner_state)
    assert stored.options is None

    def check(changed: TrainConfig) -> list[str]:
        current = ResumeContract.of(changed, world_size=WORLD_SIZE, train_snapshot=snapshot())
        return check_resume(stored, current, allow_topology_change=False, run_dir=config.out_dir)

    assert check(config.with_options(num_layers=3, lr=1.0)) == []  # as before the contract
    with pytest.raises(ResumeError, match=r"`DataConfig\.seed` 0"):
        check(config.with_options(seed=3))


def test_an_unknown_planner_state_version_is_refused_when_the_checkpoint_loads(tmp_path: Path) -> None:
    config = base_config(tmp_path)
    planner_state = saved_run(config, snapshot())
    state = TrainState(
        global_step=2,
        model={},
        optimizer={},
        planner={**planner_state, "version": 99},
        rng={},
        tokens_seen=0,
        world_size=WORLD_SIZE,
    )
    save_checkpoint(config.out_dir, state, keep=2)
    with pytest.raises(
        ResumeError,
        match=r"format version 1 \(planner state 99\), this dflash-offline reads 1 \(planner state 1\)",
    ):
        load_latest_checkpoint(config.out_dir)
    save_checkpoint(config.out_dir, dataclasses.replace(state, planner=planner_state), keep=2)
    loaded = load_latest_checkpoint(config.out_dir)
    assert loaded is not None
    assert loaded.planner == planner_state


def test_a_config_json_from_before_feature_scale_reads_as_the_unscaled_run_it_was(tmp_path: Path) -> None:
    """A run written before ``--feature-scale`` existed trained on unscaled features: it resumes with
    ``--feature-scale none``, and the default (``dim``) is refused naming the value to pass."""
    config = base_config(tmp_path)
    planner_state = saved_run(config.with_options(feature_scale="none"), snapshot())
    flat = flat_config_json(json.loads((config.out_dir / "config.json").read_text()))  # that run's was flat
    del flat["feature_scale"]
    (config.out_dir / "config.json").write_text(json.dumps(flat))
    stored = ResumeContract.stored(config.out_dir, planner_state)

    def resume(feature_scale: str) -> list[str]:
        current = ResumeContract.of(
            config.with_options(feature_scale=feature_scale),
            world_size=WORLD_SIZE,
            train_snapshot=snapshot(),
        )
        return check_resume(stored, current, allow_topology_change=False, run_dir=config.out_dir)

    assert resume("none") == []
    assert config.drafter.feature_scale == "dim"  # the default since
    with pytest.raises(
        ResumeError,
        match=r"trained with `DrafterTrainConfig\.feature_scale` 'none'.*"
        r"resume with the same `DrafterTrainConfig\.feature_scale`",
    ):
        resume("dim")
