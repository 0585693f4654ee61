"""``--deterministic`` enforces: a kernel without a deterministic implementation raises (torch's
``warn_only`` is off), and a cuBLAS workspace setting that breaks determinism is refused up front."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_offline.train.step import CUBLAS_ENV, DeterminismError, seed_everything


@pytest.fixture
def clean_determinism(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUBLAS_ENV, "")  # records the original value, restored afterwards
    monkeypatch.delenv(CUBLAS_ENV)
    torch.use_deterministic_algorithms(False)  # tests/conftest.py restores the previous mode


def _put() -> torch.Tensor:
    # put_ without accumulate has no deterministic kernel, on the CPU too.
    return torch.zeros(4).put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))


@pytest.mark.usefixtures("clean_determinism")
def test_deterministic_raises_on_a_nondeterministic_kernel() -> None:
    seed_everything(0, deterministic=False)
    _put()  # allowed without --deterministic
    seed_everything(0, deterministic=True)
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _put()
    assert os.environ[CUBLAS_ENV] == ":4096:8"


@pytest.mark.usefixtures("clean_determinism")
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


@pytest.mark.gpu
@pytest.mark.usefixtures("clean_determinism")
def test_drafter_training_steps_run_and_repeat_on_cuda_under_deterministic() -> None:
    """Every kernel of a training step (flex attention, bf16 autocast, the chunked LM-head loss,
    AdamW) has a deterministic implementation: none raises, and two runs give the same losses."""
    from tests.drafter.helpers import random_row, tiny_config, tiny_drafter

    def losses() -> list[float]:
        seed_everything(0, deterministic=True)
        model = tiny_drafter(tiny_config(block_size=16, head_dim=16), seed=0).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        row = random_row([60, 130, 40], seed=1, pad=20, num_anchors=6).to("cuda")
        out = []
        for _step in range(3):
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.forward_train(row, attention="auto").loss
            loss.backward()
            optimizer.step()
            out.append(float(loss))
        assert not model.flex_fallback.failed  # flex itself ran, not the SDPA fallback
        return out

    first = losses()
    assert losses() == first
