"""Where a drafter export may be written, and where a training run may live, whatever path spelling or
symlink leads there (every path is resolved first).

An export (``dflash export --out``) never writes into a training run or a cache (nor into a folder inside
one), and replaces only an earlier export: a directory that does not exist, is empty, or holds nothing but
an export's files with a ``DFlashDraftModel`` config.json. ``dflash export RUN --out RUN`` would otherwise
replace ``RUN/config.json`` and leave a run that neither resumes nor exports. A training run (``dflash
train --out``) is never started over a directory whose config.json is not a run's (an export, a model
directory), which it would replace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.drafter.export import ARCHITECTURE, CONFIG_FILE, README_FILE, WEIGHTS_FILE
from dflash_offline.errors import ConfigError
from dflash_offline.train.checkpoint import checkpoints_dir
from dflash_offline.train.split import SNAPSHOT_FILE

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
