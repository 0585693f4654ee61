"""A training run's checkpoints: written atomically, never with diverged weights, the one a run
continues, and a drafter exported from one."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.layout import CacheLayout, read_fingerprint
from dflash_offline.config_fields import field_ref
from dflash_offline.drafter.export import ARCHITECTURE, CONFIG_FILE, README_FILE, WEIGHTS_FILE
from dflash_offline.errors import ConfigError, DivergedError, NoSpaceError, ResumeError, is_no_space
from dflash_offline.placement import DistInfo
from dflash_offline.train.config import (
    DataConfig,
    OptimizerConfig,
    TopologyConfig,
    TrainConfig,
)
from dflash_offline.train.planner import PLANNER_STATE_VERSION
from dflash_offline.train.resume_contract import ResumeContract, check_resume
from dflash_offline.train.snapshot import SNAPSHOT_FILE, IndexSnapshot
from dflash_offline.train.step import DrafterSetup, build_drafter_setup
from dflash_offline.writable import check_writable_dir

if TYPE_CHECKING:
    from dflash_offline.drafter.model_card import EvalFacts


# ─── Checkpoints ────────────────────────────────────────────────────────────────────────────────────────────
# Training checkpoints: everything needed to continue exactly, written atomically.
#
# ``RUN/checkpoints/step-<N>/`` holds ``state.pt`` (trainable weights, optimizer, planner state, RNG
# states, step counters) and ``meta.json``. A checkpoint is written to a temporary folder and
# renamed into place, so a kill -9 mid-write leaves the previous one intact; the newest complete
# ``step-*`` folder is the one ``--resume auto`` picks up. A newest checkpoint that does not load (a
# truncated ``state.pt``: a disk that lost data the rename had promised, a hand copy cut short) is renamed
# ``step-<N>.unreadable`` with a printed note, and the next older one is used; so is one whose weights hold a
# NaN or an Inf (written by a diverged run before train/checkpoint.py kept such weights from a checkpoint).
#
# A full disk while saving raises ``CheckpointNoSpaceError`` (one line naming the folder) instead of
# PyTorch's ``inline_container.cc … unexpected pos``; the partial folder is removed, older checkpoints
# stay.


CHECKPOINT_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


CheckpointNoSpaceError = NoSpaceError
"""A full disk while writing a checkpoint or the metrics log: the package's one no-space error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainState:
    """What a checkpoint restores (tensors stay in the dicts: they are torch state dicts)."""

    global_step: int
    """Optimizer steps completed."""
    model: dict[str, Any]
    optimizer: dict[str, Any]
    planner: dict[str, Any]
    rng: dict[str, Any]
    tokens_seen: int
    world_size: int
    validation: dict[str, Any] = field(default_factory=dict)
    """``ValidationTracker.state_dict()`` (empty in a run without validation)."""


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, as (global_step, folder)."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / "state.pt").is_file() and (path / "meta.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(run_dir: Path, state: TrainState, *, keep: int) -> Path:
    """Write ``state`` atomically; keep the newest ``keep`` checkpoints."""
    folder = checkpoints_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{state.global_step:08d}"
    tmp = folder / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write(tmp, state)
    except (OSError, RuntimeError) as e:
        full = is_no_space(e, folder)  # decided before the partial folder frees its space
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise CheckpointNoSpaceError(folder) from None
        raise
    if final.exists():  # a re-save of the same step after a resume
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(folder)
    for _step, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in folder.glob(".tmp-*"):  # left by a kill mid-write
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (without it a crash can keep the name and lose the data)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - a file system without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write(tmp: Path, state: TrainState) -> None:
    tmp.mkdir()
    torch.save(
        {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "global_step": state.global_step,
            "model": state.model,
            "optimizer": state.optimizer,
            "planner": state.planner,
            "rng": state.rng,
            "tokens_seen": state.tokens_seen,
            "world_size": state.world_size,
            "validation": state.validation,
        },
        tmp / "state.pt",
    )
    meta = {"format_version": CHECKPOINT_FORMAT_VERSION, "global_step": state.global_step}
    (tmp / "meta.json").write_text(json.dumps(meta))
    for path in (tmp / "state.pt", tmp / "meta.json"):
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _refuse_nonfinite(raw: Any) -> None:
    """Raise ``DivergedError`` for a checkpoint whose weights hold a NaN or an Inf (one a diverged run wrote
    before dflash-offline refused to write one): a resume would train NaN."""
    from dflash_offline.drafter.export import nonfinite_tensors

    model = raw.get("model") if isinstance(raw, dict) else None
    bad = nonfinite_tensors(model) if isinstance(model, dict) else []
    if bad:
        raise DivergedError(f"non-finite weights (NaN or Inf) in {', '.join(bad[:3])}")


