"""Fixtures for the train tests: uninterrupted CLI runs that the kill and torchrun tests compare with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny_caches import build_once, shared_temp_dir
from tests.train.kill_helpers import KILL_RUN_STEPS, run_to_end, train_cmd


@pytest.fixture(scope="session")
def uninterrupted(
    uncompressed_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int], Path]:
    """``workers`` -> an uninterrupted ``dflash train`` run of ``KILL_RUN_STEPS`` steps on
    ``uncompressed_cache`` with that many spawned workers, through the CLI; each is run once, when first
    asked for, and must not be written to (copy it)."""
    folder = shared_temp_dir(tmp_path_factory) / "uninterrupted"

    def build(where: Path) -> None:
        workers = int(where.name.removeprefix("w"))
        cmd = train_cmd(
            uncompressed_cache, where / "run", steps=KILL_RUN_STEPS, workers=workers, checkpoint_every=4
        )
        run_to_end(cmd)

    return lambda workers: build_once(folder / f"w{workers}", build) / "run"
