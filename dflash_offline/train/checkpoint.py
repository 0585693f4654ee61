"""Training checkpoints: everything needed to continue exactly, written atomically.

``RUN/checkpoints/step-<N>/`` holds ``state.pt`` (trainable weights, optimizer, scheduler, planner
state, RNG states, step counters) and ``meta.json``. A checkpoint is written to a temporary folder and
renamed into place, so a kill -9 mid-write leaves the previous one intact; the newest complete
``step-*`` folder is the one ``--resume auto`` picks up.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_offline.errors import ResumeError

CHECKPOINT_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainState:
    """What a checkpoint restores (tensors stay in the dicts: they are torch state dicts)."""

    global_step: int
    """Optimizer steps completed."""
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    planner: dict[str, Any]
    rng: dict[str, Any]
    tokens_seen: int
    world_size: int


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
    tmp.mkdir()
    torch.save(
        {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "global_step": state.global_step,
            "model": state.model,
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "planner": state.planner,
            "rng": state.rng,
            "tokens_seen": state.tokens_seen,
            "world_size": state.world_size,
        },
        tmp / "state.pt",
    )
    meta = {"format_version": CHECKPOINT_FORMAT_VERSION, "global_step": state.global_step}
    (tmp / "meta.json").write_text(json.dumps(meta))
    for path in (tmp / "state.pt", tmp / "meta.json"):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # a re-save of the same step after a resume
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _step, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in folder.glob(".tmp-*"):  # left by a kill mid-write
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load_latest_checkpoint(run_dir: Path) -> TrainState | None:
    found = list_checkpoints(run_dir)
    if not found:
        return None
    _step, path = found[-1]
    raw = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    if raw.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise ResumeError(
            f"checkpoint {path} has format version {raw.get('format_version')!r}, this dflash-offline "
            f"reads {CHECKPOINT_FORMAT_VERSION}; train into a new --out directory"
        )
    return TrainState(
        global_step=int(raw["global_step"]),
        model=raw["model"],
        optimizer=raw["optimizer"],
        scheduler=raw["scheduler"],
        planner=raw["planner"],
        rng=raw["rng"],
        tokens_seen=int(raw["tokens_seen"]),
        world_size=int(raw["world_size"]),
    )