def load_latest_checkpoint(run_dir: Path, *, is_main: bool = True) -> TrainState | None:
    """The newest checkpoint that loads; unreadable newer ones are set aside (by the main rank) with a
    note. None when there is no checkpoint; ``ResumeError`` when none of them loads, or when the newest
    that loads has a format this version does not read (its own, or its planner state's).

    This decides only whether a checkpoint file can be read. Whether this invocation may continue it
    (the same drafter, plan and samples) is the run's ``ResumeContract`` (train/resume_contract.py)."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    problems = []
    for _step, path in reversed(found):
        try:
            raw = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
            _refuse_nonfinite(raw)
        except Exception as e:  # truncated zip, bad pickle, vanished file, NaN weights: "not usable"
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            problems.append(f"{path.name}: {reason}")
            if is_main:
                aside = path.with_name(path.name + ".unreadable")
                with_note = f"dflash train: checkpoint {path} does not load ({reason})"
                try:
                    shutil.rmtree(aside, ignore_errors=True)
                    os.replace(path, aside)
                    with_note += f"; moved to {aside.name}"
                except OSError:
                    pass
                print(with_note + "; trying the previous one", file=sys.stderr, flush=True)
            continue
        versions = (raw.get("format_version"), raw.get("planner", {}).get("version"))
        if versions != (CHECKPOINT_FORMAT_VERSION, PLANNER_STATE_VERSION):
            raise ResumeError(
                f"checkpoint {path} has format version {versions[0]!r} (planner state {versions[1]!r}), this "
                f"dflash-offline reads {CHECKPOINT_FORMAT_VERSION} (planner state {PLANNER_STATE_VERSION}); "
                "train into a new --out directory"
            )
        if problems and is_main:
            print(
                f"dflash train: resuming from {path.name} (step {int(raw['global_step'])})", file=sys.stderr
            )
        return TrainState(
            global_step=int(raw["global_step"]),
            model=raw["model"],
            optimizer=raw["optimizer"],
            planner=raw["planner"],
            rng=raw["rng"],
            tokens_seen=int(raw["tokens_seen"]),
            world_size=int(raw["world_size"]),
            validation=dict(raw["validation"]),
        )
    raise ResumeError(
        f"no checkpoint in {checkpoints_dir(run_dir)} loads ({'; '.join(problems)}); "
        "pass --resume never to start over, or train into a new --out"
    )


# ─── Divergence ─────────────────────────────────────────────────────────────────────────────────────────────
# A diverged run stops: the first step whose loss or gradient norm is not finite (NaN or Inf) ends training
# with a ``DivergedError`` naming it, and no checkpoint or export is ever written from non-finite weights.
#
# The step stays sync-free (train/step.py): its results are checked where the loop reads them back anyway
# (each metrics line, a validation, a checkpoint; train/trainer.py keeps the steps run since the last
# read-back and reads them in one copy), so a run stops at most ``--log-every`` steps after it diverged,
# and at the step itself with the default of 1. A NaN gradient norm makes the clipped update NaN, so every
# weight after that step is NaN too: there is nothing to continue from but the newest checkpoint, which was
# written from finite weights (``check_weights_finite`` before every checkpoint, whatever the losses said).
# Every rank reads the same all-reduced values at the same steps, so under DDP they all stop together.


@dataclass(frozen=True, kw_only=True, slots=True)
class NonFiniteStep:
    """The first step read back whose loss or gradient norm is NaN or Inf."""

    step: int
    """Optimizer steps completed, that one included (1-based, as in metrics.jsonl)."""
    loss: float
    grad_norm: float
    """The total gradient norm before clipping."""

    def describe(self) -> str:
        return f"loss {self.loss} and gradient norm {self.grad_norm}"


def first_nonfinite(steps: Sequence[tuple[int, float, float]]) -> NonFiniteStep | None:
    """The first of ``(step, loss, grad_norm)`` with a non-finite loss or gradient norm; None when all are
    finite."""
    for step, loss, grad_norm in steps:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return NonFiniteStep(step=step, loss=loss, grad_norm=grad_norm)
    return None


def diverged_error(out_dir: Path, what: str, *, step: int, stopped_after: int) -> DivergedError:
    """What the user reads: ``what`` went non-finite at ``step``, the checkpoint a resume continues from,
    what to change."""
    where = f"at step {step}"
    if stopped_after != step:
        where += f" (read back after step {stopped_after})"
    found = list_checkpoints(out_dir)
    if found:
        saved_step, path = found[-1]
        keep = (
            f"the newest checkpoint, {path.name} (step {saved_step}), holds finite weights: rerun with a "
            f"lower {field_ref(OptimizerConfig, 'lr')} to resume from it"
        )
    else:
        keep = f"the run has no checkpoint: train again with a lower {field_ref(OptimizerConfig, 'lr')}"
    return DivergedError(
        f"training diverged: {what} {where}; stopped without "
        f"a checkpoint or export of the non-finite weights; {keep} (a larger "
        f"{field_ref(OptimizerConfig, 'warmup_ratio')} or a smaller "
        f"{field_ref(OptimizerConfig, 'grad_clip')} may help too)"
    )


def check_weights_finite(out_dir: Path, params: Sequence[torch.Tensor], *, step: int) -> None:
    """Raise ``DivergedError`` before a checkpoint of step ``step`` when a weight is NaN or Inf (an update
    that overflowed although its gradient was finite). One reduction and one host sync: a checkpoint
    copies every weight to the host anyway."""
    finite = torch.stack([torch.isfinite(p.detach()).all() for p in params]).all()
    if not bool(finite):
        raise diverged_error(out_dir, "non-finite weights", step=step, stopped_after=step)


# ─── The checkpoint a run continues ─────────────────────────────────────────────────────────────────────────
# Which checkpoint a ``dflash train`` invocation continues, and the config it goes on with: the newest
# checkpoint that loads, once the run's ``ResumeContract`` (train/resume_contract.py) admits this invocation,
# with the run's own microbatch layout where the invocation left it to the device's default.


def checkpoint_to_resume(
    config: TrainConfig, info: DistInfo, train_snapshot: IndexSnapshot
) -> tuple[TrainConfig, TrainState | None]:
    """With ``resume="auto"``, the newest checkpoint that loads, once the run's ``ResumeContract`` admits
    this invocation (the one compatibility decision; its applied changes are announced by rank 0), and the
    config to go on with: the run's own microbatch layout where this invocation left it to the device's
    default. (config, None) when starting fresh."""
    state = (
        load_latest_checkpoint(config.out_dir, is_main=info.is_main)
        if config.checkpoint.resume == "auto"
        else None
    )
    if state is None:
        return config, None
    stored = ResumeContract.stored(config.out_dir, state.planner)
    config, adopted = _run_layout(config, stored)
    notes = check_resume(
        stored,
        ResumeContract.of(config, world_size=info.world_size, train_snapshot=train_snapshot),
        allow_topology_change=config.checkpoint.allow_topology_change,
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
    here = {
        "grad_accum": config.topology.grad_accum,
        "tokens_per_microbatch": config.data.tokens_per_microbatch,
        "num_anchors": config.data.num_anchors,
    }
    changed: dict[str, Any] = {
        name: run_values[name]
        for name in config.layout_by_device
        if run_values[name] is not None and run_values[name] != here[name]
    }
    flags = {
        "grad_accum": field_ref(TopologyConfig, "grad_accum"),
        "tokens_per_microbatch": field_ref(DataConfig, "tokens_per_microbatch"),
        "num_anchors": field_ref(DataConfig, "num_anchors"),
    }
    notes = [
        f"resuming with the run's own {flags[name]} {value} (left to the device's default, {here[name]} here)"
        for name, value in changed.items()
    ]
    return (config.with_options(**changed) if changed else config), notes


# ─── Where exports and runs may live ────────────────────────────────────────────────────────────────────────
# Where a drafter export may be written, and where a training run may live, whatever path spelling or
# symlink leads there (every path is resolved first).
#
# An export (``dflash export --out``) never writes into a training run or a cache (nor into a folder inside
# one), and replaces only an earlier export: a directory that does not exist, is empty, or holds nothing but
# an export's files with a ``DFlashDraftModel`` config.json. ``dflash export RUN --out RUN`` would otherwise
# replace ``RUN/config.json`` and leave a run that neither resumes nor exports. A training run (``dflash
# train --out``) is never started over a directory whose config.json is not a run's (an export, a model
# directory), which it would replace.


_EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, README_FILE})


def _json_of(path: Path) -> Any:
    """The JSON value of ``path``; None when it is missing or not JSON."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def is_training_run(path: Path) -> bool:
    """``path`` holds a ``dflash train`` run: its config.json, checkpoints or sample snapshot."""
    config = _json_of(path / CONFIG_FILE)
    if isinstance(config, dict) and "cache_dir" in config and "out_dir" in config:
        return True
    return checkpoints_dir(path).is_dir() or (path / SNAPSHOT_FILE).is_file()


