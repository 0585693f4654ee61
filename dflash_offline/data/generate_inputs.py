"""The data files a cache was generated from, as its ``dflash generate`` runs recorded them.

Each generate run writes its typed config into the cache's runs table (``cache/manifest.py:record_run``);
its ``data`` and ``data_format`` name the file it read. Training reads them for the conversation roots
of samples whose rows do not store one (train/snapshot.py), and ``dflash eval`` for the records behind the
samples (eval/cache_data.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.data.schemas import DataFormat


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateInput:
    """One data file a ``dflash generate`` run of the cache read."""

    data: str | None
    """The ``data`` it was given (None: the embedded ShareGPT file); relative to that run's directory."""
    data_format: DataFormat
    """Its ``data_format``."""


def generate_inputs(cache_dir: Path) -> list[GenerateInput]:
    """The distinct data files of the cache's generate runs, oldest first."""
    from dflash_offline.cache.manifest import read_runs

    seen: list[GenerateInput] = []
    for run in read_runs(cache_dir):
        if run.command != "generate":
            continue
        try:
            config = json.loads(run.config_json)
        except json.JSONDecodeError:
            continue
        if not isinstance(config, dict) or "data" not in config:
            continue
        data = config.get("data")
        item = GenerateInput(
            data=data if isinstance(data, str) else None, data_format=config.get("data_format", "auto")
        )
        if item not in seen:
            seen.append(item)
    return seen
