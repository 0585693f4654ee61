"""Shared test configuration: the `gpu` marker skips without CUDA; hangs dump every thread's stack."""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Iterator

import pytest
import torch

# A hang in a worker thread or subprocess must fail with stacks, not block CI (pytest-timeout
# enforces the limit; faulthandler shows where every thread was).
faulthandler.enable(file=sys.stderr, all_threads=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _restore_deterministic_algorithms() -> Iterator[None]:
    """An in-process ``train --deterministic`` turns torch's deterministic mode on for the process
    (it raises on kernels without a deterministic implementation): keep it from reaching other tests."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