def is_cache(path: Path) -> bool:
    return CacheLayout.at(path).cache_json.is_file()


def is_export_config(path: Path) -> bool:
    """``path`` (a config.json) is a DFlash drafter export's."""
    config = _json_of(path)
    archs = config.get("architectures") if isinstance(config, dict) else None
    return isinstance(archs, list) and ARCHITECTURE in archs


def _enclosing(resolved: Path) -> tuple[str, Path] | None:
    """The training run or cache that ``resolved`` is, or lies inside: (what, where); else None."""
    for folder in (resolved, *resolved.parents):
        if is_training_run(folder):
            return "the training run", folder
        if is_cache(folder):
            return "the cache", folder
    return None


def check_export_out(out_dir: Path, *, option: str) -> None:
    """Refuse (``ConfigError``, one line) an export into a run or a cache, or over anything but an earlier
    export."""
    resolved = out_dir.resolve()
    inside = _enclosing(resolved)
    if inside is not None:
        what, where = inside
        at = "is" if where == resolved else "is inside"
        raise ConfigError(
            f"{option} {out_dir} {at} {what} {where}: an export never writes into a training run or a "
            f"cache; choose a directory outside it"
        )
    if not resolved.is_dir():
        return
    foreign = sorted(
        entry.name + ("/" if entry.is_dir() else "")
        for entry in resolved.iterdir()
        if entry.name not in _EXPORT_FILES and not entry.name.startswith(".")
    )
    config = resolved / CONFIG_FILE
    if foreign or (config.exists() and not is_export_config(config)):
        found = ", ".join(foreign[:3]) if foreign else f"a {CONFIG_FILE} that is not a drafter export's"
        raise ConfigError(
            f"{option} {out_dir} holds {found}: an export replaces only an earlier export; choose a new or "
            "empty directory"
        )


