"""The validation split: samples of a run's snapshot held out of training, chosen by their id alone.

A sample is a validation sample when a keyed hash of its group, read as a number in [0, 1), is below
``--val-fraction``; with ``--val-samples N`` the groups of smallest hash are held out, whole, until they
hold at least N samples. A sample's group is its own sample id (``--val-group sample``, the default) or
its conversation root (``--val-group root-id``: ShareGPT's records ``X_0``, ``X_11``, … of one long
conversation are held out together, or trained on together; train/groups.py). The choice depends on
nothing else (not the seed, the world size, the step or the order of the cache): every resume and every
world size holds out the same samples, and runs over the same cache are validated on the same ones. The
run's training snapshot is the rest; the planner never sees a validation sample. ``dflash eval`` reads
the split back (``validation_ids_of_run``): the prompts of validation samples were not trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_offline.config_fields import flag
from dflash_offline.errors import CacheFormatError, ConfigError
from dflash_offline.train.config import TrainConfig
from dflash_offline.train.groups import GROUPS_FILE, read_groups
from dflash_offline.train.snapshot import IndexSnapshot, read_snapshot, subset_snapshot

_SALT = b"dflash-validation-split-v1\x00"
SNAPSHOT_FILE = "snapshot.parquet"


VAL_GROUPS = ("sample", "root-id")
"""``--val-group`` values: what is held out together (module docstring)."""


def validation_key(group: str) -> float:
    """The group's place in [0, 1) (64 bits of a keyed blake2b of its name: a sample id or a root)."""
    digest = hashlib.blake2b(_SALT + group.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def validation_mask(
    sample_ids: Sequence[str],
    *,
    fraction: float,
    num_samples: int | None,
    groups: Mapping[str, str] | None = None,
) -> np.ndarray:
    """bool [N]: which of ``sample_ids`` are validation samples (module docstring); ``groups`` maps each
    sample id to its group (None: every sample is its own)."""
    if groups is None:
        names: Sequence[str] = sample_ids
    else:
        missing = [s for s in sample_ids if s not in groups]
        if missing:
            raise CacheFormatError(
                f"{len(missing)} samples of the run (first: {missing[0]!r}) have no validation group; "
                "the run's validation_groups.parquet does not belong to its snapshot"
            )
        names = [groups[s] for s in sample_ids]
    keys_N = np.fromiter((validation_key(g) for g in names), dtype=np.float64, count=len(sample_ids))
    if num_samples is None:
        return keys_N < fraction
    if num_samples >= len(sample_ids):
        return np.ones(len(sample_ids), dtype=bool)
    # The smallest keys up to the N-th sample's, whole groups (a group's samples share its key).
    return keys_N <= np.sort(keys_N)[num_samples - 1]


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitSnapshots:
    """A run's snapshot split in two."""

    train: IndexSnapshot
    """What the planner plans over (the whole snapshot when nothing is held out)."""
    validation: IndexSnapshot | None
    """The held-out samples; None when the split is off or empty."""


def split_snapshot(
    snapshot: IndexSnapshot,
    *,
    fraction: float,
    num_samples: int | None,
    groups: Mapping[str, str] | None = None,
) -> SplitSnapshots:
    """Split ``snapshot`` (``groups``: sample id → group, None: by sample); refuses a split that leaves
    nothing to train on."""
    if num_samples is None and fraction <= 0.0:
        return SplitSnapshots(train=snapshot, validation=None)
    mask = validation_mask(snapshot.sample_ids, fraction=fraction, num_samples=num_samples, groups=groups)
    if mask.all():
        what = (
            f"{flag(TrainConfig, 'val_samples')} {num_samples}"
            if num_samples is not None
            else f"{flag(TrainConfig, 'val_fraction')} {fraction}"
        )
        raise ConfigError(
            f"{what} holds out all {len(snapshot)} samples of the cache, leaving none to train on: "
            "hold out fewer, or generate more samples"
        )
    if not mask.any():
        return SplitSnapshots(train=snapshot, validation=None)
    return SplitSnapshots(train=subset_snapshot(snapshot, ~mask), validation=subset_snapshot(snapshot, mask))


def validation_ids_of_run(run_dir: Path) -> frozenset[str] | None:
    """The validation sample ids of a ``dflash train`` run (from its config.json and saved snapshot);
    None when ``run_dir`` is not a run, has no snapshot yet, or holds nothing out."""
    validation = validation_split_of_run(run_dir)
    return None if validation is None else frozenset(validation.sample_ids)


def validation_split_of_run(run_dir: Path) -> IndexSnapshot | None:
    """The validation split of a ``dflash train`` run, as the run took it (its config.json, saved snapshot
    and groups), bound to no reader; None when ``run_dir`` is not a run, has no snapshot yet, or holds
    nothing out."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict) or not (run_dir / SNAPSHOT_FILE).is_file():
        return None
    fraction = config.get("val_fraction")
    num_samples = config.get("val_samples")
    if not isinstance(fraction, int | float) or not (num_samples is None or isinstance(num_samples, int)):
        return None
    groups = None
    if config.get("val_group") == "root-id":
        if not (run_dir / GROUPS_FILE).is_file():
            return None
        groups = read_groups(run_dir / GROUPS_FILE)
    snapshot = read_snapshot(run_dir / SNAPSHOT_FILE)
    split = split_snapshot(snapshot, fraction=float(fraction), num_samples=num_samples, groups=groups)
    return split.validation
