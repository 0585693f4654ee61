"""The one batch-1 loop (``decode/speculative.py``): each cycle, target-only (a drafter that proposes
nothing) or speculative (the DFlash drafter on the device), is one run through the step-graph runner keyed by
its attended-length bucket (one CUDA graph replay on a GPU), and the host reads the device once per cycle,
plus once for the prefill's token. Answers are checked against the reference loops of ``tests/oracles``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor

from dflash_offline.decode import TARGET_ONLY, SingleSequence
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.eval.helpers import ScriptedDrafter, untrained_drafter
from tests.oracles.reference_decode import (
    DFlashBlockDrafter,
    TargetCaller,
    speculative_decode,
    target_only_decode,
)

LAYERS = (0, 2)
HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture(scope="module")
def target() -> LoadedTarget:
    """One of the two random targets: the answers on both are tests/eval/test_speculative.py's."""
    return load_target("random:tiny", device="cpu")


@contextmanager
def counting_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every Tensor → Python value conversion (each one a host sync on a GPU), by method name."""
    reads: list[str] = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self: Tensor, *args: Any, _real: Any = real, _name: str = name) -> Any:
            reads.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        yield reads
    finally:
        monkeypatch.undo()


def spy_steps(seq: SingleSequence) -> list[Hashable]:
    """The keys of the steps the loop runs through its graph runner."""
    keys: list[Hashable] = []
    run = seq.graphs.run

    def spy(key: Hashable, step: Callable[[], None], mutated: Sequence[Tensor]) -> None:
        keys.append(key)
        run(key, step, mutated)

    seq.graphs.run = spy  # type: ignore[method-assign]
    return keys


def test_target_only_is_one_step_and_one_host_read_a_token(
    target: LoadedTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = list(range(5, 60))
    seq = SingleSequence(target.model, max_len=128, attend_granule=16)
    keys = spy_steps(seq)
    with counting_host_reads(monkeypatch) as reads:
        got = seq.decode(prompt, TARGET_ONLY, layer_ids=(), max_new_tokens=20, stop_ids=frozenset())
    ref = target_only_decode(TargetCaller(target.model), prompt, max_new_tokens=20, stop_ids=frozenset())
    assert got.tokens == ref.tokens
    assert got.num_target_forwards == 19 == len(keys)  # the first token comes from the prefill
    assert got.accepted_per_cycle == ()
    # The token at position n (55..73) attends over keys 0..n: the bucket of 16 · 2^k positions holding
    # them is 64 up to n = 63, then 128.
    assert [k[-1] for k in keys] == [64] * (63 - 55 + 1) + [128] * (73 - 64 + 1)  # type: ignore[index]
    assert reads.count("tolist") == 19
    assert len(reads) == 19 + 1  # and the prefill's token


def test_a_speculative_cycle_is_one_step_and_one_host_read(
    target: LoadedTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = list(range(5, 40))
    model = untrained_drafter(target, block_size=4)
    seq = SingleSequence(target.model, max_len=128, attend_granule=16)
    drafter = seq.drafter_for(model)
    assert seq.drafter_for(model) is drafter
    keys = spy_steps(seq)
    with counting_host_reads(monkeypatch) as reads:
        got = seq.speculative(prompt, model, layer_ids=LAYERS, max_new_tokens=24, stop_ids=frozenset())
    caller = TargetCaller(target.model)
    ref = speculative_decode(
        caller, DFlashBlockDrafter(model), prompt, layer_ids=LAYERS, max_new_tokens=24, stop_ids=frozenset()
    )
    assert got.tokens == ref.tokens
    assert got.accepted_per_cycle == ref.accepted_per_cycle
    assert len(keys) == got.num_cycles == got.num_target_forwards
    assert all(k[1] == id(drafter) for k in keys)  # type: ignore[index]
    assert len(reads) == got.num_cycles + 1


def test_target_only_and_speculative_turns_keep_their_own_buffers(target: LoadedTarget) -> None:
    """Eval alternates the two on every turn: neither drops the other's state (on a GPU, its graphs)."""
    prompt = list(range(5, 30))
    model = untrained_drafter(target, block_size=4)
    seq = SingleSequence(target.model, max_len=128, attend_granule=16)
    caller = TargetCaller(target.model)
    ref = target_only_decode(caller, prompt, max_new_tokens=16, stop_ids=frozenset())
    for _ in range(2):
        assert seq.target_only(prompt, max_new_tokens=16, stop_ids=frozenset()).tokens == ref.tokens
        got = seq.speculative(prompt, model, layer_ids=LAYERS, max_new_tokens=16, stop_ids=frozenset())
        assert got.tokens == ref.tokens
    assert len(seq._buffers) == 2


def test_a_host_drafter_runs_the_same_cycle_eagerly(target: LoadedTarget) -> None:
    """A drafter that reads the device on the host (not capturable) bypasses the graph runner, and gets
    exactly the features of the positions it has not seen."""
    prompt = list(range(5, 30))
    caller = TargetCaller(target.model)
    ref = target_only_decode(caller, prompt, max_new_tokens=16, stop_ids=frozenset())
    seq = SingleSequence(target.model, max_len=128, attend_granule=16)
    keys = spy_steps(seq)
    drafter = ScriptedDrafter(block_size=4, prompt_len=len(prompt), reference=ref.tokens, script=[0, 2, 1])
    got = seq.decode(prompt, drafter, layer_ids=LAYERS, max_new_tokens=16, stop_ids=frozenset())
    assert got.tokens == ref.tokens
    assert list(got.accepted_per_cycle[:3]) == [0, 2, 1]
    assert keys == []
    starts = [p for p, _ in drafter.contexts]
    assert [f.shape[0] for _, f in drafter.contexts] == [b - a for a, b in zip([0, *starts], starts)]