def check_run_out(out_dir: Path, *, option: str) -> None:
    """Refuse (``ConfigError``) a training run over a directory whose config.json is not a run's."""
    resolved = out_dir.resolve()
    config = resolved / CONFIG_FILE
    if config.exists() and not is_training_run(resolved):
        kind = "a drafter export's" if is_export_config(config) else "not a training run's"
        raise ConfigError(
            f"{option} {out_dir}: its {CONFIG_FILE} is {kind}, and a run would replace it; choose a new or "
            "empty directory (or the directory of the run to resume)"
        )


# ─── Exporting a run's drafter ──────────────────────────────────────────────────────────────────────────────
# Export a training run's drafter (from a checkpoint) in z-lab's DFlash layout, with its model card.


EVAL_REPORT_NAME = "eval.json"
"""A ``dflash eval --json`` report at ``RUN/eval.json`` goes into the model card without being named."""


def export_run(
    run_dir: Path,
    out_dir: Path,
    *,
    dtype: str = "bfloat16",
    step: int | None = None,
    eval_report: Path | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` + ``README.md`` for the checkpoint at ``step`` (default
    newest); the card's τ table comes from ``eval_report``, else from ``RUN/eval.json`` when it exists.

    The ``ResumeError`` raised here says a run directory or checkpoint is not there; nothing is resumed, so
    no resume compatibility is decided (that is train/resume_contract.py's, for ``dflash train``)."""
    from dflash_offline.drafter.export import export_drafter, nonfinite_tensors
    from dflash_offline.drafter.model_card import read_eval_report

    check_export_out(out_dir, option="--out")
    check_writable_dir(out_dir, option="--out")
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise ResumeError(f"{run_dir} is not a training run directory (no config.json)")
    config = TrainConfig.from_dict(json.loads(config_path.read_text()))
    found = dict(list_checkpoints(run_dir))
    if not found:
        raise ResumeError(f"{run_dir} has no checkpoint yet")
    chosen = max(found) if step is None else step
    if chosen not in found:
        raise ResumeError(f"{run_dir} has no checkpoint of step {step}; it has {sorted(found)}")
    if eval_report is None and (run_dir / EVAL_REPORT_NAME).is_file():
        eval_report = run_dir / EVAL_REPORT_NAME
    evaluated = read_eval_report(eval_report) if eval_report is not None else None  # fails before writing
    fingerprint = read_fingerprint(config.cache_dir)
    setup = build_drafter_setup(config, fingerprint, device=torch.device("cpu"))
    state = torch.load(found[chosen] / "state.pt", map_location="cpu", weights_only=False)
    bad = nonfinite_tensors(state["model"])
    if bad:  # a checkpoint written by a diverged run before dflash-offline refused to write one
        others = sorted(set(found) - {chosen})
        raise DivergedError(
            f"{found[chosen] / 'state.pt'}: non-finite weights (NaN or Inf) in {', '.join(bad[:3])}: the run "
            f"had diverged by step {chosen}; export an earlier checkpoint with --step (the run has {others})"
        )
    if "feature_scale_F" in state["model"]:  # a --feature-scale run: the export folds it into fc
        setup.model.set_feature_scale(state["model"]["feature_scale_F"])
    setup.model.load_state_dict(state["model"])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    readme = _model_card(
        config, fingerprint, setup, step=chosen, dtype=dtype, evaluated=evaluated, out_dir=out_dir
    )
    return export_drafter(setup.model, out_dir, dtype=torch_dtype, readme=readme)


def _model_card(
    config: TrainConfig,
    fingerprint: CacheFingerprint,
    setup: DrafterSetup,
    *,
    step: int,
    dtype: str,
    evaluated: EvalFacts | None,
    out_dir: Path,
) -> str:
    from dflash_offline.drafter.model_card import CardFacts, render_model_card, serve_target_for

    run = config.optimizer
    length = f"--max-steps {run.max_steps}" if run.max_steps else f"--epochs {run.epochs}"
    facts = CardFacts(
        target_id=fingerprint.target_id,
        weights_hash=fingerprint.weights_hash,
        serve_target=serve_target_for(fingerprint.target_id, setup.target_spec),
        data_source=fingerprint.data_source,
        cache_dir=str(config.cache_dir),
        step=step,
        run_length=f"a run of {length}, seed {config.data.seed}",
        dtype=dtype,
        eval=evaluated,
    )
    return render_model_card(facts, setup.model.config, out_dir)
