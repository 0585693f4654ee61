"""``--deterministic`` enforces: a kernel without a deterministic implementation raises (torch's
``warn_only`` is off), and a cuBLAS workspace setting that breaks determinism is refused up front."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from dflash_offline.train.determinism import CUBLAS_ENV, DeterminismError, seed_everything


@pytest.fixture
def restore_determinism(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(CUBLAS_ENV, "")  # records the original value, restored afterwards
    monkeypatch.delenv(CUBLAS_ENV)
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _put() -> torch.Tensor:
    # put_ without accumulate has no deterministic kernel, on the CPU too.
    return torch.zeros(4).put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))


@pytest.mark.usefixtures("restore_determinism")
def test_deterministic_raises_on_a_nondeterministic_kernel() -> None:
    seed_everything(0, deterministic=False)
    _put()  # allowed without --deterministic
    seed_everything(0, deterministic=True)
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _put()
    assert os.environ[CUBLAS_ENV] == ":4096:8"


@pytest.mark.usefixtures("restore_determinism")
def test_deterministic_refuses_a_nondeterministic_cublas_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUBLAS_ENV, ":0:0")
    with pytest.raises(DeterminismError, match=r"CUBLAS_WORKSPACE_CONFIG=':0:0'.*:4096:8"):
        seed_everything(0, deterministic=True)
    monkeypatch.setenv(CUBLAS_ENV, ":16:8")  # the other deterministic setting is kept as it is
    seed_everything(0, deterministic=True)


def test_seeds_make_draws_repeat() -> None:
    seed_everything(3, deterministic=False)
    first = torch.rand(4)
    seed_everything(3, deterministic=False)
    assert torch.equal(torch.rand(4), first)
    seed_everything(4, deterministic=False)
    assert not torch.equal(torch.rand(4), first)
