"""``dflash status``: what a cache holds (samples, tokens, bytes, buckets, failures, runs), from the live
Parquet manifest, so it is accurate while writers are still running."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.cache.codecs import raw_token_bytes
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.index_catalogue import IndexHealth
from dflash_offline.cache.layout import CacheLayout, read_fingerprint, read_format_version
from dflash_offline.cache.sqldb import index_health, open_query_database
from dflash_offline.cache.window_status import WindowStatus, read_window_status


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketCount:
    """One length bucket of the cache."""

    bucket_id: int
    max_tokens: int | None
    """The bucket's upper edge (None: longer than the last edge)."""
    samples: int
    tokens: int
    loss_tokens: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheStatus:
    """A summary of one cache."""

    root: Path
    format_version: int
    fingerprint: CacheFingerprint
    samples: int
    tokens: int
    loss_tokens: int
    raw_bytes: int
    """Uncompressed bytes of the committed samples (features, input_ids, loss_mask)."""
    stored_bytes: int
    """Bytes of every file under ``shards/`` (compressed data, indexes, gaps, uncommitted leftovers)."""
    manifest_bytes: int
    shards: int
    """Writer sessions (shard groups) opened."""
    workers: int
    buckets: tuple[BucketCount, ...]
    failures: tuple[tuple[str, int], ...]
    """(reason, count), most frequent first."""
    duplicates: int
    last_run: str
    """``<run_id> <command> <status>`` of the newest run, or ``none``."""
    index: IndexHealth
    """index.duckdb: absent, current, stale or unreadable (and why)."""
    window: WindowStatus | None = None
    """The disk window (docs/follow.md); None for a cache that never had one."""

    def render(self) -> str:
        fp = self.fingerprint
        ratio = f"{self.stored_bytes / self.raw_bytes:.3f}" if self.raw_bytes else "n/a"
        lines = [
            f"cache      {self.root} (format v{self.format_version}"
            + (
                ": its manifest parts carry no sha256, so damage to them is not detected)"
                if self.format_version == 1
                else ")"
            ),
            f"target     {fp.target_id}  layers {list(fp.layer_ids)}  hidden {fp.hidden_size}  "
            f"codec {fp.codec}",
            f"samples    {self.samples:,}  ({self.duplicates} duplicate rows ignored)",
            f"tokens     {self.tokens:,}  loss tokens {self.loss_tokens:,}",
            f"bytes      raw {_size(self.raw_bytes)}  stored {_size(self.stored_bytes)}  "
            f"(stored/raw {ratio})  "
            f"manifest {_size(self.manifest_bytes)}",
            f"shards     {self.shards} sessions from {self.workers} workers",
            f"index      {self.index.render(self.root)}",
            f"last run   {self.last_run}",
            "buckets    id  max_tokens   samples      tokens  loss_tokens",
        ]
        for b in self.buckets:
            edge = "inf" if b.max_tokens is None else str(b.max_tokens)
            lines.append(
                f"           {b.bucket_id:2d}  {edge:>10}  {b.samples:8,}  {b.tokens:10,}  "
                f"{b.loss_tokens:11,}"
            )
        if self.failures:
            lines.append("failures   " + ", ".join(f"{reason} {count:,}" for reason, count in self.failures))
        else:
            lines.append("failures   none")
        if self.window is not None:
            lines += self.window.render()
        return "\n".join(lines)


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def _tree_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # a temp file renamed away meanwhile
                continue
    return total


def cache_status(root: str | Path) -> CacheStatus:
    """Summarise a cache from its live manifest (never from a possibly stale index)."""
    layout = CacheLayout.at(root)
    fingerprint = read_fingerprint(root)
    database = open_query_database(root, "manifest")
    con = database.con
    try:

        def one(sql: str) -> tuple:
            return tuple(con.cursor().execute(sql).fetchall()[0])

        samples, tokens, loss_tokens = one(
            "SELECT count(*), coalesce(sum(num_tokens), 0), coalesce(sum(num_loss_tokens), 0) FROM samples"
        )
        shards, workers = one("SELECT count(*), count(DISTINCT worker) FROM shards")
        (duplicates,) = one("SELECT count(*) FROM duplicates")
        buckets = tuple(
            BucketCount(bucket_id=int(b), max_tokens=m, samples=int(s), tokens=int(t), loss_tokens=int(lt))
            for b, m, s, t, lt in con.cursor()
            .execute(
                "SELECT bucket_id, max_tokens, samples, tokens, loss_tokens "
                "FROM bucket_stats ORDER BY bucket_id"
            )
            .fetchall()
        )
        failures = tuple(
            (str(r), int(n))
            for r, n in con.cursor()
            .execute("SELECT reason, failures FROM failure_stats ORDER BY failures DESC, reason")
            .fetchall()
        )
        last = (
            con.cursor()
            .execute("SELECT run_id, command, status, error FROM runs ORDER BY started_at DESC LIMIT 1")
            .fetchall()
        )
        window = read_window_status(con)
    finally:
        con.close()
    return CacheStatus(
        root=layout.root,
        format_version=read_format_version(root),
        fingerprint=fingerprint,
        samples=int(samples),
        tokens=int(tokens),
        loss_tokens=int(loss_tokens),
        raw_bytes=int(tokens) * raw_token_bytes(fingerprint.feature_width),
        stored_bytes=_tree_bytes(layout.shards_dir),
        manifest_bytes=_tree_bytes(layout.manifest_dir),
        shards=int(shards),
        workers=int(workers),
        buckets=buckets,
        failures=failures,
        duplicates=int(duplicates),
        last_run=_run_line(*last[0]) if last else "none",
        index=index_health(root),
        window=window,
    )


def _run_line(run_id: str, command: str, status: str, error: str | None) -> str:
    """``generate-… generate finished``; a run that did not finish says why, when it recorded why."""
    line = f"{run_id} {command} {status}"
    why = (error or "").rstrip(": ")  # a bare exception's name ends in ": " (``KeyboardInterrupt: ``)
    return f"{line}: {why}" if why and status != "finished" else line
