"""The disk window in ``dflash status`` (docs/follow.md): stores and samples present, open, sealed and
retired, and how long each side waited for the other. Read from the views of ``manifests/schema.sql``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowStatus:
    """The window of one cache, as its manifest records it."""

    stores_present: int
    samples_present: int
    """Committed samples whose store is not retired (what is on disk to train on)."""
    tokens_present: int
    samples_in_open_stores: int
    """Committed, but their store is not sealed yet: training cannot retire them yet."""
    stores_retired: int
    samples_retired: int
    """Trained their planned passes and deleted (their rows stay in the manifest)."""
    tokens_retired: int
    waits: tuple[tuple[str, str, int, float], ...]
    """(run_id, side, waits, seconds) per run and side."""

    def render(self) -> list[str]:
        lines = [
            f"window     {self.samples_present:,} samples ({self.tokens_present:,} tokens) in "
            f"{self.stores_present} stores on disk, {self.samples_in_open_stores:,} of them in open stores; "
            f"{self.samples_retired:,} samples ({self.tokens_retired:,} tokens) trained and retired in "
            f"{self.stores_retired} stores"
        ]
        for run_id, side, count, seconds in self.waits:
            what = "for room in the window" if side == "generate" else "for samples to train on"
            lines.append(f"           {run_id} waited {seconds:,.1f} s {what} ({count} times)")
        return lines


def read_window_status(con: Any) -> WindowStatus | None:
    """The window from a connection holding the manifest's tables and views; None for a cache that
    never had one (no store sealed)."""
    (seals,) = con.cursor().execute("SELECT count(*) FROM seals").fetchall()[0]
    if not seals:
        return None
    row = con.cursor().execute("SELECT * FROM window_totals").fetchall()[0]
    waits = tuple(
        (str(r), str(s), int(n), float(t))
        for r, s, n, t in con.cursor()
        .execute("SELECT run_id, side, waits, seconds FROM window_waits ORDER BY first_wait")
        .fetchall()
    )
    return WindowStatus(
        stores_present=int(row[0]),
        samples_present=int(row[1]),
        tokens_present=int(row[2]),
        samples_in_open_stores=int(row[3]),
        stores_retired=int(row[4]),
        samples_retired=int(row[5]),
        tokens_retired=int(row[6]),
        waits=waits,
    )
