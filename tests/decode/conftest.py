"""Fixtures of the decode engine's tests: one thread (answers are compared with ``generate``'s token for
token), and the two random targets every CPU test runs on (a Qwen3-shaped and a Llama-shaped one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.eval.helpers import one_thread


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-llama"])
def target(request: pytest.FixtureRequest) -> LoadedTarget:
    return load_target(request.param, device="cpu")
