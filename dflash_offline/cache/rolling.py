"""``RollingWriter``: a writer session that spreads its samples over bounded stores (docs/follow.md).

Under a disk window, a store is what training retires whole, so stores must be bounded: a store
(one ``ShardWriter``, one shard group) is closed, committed and then sealed once the rows added to it
reach ``store_bytes`` (the codec's bytes a token before compression: exact for fp8, an upper bound
for the lossless codecs), and the next sample opens the next store. Samples whose ``routing_key`` is
below ``val_fraction`` (the validation split's hash over the sample's conversation root, so that a
conversation's samples land together; cache/window.py) go to stores of their own, which training never
retires. Every store is sealed when the session closes.

A store opens with its first sample (or failure), so a session handed none leaves no store: a rerun of a
finished generate, whose workers get no job, would otherwise seal an empty store after the follow run that
retires stores had ended, and nothing would retire it (found by bench/soak_follow.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import Any

from dflash_offline.cache.rows import SampleToWrite, WriterStats, utc_now
from dflash_offline.cache.window import VALIDATION_MARK, routes_to_validation, seal_store
from dflash_offline.cache.window_records import StoreSeal
from dflash_offline.cache.writer import ShardWriter, shard_name

OpenStore = Callable[[str], ShardWriter]
"""Opens a new store for a session name (the worker's ``ShardWriter`` options applied)."""


@dataclass(kw_only=True, slots=True)
class _Lane:
    """The open store of one kind (training or validation samples) and how many it has opened."""

    prefix: str
    """Session names of this lane are ``<prefix><n>`` (the first training store keeps the bare session)."""
    writer: ShardWriter | None = None
    added_bytes: int = 0
    opened: int = 0
    closed_stats: list[WriterStats] = field(default_factory=list)


class RollingWriter:
    """Append-only writer over bounded, sealed stores. Not thread-safe: one thread owns it. Offers what
    generate's writer thread uses of a ``ShardWriter``: ``add``, ``add_failure``, ``stats``, ``close``."""

    def __init__(
        self,
        open_store: OpenStore,
        *,
        worker: int,
        session: str,
        store_bytes: int | None,
        token_bytes: int,
        val_fraction: float,
        fsync: bool,
    ) -> None:
        self._open_store = open_store
        self._store_bytes = store_bytes
        self._token_bytes = token_bytes
        self._val_fraction = val_fraction
        self._fsync = fsync
        self._train = _Lane(prefix=f"{session}-r")
        self._val = _Lane(prefix=f"{session}{VALIDATION_MARK}")
        self._session = session
        self.sealed: list[StoreSeal] = []
        self.shard = shard_name(worker, session)  # its first training store's, known before that opens

    def _writer(self, lane: _Lane) -> ShardWriter:
        if lane.writer is None:
            bare = lane is self._train and lane.opened == 0
            lane.writer = self._open_store(self._session if bare else f"{lane.prefix}{lane.opened}")
            lane.opened += 1
            lane.added_bytes = 0
        return lane.writer

    def add(self, sample: SampleToWrite) -> None:
        validation = routes_to_validation(
            sample_id=sample.sample_id,
            conversation_root=sample.conversation_root,
            val_fraction=self._val_fraction,
        )
        lane = self._val if validation else self._train
        self._writer(lane).add(sample)
        lane.added_bytes += sample.num_tokens * self._token_bytes
        if self._store_bytes is not None and lane.added_bytes >= self._store_bytes:
            self._seal(lane, reason="size")

    def add_failure(self, **failure: Any) -> None:
        self._writer(self._train).add_failure(**failure)

    def _seal(self, lane: _Lane, *, reason: str) -> None:
        """Close (commit) the lane's store, then seal it: data first, then the record saying it is final."""
        writer = lane.writer
        assert writer is not None
        lane.writer = None
        writer.close()
        stats = writer.stats
        lane.closed_stats.append(stats)
        seal = StoreSeal(
            shard=writer.shard,
            validation=lane is self._val,
            num_samples=stats.samples,
            num_tokens=stats.tokens,
            reason=reason,
            sealed_at=utc_now(),
        )
        seal_store(writer.layout.root, seal, fsync=self._fsync)
        self.sealed.append(seal)

    def flush_idle(self) -> None:
        """Commit what waits in the open stores: called when no sample came for a while, since under a
        full window no new sample may come until these are committed (and then trained and retired)."""
        for lane in (self._train, self._val):
            if lane.writer is not None and lane.writer.has_uncommitted:
                lane.writer.flush()

    @property
    def stats(self) -> WriterStats:
        """The session's totals over every store (``shard`` names its first store)."""
        every = [s for lane in (self._train, self._val) for s in lane.closed_stats]
        every += [lane.writer.stats for lane in (self._train, self._val) if lane.writer is not None]
        totals = {
            f.name: sum(getattr(s, f.name) for s in every) for f in fields(WriterStats) if f.name != "shard"
        }
        return WriterStats(shard=self.shard, **totals)

    def close(self) -> None:
        for lane in (self._train, self._val):
            if lane.writer is not None:
                self._seal(lane, reason="close")

    def __enter__(self) -> RollingWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()  # commit what was validated; its store is final either way
        except Exception as close_error:
            exc.add_note(f"and closing the stores of session {self._session} failed too: {close_error!r}")
