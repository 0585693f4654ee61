"""The record of a ``dflash train --follow`` run: its segments, in ``RUN/follow.json`` (docs/follow.md).

A segment is a set of sealed training stores, trained as one ordinary run of ``--passes`` epochs in
``RUN/segments/<k>/``. The file is replaced whole (temp file, fsync, rename, fsync of the folder), so a
kill leaves the previous version or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_offline.errors import ConfigError

FOLLOW_FILE = "follow.json"
FOLLOW_STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One segment of a follow run."""

    index: int
    stores: tuple[str, ...]
    """The training stores it trains (sealed when it began; retired once it is trained)."""
    num_samples: int
    """Training samples of those stores."""
    trained: bool
    """Its run reached its last step and wrote that step's checkpoint: its stores may be retired."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "stores": list(self.stores),
            "num_samples": self.num_samples,
            "trained": self.trained,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(
            index=int(d["index"]),
            stores=tuple(str(s) for s in d["stores"]),
            num_samples=int(d["num_samples"]),
            trained=bool(d["trained"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FollowState:
    """What a follow run has planned and done so far."""

    passes: int
    segments: tuple[Segment, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FOLLOW_STATE_VERSION,
            "passes": self.passes,
            "segments": [s.to_dict() for s in self.segments],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: Path) -> FollowState:
        if d.get("version") != FOLLOW_STATE_VERSION:
            raise ConfigError(
                f"{path} has version {d.get('version')!r}; this dflash-offline writes version "
                f"{FOLLOW_STATE_VERSION}: continue the run with the dflash-offline that started it"
            )
        return cls(passes=int(d["passes"]), segments=tuple(Segment.from_dict(s) for s in d["segments"]))

    @property
    def stores(self) -> frozenset[str]:
        """Every store some segment trains."""
        return frozenset(store for segment in self.segments for store in segment.stores)


def read_follow_state(run_dir: Path) -> FollowState | None:
    path = run_dir / FOLLOW_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return FollowState.from_dict(json.loads(text), path)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); it was not written by dflash train --follow") from e


def write_follow_state(run_dir: Path, state: FollowState) -> None:
    """Replace ``RUN/follow.json`` durably."""
    path = run_dir / FOLLOW_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(state.to_dict(), indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
