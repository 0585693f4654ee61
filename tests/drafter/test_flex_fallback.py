"""A failing compiled flex_attention falls back to SDPA explicitly: a warning once, the model's own
record (not a process-global flag), the same result as SDPA; off CUDA or without a record it raises;
while a stop is requested the failing forward runs SDPA and nothing is recorded."""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch

from dflash_offline import interrupt
from dflash_offline.drafter import attention
from dflash_offline.drafter.attention import (
    FlexFallback,
    FlexFallbackWarning,
    TrainingAttention,
    build_attention_index,
    resolve_backend,
)

from .helpers import random_row, tiny_drafter


def _broken_flex(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("triton boom")


@pytest.fixture
def broken_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex_attention fails as a CUDA compile failure would, and the CPU counts as covered."""
    monkeypatch.setattr(attention, "flex_attend", _broken_flex)
    monkeypatch.setattr(FlexFallback, "covers", staticmethod(lambda device: True))


def test_a_model_whose_flex_fails_warns_once_and_runs_sdpa(broken_flex: None) -> None:
    row = random_row([7, 12, 5], seed=0, pad=6, num_anchors=3)
    model = tiny_drafter(seed=0)
    with torch.no_grad():
        expected = model.forward_hidden(row, attention="sdpa")
        with pytest.warns(FlexFallbackWarning, match="triton boom.*--attention sdpa"):
            first = model.forward_hidden(row, attention="flex")
        assert model.flex_fallback.failed
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second note, no second attempt
            second = model.forward_hidden(row, attention="flex")
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    # The record is the model's: another model in the same process still uses flex.
    other = tiny_drafter(seed=1)
    assert not other.flex_fallback.failed
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, requires_grad=True, flex_failed=other.flex_fallback.failed) == "flex"
    assert resolve_backend("auto", cuda, requires_grad=True, flex_failed=True) == "sdpa"
    assert resolve_backend("flex", cuda, requires_grad=True, flex_failed=True) == "sdpa"


def test_a_flex_failure_without_a_record_or_off_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "flex_attend", _broken_flex)
    row = random_row([5, 6], seed=1, num_anchors=2)
    index = build_attention_index(row.doc_ids_T, row.positions_T, row.anchors_A, block_size=4, pad_to=128)
    Q, S = index.num_queries, index.num_keys
    q, k, v = torch.randn(1, 2, Q, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)
    with pytest.raises(RuntimeError, match="triton boom"):
        TrainingAttention(index, "flex")(q, k, v)
    fallback = FlexFallback()
    with pytest.raises(RuntimeError, match="triton boom"):  # a CPU failure is a bug, not a fallback
        TrainingAttention(index, "flex", fallback)(q, k, v)
    assert not fallback.failed


def test_a_flex_failure_while_a_stop_is_requested_leaves_the_model_on_flex(broken_flex: None) -> None:
    """A Ctrl-C (or a deadline's SIGINT) reaches the compiler's subprocesses too (ptxas dies of it): a
    flex failure then is no verdict on flex. That forward still runs SDPA, so the step can finish and
    the run stop; the model records nothing, warns nothing, and its next forward tries flex again."""
    row = random_row([7, 12, 5], seed=0, pad=6, num_anchors=3)
    model = tiny_drafter(seed=0)
    with torch.no_grad():
        expected = model.forward_hidden(row, attention="sdpa")
        with interrupt.stop_on_sigint("stopping"):
            os.kill(os.getpid(), signal.SIGINT)  # the real first Ctrl-C: a stop request
            assert interrupt.stop_requested()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no FlexFallbackWarning
                got = model.forward_hidden(row, attention="flex")
        assert not model.flex_fallback.failed
        with pytest.warns(FlexFallbackWarning, match="triton boom"):  # flex tried again: fails for real
            model.forward_hidden(row, attention="flex")
    torch.testing.assert_close(got, expected)
    assert model.flex_fallback.failed
