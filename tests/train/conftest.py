"""Fixtures for the train tests: uninterrupted CLI runs that the kill and torchrun tests compare with; the
staged window cache of the follow-segment tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.generate.helpers import run_in_process
from tests.tiny_caches import build_once, shared_temp_dir
from tests.train.kill_helpers import KILL_RUN_STEPS, train_cmd


@pytest.fixture(scope="session")
def uninterrupted(
    uncompressed_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int], Path]:
    """``workers`` -> an uninterrupted ``dflash train`` run of ``KILL_RUN_STEPS`` steps on
    ``uncompressed_cache`` with that many spawned workers, through the CLI in this process
    (``run_in_process``); each is run once, when first asked for, and must not be written to (copy
    it)."""
    folder = shared_temp_dir(tmp_path_factory) / "uninterrupted"

    def build(where: Path) -> None:
        workers = int(where.name.removeprefix("w"))
        cmd = train_cmd(
            uncompressed_cache, where / "run", steps=KILL_RUN_STEPS, workers=workers, checkpoint_every=4
        )
        run_in_process(cmd)

    return lambda workers: build_once(folder / f"w{workers}", build) / "run"


@pytest.fixture(scope="session")
def staged_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The window cache of test_follow_segments.py and test_follow_final_segment.py, generated once for the
    session (xdist workers share it); a test copies it (``cache_copy``) before a run writes into it."""
    from tests.train.test_follow_segments import write_staged_cache

    def build(where: Path) -> None:
        write_staged_cache(where)

    return build_once(shared_temp_dir(tmp_path_factory) / "follow-staged", build) / "cache"
