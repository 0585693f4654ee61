"""The split file of a ``dflash train`` run, ``RUN/split.parquet``: which samples of its snapshot it
trained on, which it held out for validation and which its ``train_samples`` left out.

Training decides the split (train/snapshot.py) and writes this file at every start, before the first step;
``dflash eval`` reads it (eval/prompts.py, eval/validation_set.py) to know what the drafter never
trained on, without recomputing the split: data flows one way, from the run to its evaluation. A run
trained before the file existed has none (``read_run_split`` answers None): running its ``dflash
train`` command again writes it (a finished run runs no step).

One row per snapshot sample: ``sample_id`` and ``role`` (``ROLES``). Samples committed to the cache after
the run took its snapshot have no row: the run never saw them.

A segment of a ``dflash train --follow`` run (``RUN/segments/<k>``, an ordinary run of its own) holds the
split of its own snapshot; its drafter continues the weights that the run's earlier segments trained, so
``read_run_split`` answers for it the union over segments 0..k: what that drafter has trained on.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_offline.errors import CacheFormatError

SPLIT_FILE = "split.parquet"
FOLLOW_FILE = "follow.json"
"""``RUN/follow.json``: the state of a ``dflash train --follow`` run (train/follow.py)."""
SEGMENTS_DIR = "segments"
"""``RUN/segments/<k>``: segment k of a follow run, ``k`` written with four digits."""
SPLIT_FORMAT_VERSION = 1
_META_VERSION = b"dflash_split_version"

Role = Literal["train", "validation", "left_out"]
ROLES: tuple[Role, ...] = ("train", "validation", "left_out")
"""``train``: trained on; ``validation``: held out, the run's validation split; ``left_out``: not held
out, but not among the ``train_samples`` the run trained on either."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSplit:
    """A run's snapshot, by role (disjoint sets of sample ids)."""

    train: frozenset[str]
    """The samples the run trained on."""
    validation: frozenset[str]
    """Its validation split (empty when it held nothing out)."""
    left_out: frozenset[str]
    """Not held out and not trained on: what ``train_samples`` left out (empty without it)."""

    def __post_init__(self) -> None:
        assert not self.train & self.validation, "roles overlap"
        assert not self.train & self.left_out, "roles overlap"
        assert not self.validation & self.left_out, "roles overlap"

    @property
    def num_not_held_out(self) -> int:
        """Samples outside the validation split (trained on or left out)."""
        return len(self.train) + len(self.left_out)

    @classmethod
    def of(cls, *, snapshot_ids: Iterable[str], train: Iterable[str], validation: Iterable[str]) -> RunSplit:
        """The split of ``snapshot_ids`` whose trained and validation samples are given (the rest is left
        out)."""
        train_ids, validation_ids = frozenset(train), frozenset(validation)
        return cls(
            train=train_ids,
            validation=validation_ids,
            left_out=frozenset(snapshot_ids) - train_ids - validation_ids,
        )


def write_run_split(run_dir: Path, split: RunSplit) -> Path:
    """Write ``RUN/split.parquet`` (temp file, fsync, rename: a reader never sees half of it)."""
    ids: list[str] = []
    roles: list[str] = []
    for role, members in zip(ROLES, (split.train, split.validation, split.left_out), strict=True):
        ordered = sorted(members)
        ids += ordered
        roles += [role] * len(ordered)
    table = pa.table(
        {"sample_id": pa.array(ids, pa.string()), "role": pa.array(roles, pa.string())}
    ).replace_schema_metadata({_META_VERSION: str(SPLIT_FORMAT_VERSION).encode()})
    path = run_dir / SPLIT_FILE
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def segment_dir(run_dir: Path, index: int) -> Path:
    """The folder of segment ``index`` of the follow run ``run_dir``."""
    return run_dir / SEGMENTS_DIR / f"{index:04d}"


def read_run_split(run_dir: Path) -> RunSplit | None:
    """The split ``write_run_split`` wrote into ``run_dir``; None when it has no split file (not a run, a
    run that has not started its first step, or one trained before the file existed). For segment k of a
    follow run: the union of the splits of its segments 0..k (a segment's drafter has trained on every
    earlier segment's samples; an earlier segment without a split trained nothing). A file this version
    cannot read is refused."""
    own = _read_split_file(run_dir)
    if own is None:
        return None
    earlier = [_read_split_file(d) for d in _earlier_segments(run_dir)]
    splits = [own, *(e for e in earlier if e is not None)]
    if len(splits) == 1:
        return own
    train = frozenset().union(*(x.train for x in splits))
    validation = frozenset().union(*(x.validation for x in splits)) - train
    left_out = frozenset().union(*(x.left_out for x in splits)) - train - validation
    return RunSplit(train=train, validation=validation, left_out=left_out)


def _earlier_segments(run_dir: Path) -> list[Path]:
    """The folders of the segments before ``run_dir`` when it is a segment of a follow run; else none."""
    folder = run_dir.resolve()
    run = folder.parent.parent
    if folder.parent.name != SEGMENTS_DIR or not folder.name.isdigit() or not (run / FOLLOW_FILE).is_file():
        return []
    return [segment_dir(run, k) for k in range(int(folder.name))]


def _read_split_file(run_dir: Path) -> RunSplit | None:
    """``run_dir``'s own split file, None without one."""
    path = run_dir / SPLIT_FILE
    if not path.is_file():
        return None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CacheFormatError(f"cannot read the run's split {str(path)!r}: {exc}") from exc
    version = (table.schema.metadata or {}).get(_META_VERSION, b"?").decode()
    if version != str(SPLIT_FORMAT_VERSION) or not {"sample_id", "role"} <= set(table.column_names):
        raise CacheFormatError(
            f"the run's split {str(path)!r} has format version {version!r}; this dflash reads version "
            f"{SPLIT_FORMAT_VERSION}: evaluate with the dflash version that trained the run"
        )
    ids = table.column("sample_id").to_pylist()
    if len(set(ids)) != len(ids):
        raise CacheFormatError(f"the run's split {str(path)!r} is damaged: a sample has two rows")
    members: dict[str, set[str]] = {role: set() for role in ROLES}
    for sample_id, role in zip(ids, table.column("role").to_pylist(), strict=True):
        if role not in members:
            raise CacheFormatError(f"the run's split {str(path)!r} has a row of unknown role {role!r}")
        members[role].add(sample_id)
    return RunSplit(
        train=frozenset(members["train"]),
        validation=frozenset(members["validation"]),
        left_out=frozenset(members["left_out"]),
    )
