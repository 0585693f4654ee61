"""Caches written by ``dflash generate`` on the random:tiny target, built once per test session.

A generate run costs a worker process, a target load and the forwards (tens of seconds on the
2-core machine) while a test that trains on, reads or copies the result costs far less, so every test
that only needs *a* generated cache shares one of a few shapes. Shared caches are read-only: a test
that changes a cache works on a ``copy_cache`` of it, and the session ends with a check that no shared
cache changed (so a test that wrote into one fails the run instead of silently feeding the next).

Under pytest-xdist the workers share one folder, and ``build_once`` lets the first worker that needs
a shape build it while the others wait for it (a lock file per shape).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_offline.generate.run import run_generate
from tests.generate.helpers import make_chat_jsonl, tiny_config


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheShape:
    """What decides a shared cache's content."""

    records: int
    """Chat records of ``make_chat_jsonl`` (varied lengths, every bucket)."""
    seed: int
    """Seed of ``make_chat_jsonl``."""
    codec: str | None = None
    """Feature codec (None: the cache library's default)."""
    flush_bytes: int | None = None
    """Commit (and end a shard file) once this many raw bytes wait: a layout of several shards that
    does not depend on the machine's speed (None: the default, where only ``flush_seconds`` ends one)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyCache:
    """A shared cache and the chat data it was generated from (neither may be written to)."""

    root: Path
    data: Path


def _digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root``."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def shared_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's temporary root; under pytest-xdist the one above the workers' own (shared)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def build_once(where: Path, build: Callable[[Path], None]) -> Path:
    """``where``, built by ``build(where)`` unless a finished build is there already; concurrent callers
    (xdist workers) wait for the one that builds. A build that failed half-way is started again."""
    where.parent.mkdir(parents=True, exist_ok=True)
    done = where.with_name(where.name + ".done")
    with open(where.with_name(where.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
            build(where)
            done.touch()
    return where


class TinyCaches:
    """Builds each ``CacheShape`` once, on first request, under ``folder`` (which xdist workers share)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._built: dict[CacheShape, TinyCache] = {}
        self._digests: dict[CacheShape, dict[str, str]] = {}

    def get(
        self, *, records: int, seed: int, codec: str | None = None, flush_bytes: int | None = None
    ) -> TinyCache:
        shape = CacheShape(records=records, seed=seed, codec=codec, flush_bytes=flush_bytes)
        if shape not in self._built:

            def build(where: Path) -> None:
                data = make_chat_jsonl(where / "chat.jsonl", records, seed=seed)
                sizes = {} if flush_bytes is None else {"flush_bytes": flush_bytes}
                summary = run_generate(tiny_config(where / "cache", data, codec=codec, **sizes))
                assert summary.status == "finished", summary

            name = f"r{records}-s{seed}-{codec or 'default'}-{flush_bytes or 'timed'}"
            where = build_once(self._folder / name, build)
            self._built[shape] = TinyCache(root=where / "cache", data=where / "chat.jsonl")
            self._digests[shape] = _digest(where)
        return self._built[shape]

    def assert_unchanged(self) -> None:
        """Every shared cache (and its data) still holds the bytes it was built with."""
        changed = [
            str(self._built[shape].root)
            for shape, digest in self._digests.items()
            if _digest(self._built[shape].root.parent) != digest
        ]
        assert not changed, f"a test wrote into the shared caches {changed}: work on copy_cache(...) instead"


def copy_cache(cache: Path, dest: Path) -> Path:
    """A private copy of ``cache`` at ``dest`` for a test that writes into it."""
    shutil.copytree(cache, dest)
    return dest
