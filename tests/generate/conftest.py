"""Fixtures for generate tests: a small chat data set, and the uninterrupted ``dflash generate`` runs that
the kill, fault and torchrun tests compare with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny_caches import TinyCache, build_once, shared_temp_dir

from .helpers import generate_cmd, make_chat_jsonl, run_in_process


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", 60)


@pytest.fixture(scope="session")
def uninterrupted_generate(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], TinyCache]:
    """``(records, seed)`` -> the cache of an uninterrupted ``dflash generate`` (``generate_cmd``, one
    worker, run in this process: ``run_in_process``) over ``make_chat_jsonl(records, seed=seed)``, and that
    data. A run is a worker's start-up and the forwards: each is run once for the session, when first asked
    for (xdist workers share it), and neither may be written to (a test resumes into a cache of its own,
    from the same data)."""
    folder = shared_temp_dir(tmp_path_factory) / "uninterrupted-generate"

    def get(records: int, seed: int) -> TinyCache:
        def build(where: Path) -> None:
            data = make_chat_jsonl(where / "chat.jsonl", records, seed=seed)
            run_in_process(generate_cmd(where / "cache", data))

        where = build_once(folder / f"r{records}-s{seed}", build)
        return TinyCache(root=where / "cache", data=where / "chat.jsonl")

    return get
