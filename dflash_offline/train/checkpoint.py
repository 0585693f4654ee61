"""Training checkpoints: everything needed to continue exactly, written atomically.

``RUN/checkpoints/step-<N>/`` holds ``state.pt`` (trainable weights, optimizer, planner state, RNG
states, step counters) and ``meta.json``. A checkpoint is written to a temporary folder and
renamed into place, so a kill -9 mid-write leaves the previous one intact; the newest complete
``step-*`` folder is the one ``--resume auto`` picks up. A newest checkpoint that does not load (a
truncated ``state.pt``: a disk that lost data the rename had promised, a hand copy cut short) is renamed
``step-<N>.unreadable`` with a printed note, and the next older one is used; so is one whose weights hold a
NaN or an Inf (written by a diverged run before train/divergence.py kept such weights from a checkpoint).

A full disk while saving raises ``CheckpointNoSpaceError`` (one line naming the folder) instead of
PyTorch's ``inline_container.cc … unexpected pos``; the partial folder is removed, older checkpoints
stay.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_offline.errors import DivergedError, NoSpaceError, ResumeError
from dflash_offline.train.length_mixing import PLANNER_STATE_VERSION

CHECKPOINT_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_LOW_SPACE_BYTES = 64 << 20
"""Free space below which a failed write is put down to a full disk (torch.save's writer reports a
short write as ``unexpected pos``, without the errno)."""


CheckpointNoSpaceError = NoSpaceError
"""A full disk while writing a checkpoint or the metrics log: the package's one no-space error."""


def is_no_space(error: BaseException, path: Path) -> bool:
    """True when ``error`` (an OSError, or torch's RuntimeError from its zip writer) came from a full
    disk under ``path``."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if isinstance(error, OSError | RuntimeError):
        try:
            return shutil.disk_usage(path).free < _LOW_SPACE_BYTES
        except OSError:
            return False
    return False


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
