"""The one decode loop (``decode/speculative.py``, what ``dflash eval`` runs: speculative with a drafter,
target-only without one) against the reference loops of ``tests/oracles`` (transformers' forward with a
``DynamicCache``), lossless against greedy decoding, and τ counted on hand-made cases. Every case runs on
both implementations (``hf``: the oracles; ``engine``: the one loop, its DFlash drafter drafting on the
device), so each is held to the same outputs.

The reference is the target-only loop; it is itself checked against an independent greedy decode
without a KV cache (a full forward over the whole sequence for every token)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from dflash_offline.decode import DecodeResult, SingleSequence
from dflash_offline.eval.report import histogram, prompt_result, summarize
from dflash_offline.target_model.capture import FeatureCapture
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.eval.helpers import ScriptedDrafter, one_thread, untrained_drafter
from tests.oracles.reference_decode import (
    DFlashBlockDrafter,
    TargetCaller,
    speculative_decode,
    target_only_decode,
)

LAYERS = (0, 2)
NO_STOP: frozenset[int] = frozenset()


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module", params=["random:tiny", "random:tiny-llama"])
def target(request: pytest.FixtureRequest) -> LoadedTarget:
    return load_target(request.param, device="cpu")


class Loops:
    """Target-only and speculative decoding of one implementation: ``hf`` (the oracles) or ``engine``."""

    def __init__(self, target: LoadedTarget, kind: str) -> None:
        self.caller = TargetCaller(target.model)
        self.engine = (
            SingleSequence(target.model, max_len=160, attend_granule=16) if kind == "engine" else None
        )

    def target_only(self, prompt: Sequence[int], **kw: Any) -> DecodeResult:
        if self.engine is not None:
            return self.engine.target_only(prompt, **kw)
        return target_only_decode(self.caller, prompt, **kw)

    def speculative(self, drafter: Any, prompt: Sequence[int], **kw: Any) -> DecodeResult:
        if self.engine is not None:
            on_device = drafter.model if isinstance(drafter, DFlashBlockDrafter) else drafter
            return self.engine.speculative(prompt, on_device, **kw)
        return speculative_decode(self.caller, drafter, prompt, **kw)


@pytest.fixture(params=["hf", "engine"])
def loops(request: pytest.FixtureRequest, target: LoadedTarget) -> Loops:
    return Loops(target, request.param)


def _prompts(target: LoadedTarget) -> list[list[int]]:
    tok = target.tokenizer
    texts = ["Hello there, how are you?", "Write a poem about the sea.", "2+2="]
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for t in texts
    ]
    return [*prompts, [17]]  # and a one-token prompt


def _greedy_without_cache(target: LoadedTarget, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target.model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def test_target_only_loop_is_greedy_decoding(target: LoadedTarget, loops: Loops) -> None:
    prompt = _prompts(target)[0]
    got = loops.target_only(prompt, max_new_tokens=12, stop_ids=NO_STOP)
    assert list(got.tokens) == _greedy_without_cache(target, prompt, 12)
    assert got.stop_reason == "length"
    assert got.num_target_forwards == 11  # the first token comes from the prefill
    assert got.accepted_per_cycle == ()
    assert got.tau is None


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_untrained_drafter_is_lossless(target: LoadedTarget, loops: Loops, block_size: int) -> None:
    drafter = DFlashBlockDrafter(untrained_drafter(target, block_size=block_size))
    for prompt in _prompts(target):
        ref = loops.target_only(prompt, max_new_tokens=24, stop_ids=NO_STOP)
        got = loops.speculative(drafter, prompt, layer_ids=LAYERS, max_new_tokens=24, stop_ids=NO_STOP)
        assert got.tokens == ref.tokens
        assert len(got.tokens) == 24
        assert all(0 <= a < block_size for a in got.accepted_per_cycle)
        # Every cycle emits a + 1 tokens; the prefill emits the first.
        assert 1 + sum(a + 1 for a in got.accepted_per_cycle) >= 24
        assert 1 + sum(a + 1 for a in got.accepted_per_cycle[:-1]) < 24


def test_perfect_drafter_accepts_every_block(target: LoadedTarget, loops: Loops) -> None:
    B = 5
    for prompt in _prompts(target):
        ref = loops.target_only(prompt, max_new_tokens=40, stop_ids=NO_STOP)
        oracle = ScriptedDrafter(block_size=B, prompt_len=len(prompt), reference=ref.tokens)
        got = loops.speculative(oracle, prompt, layer_ids=LAYERS, max_new_tokens=21, stop_ids=NO_STOP)
        assert got.tokens == ref.tokens[:21]
        # 1 token from the prefill + 4 cycles × B tokens = 21: every cycle full, τ = B.
        assert got.accepted_per_cycle == (B - 1,) * 4
        assert got.tau == B
        assert got.num_target_forwards == 4


def test_tau_counted_on_a_hand_made_case(target: LoadedTarget, loops: Loops) -> None:
    prompt = _prompts(target)[1]
    B = 4
    ref = loops.target_only(prompt, max_new_tokens=60, stop_ids=NO_STOP)
    script = [2, 0, 3, 1, 0, 3, 3]  # accepted drafts per cycle; 3 = B − 1 = all accepted
    drafter = ScriptedDrafter(block_size=B, prompt_len=len(prompt), reference=ref.tokens, script=script)
    # 1 + Σ (a + 1) = 1 + (3 + 1 + 4 + 2 + 1 + 4 + 4) = 20 tokens: the script ends exactly at the budget.
    got = loops.speculative(drafter, prompt, layer_ids=LAYERS, max_new_tokens=20, stop_ids=NO_STOP)
    assert got.tokens == ref.tokens[:20]
    assert list(got.accepted_per_cycle) == script
    assert got.tau == pytest.approx((3 + 1 + 4 + 2 + 1 + 4 + 4) / 7)
    assert histogram(got.accepted_per_cycle, B) == [2, 1, 1, 3]
    # Anchors: each cycle starts at the last emitted token, at its position.
    positions = [p for _, p in drafter.anchors]
    expected_positions = [len(prompt)]
    for a in script[:-1]:
        expected_positions.append(expected_positions[-1] + a + 1)
    assert positions == expected_positions
    for token, pos in drafter.anchors:
        assert token == ref.tokens[pos - len(prompt)]
    # The report's overall τ is Σ (a + 1) ÷ cycles over all prompts, not a mean of per-prompt τ.
    base = loops.target_only(prompt, max_new_tokens=20, stop_ids=NO_STOP)
    one = prompt_result(
        sample_id="a",
        record_id="",
        prompt_tokens=len(prompt),
        spec=got,
        target_only=base,
        block_size=B,
        text="",
    )
    drafter2 = ScriptedDrafter(block_size=B, prompt_len=len(prompt), reference=ref.tokens, script=[0, 0, 0])
    got2 = loops.speculative(drafter2, prompt, layer_ids=LAYERS, max_new_tokens=4, stop_ids=NO_STOP)
    assert list(got2.accepted_per_cycle) == [0, 0, 0]
    two = prompt_result(
        sample_id="b",
        record_id="",
        prompt_tokens=len(prompt),
        spec=got2,
        target_only=base,
        block_size=B,
        text="",
    )
    assert not two.identical
    assert two.first_mismatch == 4
    summary = summarize([one, two], block_size=B)
    assert summary.tau == pytest.approx((19 + 3) / 10)
    assert summary.accepted_histogram == [5, 1, 1, 3]
    assert summary.identical_prompts == 1


def test_drafter_context_is_the_target_features_of_every_earlier_position(
    target: LoadedTarget, loops: Loops
) -> None:
    """After each crop, the features handed over are those of the accepted positions exactly: their
    concatenation equals the features of the final sequence computed in one full forward."""
    prompt = _prompts(target)[0]
    B = 4
    ref = loops.target_only(prompt, max_new_tokens=60, stop_ids=NO_STOP)
    drafter = ScriptedDrafter(
        block_size=B, prompt_len=len(prompt), reference=ref.tokens, script=[1, 0, 3, 2, 0, 1]
    )
    got = loops.speculative(drafter, prompt, layer_ids=LAYERS, max_new_tokens=16, stop_ids=NO_STOP)
    assert got.tokens == ref.tokens[:16]
    start = 0
    for anchor_position, features in drafter.contexts:
        assert features.shape[0] == anchor_position - start  # exactly the positions not seen yet
        start = anchor_position
    context = torch.cat([f for _, f in drafter.contexts])
    sequence = torch.tensor([list(prompt) + list(ref.tokens[: start - len(prompt)])])
    full = FeatureCapture(target, LAYERS)(sequence, torch.ones_like(sequence))[0]
    assert context.shape == full.shape
    torch.testing.assert_close(context, full, rtol=1e-4, atol=1e-5)
    # A wrong crop would shift features by a position: far outside the tolerance.
    assert not torch.allclose(context[1:], full[:-1], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 8, 13])
def test_max_new_tokens_is_exact(target: LoadedTarget, loops: Loops, max_new_tokens: int) -> None:
    prompt = _prompts(target)[2]
    ref = loops.target_only(prompt, max_new_tokens=40, stop_ids=NO_STOP)
    oracle = ScriptedDrafter(block_size=4, prompt_len=len(prompt), reference=ref.tokens)
    got = loops.speculative(oracle, prompt, layer_ids=LAYERS, max_new_tokens=max_new_tokens, stop_ids=NO_STOP)
    base = loops.target_only(prompt, max_new_tokens=max_new_tokens, stop_ids=NO_STOP)
    assert got.tokens == base.tokens == ref.tokens[:max_new_tokens]
    assert got.stop_reason == base.stop_reason == "length"
    if max_new_tokens == 1:
        assert got.accepted_per_cycle == ()
        assert got.tau is None


def test_stop_token_ends_both_loops_identically(target: LoadedTarget, loops: Loops) -> None:
    """The stop token may arrive as the prefill token, as an accepted draft mid-block, or as a bonus."""
    prompt = _prompts(target)[0]
    ref = loops.target_only(prompt, max_new_tokens=40, stop_ids=NO_STOP)
    # Positions where a token occurs for the first time: making it the stop token ends the output there.
    firsts = [i for i, t in enumerate(ref.tokens) if t not in ref.tokens[:i]][:5]
    assert firsts[0] == 0
    assert len(firsts) >= 2
    for stop_at in firsts:
        stop = frozenset({ref.tokens[stop_at]})
        base = loops.target_only(prompt, max_new_tokens=40, stop_ids=stop)
        assert base.tokens == ref.tokens[: stop_at + 1]
        assert base.stop_reason == "stop_token"
        for drafter in (
            ScriptedDrafter(block_size=4, prompt_len=len(prompt), reference=ref.tokens),
            ScriptedDrafter(block_size=4, prompt_len=len(prompt), reference=ref.tokens, script=[0, 1, 0, 2]),
            DFlashBlockDrafter(untrained_drafter(target, block_size=4)),
        ):
            got = loops.speculative(drafter, prompt, layer_ids=LAYERS, max_new_tokens=40, stop_ids=stop)
            assert got.tokens == base.tokens
            assert got.stop_reason == "stop_token"
