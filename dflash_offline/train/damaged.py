"""The log of damaged samples (``LaunchConfig.on_damaged="skip"``): samples training could not read (a
missing or truncated shard file, a chunk that does not decode, a malformed zarr.json) or that failed their
checksum, in ``RUN/damaged_samples.jsonl``, written by the training reader and read back at the end.

Every rank appends one JSON line per damaged sample it read (``O_APPEND``, one ``write`` a line, so
lines of several ranks never interleave); a sample read again in a later epoch or after a resume gets
another line, and ``read_damaged`` reports each id once. The reader has already zeroed the sample's
features, ids and loss mask, so it carries no anchor and no loss: training goes on with the rest."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict
from pathlib import Path

from dflash_offline.cache.reader import DamagedSample
from dflash_offline.cache.rows import utc_now

DAMAGED_FILE = "damaged_samples.jsonl"


class DamagedLog:
    """The ``on_damaged`` callback of the training reader (called from reader threads)."""

    def __init__(self, run_dir: Path, *, rank: int) -> None:
        self.path = run_dir / DAMAGED_FILE
        self.rank = rank
        self._lock = threading.Lock()
        self.count = 0

    def __call__(self, sample: DamagedSample) -> None:
        line = json.dumps({**asdict(sample), "rank": self.rank, "seen_at": utc_now().isoformat()}) + "\n"
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            self.count += 1


def read_damaged(run_dir: Path) -> list[DamagedSample]:
    """Distinct damaged samples recorded in ``run_dir`` (first sighting of each id), or [] if none."""
    path = run_dir / DAMAGED_FILE
    if not path.exists():
        return []
    found: dict[str, DamagedSample] = {}
    for raw in path.read_text().splitlines():
        try:
            d = json.loads(raw)
        except json.JSONDecodeError:  # a line torn by a kill: the sample is read (and logged) again
            continue
        if d["sample_id"] not in found:
            found[d["sample_id"]] = DamagedSample(
                sample_id=d["sample_id"],
                shard=d["shard"],
                row_start=int(d["row_start"]),
                problem=str(d["problem"]),
            )
    return list(found.values())
