"""A conversation's next turn reusing the keys and values its previous turn left in its slot (float32,
CPU): multi-turn answers with reuse equal the engine's without it and batch-1 ``generate`` on each turn's
whole prompt, token for token; the tokens prefilled are exactly each turn's prompt past its common prefix
with the parked tokens (the previous prompt and the answer but its last token), however the next prompt
re-renders the previous turn; parked slots are not decoded, compaction moves rows around them, and every
slot is free again at the end (release, eviction oldest first)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from dflash_offline.decode import DecodeEngine, EngineSettings
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.decode.test_engine import generate_greedy, random_prompts

USER_TURN = 5
"""Tokens each later user turn adds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NextPrompt:
    """A turn's prompt, and how many of its leading tokens the previous turn's slot holds (by design)."""

    token_ids: list[int]
    common: int


def other_than(token: int) -> int:
    """Another token of the vocabulary."""
    return token + 1 if token < 1000 else token - 1


def as_generated(prev: list[int], answer: list[int], user: list[int]) -> NextPrompt:
    """The answer as the target generated it (a stop token included): the slot holds all but its last
    token, whose keys and values were never written."""
    return NextPrompt(token_ids=prev + answer + user, common=len(prev) + len(answer) - 1)


def end_marker(prev: list[int], answer: list[int], user: list[int]) -> NextPrompt:
    """An end-of-turn marker the target did not generate after the answer, with its last token replaced
    when that was a stop token: the common prefix still ends at the answer's last token."""
    return NextPrompt(token_ids=prev + answer[:-1] + [7] + user, common=len(prev) + len(answer) - 1)


def answer_rewritten(prev: list[int], answer: list[int], user: list[int]) -> NextPrompt:
    """The answer's first token rendered differently (a template re-rendering the previous answer): the
    common prefix is the previous prompt alone."""
    return NextPrompt(token_ids=[*prev, other_than(answer[0]), *answer[1:], *user], common=len(prev))


def earlier_turn_rewritten(prev: list[int], answer: list[int], user: list[int]) -> NextPrompt:
    """A token inside the previous prompt changed (an earlier turn rendered anew): the common prefix stops
    there."""
    at = len(prev) // 2
    changed = [*prev[:at], other_than(prev[at]), *prev[at + 1 :]]
    return NextPrompt(token_ids=changed + answer + user, common=at)


RULES = [as_generated, end_marker, answer_rewritten, earlier_turn_rewritten]


def short_or_long(prev: list[int], answer: list[int], user: list[int]) -> NextPrompt:
    """Continuations of many widths: the user turn alone after an odd-length prompt, else half the
    conversation (``earlier_turn_rewritten``)."""
    return (as_generated if len(prev) % 2 else earlier_turn_rewritten)(prev, answer, user)


@dataclass(frozen=True, kw_only=True, slots=True)
class Conversations:
    """What ``converse`` saw: every turn's prompt and answer, and the prefill the design predicts."""

    prompts: dict[tuple[int, int], list[int]]
    answers: dict[tuple[int, int], list[int]]
    expected_prefill: int
    """Σ over turns of prompt − common prefix (the whole prompt for first turns and without reuse)."""


def converse(
    engine: DecodeEngine,
    first_prompts: Sequence[list[int]],
    *,
    turns: int,
    rule: Callable[[list[int], list[int], list[int]], NextPrompt],
    reuse: bool,
    max_new: Callable[[int, int], int],
) -> Conversations:
    """Each conversation's turns one after another (the next submitted when the answer comes), all
    conversations at once."""
    prompts: dict[tuple[int, int], list[int]] = {}
    answers: dict[tuple[int, int], list[int]] = {}
    expected = 0

    def submit(c: int, k: int, prompt: NextPrompt) -> None:
        nonlocal expected
        prompts[c, k] = prompt.token_ids
        kept = reuse and k > 0
        expected += len(prompt.token_ids) - (min(prompt.common, len(prompt.token_ids) - 1) if kept else 0)
        engine.submit(
            f"c{c}#{k}", prompt.token_ids, max_new_tokens=max_new(c, k), keep_slot=reuse and k + 1 < turns,
            continues=f"c{c}#{k - 1}" if reuse and k else None,
        )  # fmt: skip

    for c, p in enumerate(first_prompts):
        submit(c, 0, NextPrompt(token_ids=list(p), common=0))
    while engine.pending():
        for done in engine.poll(timeout=5.0):
            c, k = (int(x) for x in done.key[1:].split("#"))
            answers[c, k] = list(done.token_ids)
            if k + 1 < turns:
                g = torch.Generator().manual_seed(100 * c + k)  # the same user turn whatever the order
                user = torch.randint(10, 1000, (USER_TURN,), generator=g).tolist()
                submit(c, k + 1, rule(prompts[c, k], answers[c, k], user))
    return Conversations(prompts=prompts, answers=answers, expected_prefill=expected)


def small_engine(model: Any, *, num_slots: int, stop_ids: frozenset[int] = frozenset()) -> DecodeEngine:
    settings = EngineSettings(
        num_slots=num_slots, max_len=160, max_new_tokens=8, stop_ids=stop_ids, prefill_tokens=16,
        attend_granule=8,
    )  # fmt: skip
    return DecodeEngine(model, settings)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_multi_turn_reuse_equals_no_reuse_and_generate(
    target: LoadedTarget, rule: Callable[[list[int], list[int], list[int]], NextPrompt]
) -> None:
    """5 conversations of 3 turns through 3 slots (continuations and first turns side by side, prompts in
    chunks of 16 tokens, answers of 3 to 8 tokens, some ended by a stop token)."""
    model = target.model
    firsts = random_prompts(5, seed=4, vocab=target.info.vocab_size, lengths=(4, 30))
    stop = frozenset({generate_greedy(model, firsts[0], 8, frozenset())[2]})

    def max_new(c: int, k: int) -> int:
        return 3 + (c + 2 * k) % 6

    runs = {}
    for reuse in (True, False):
        engine = small_engine(model, num_slots=3, stop_ids=stop)
        runs[reuse] = converse(engine, firsts, turns=3, rule=rule, reuse=reuse, max_new=max_new)
        assert engine.num_prefill_tokens == runs[reuse].expected_prefill
        assert (engine.num_parked, engine.num_free_slots) == (0, 3)  # no slot left behind
        if reuse:
            assert engine.num_reused_tokens > 0
            assert engine.num_evictions == 0  # every continuation came at once
    assert runs[True].answers == runs[False].answers
    assert runs[True].expected_prefill < runs[False].expected_prefill
    stopped = 0
    for (c, k), prompt in runs[True].prompts.items():
        assert runs[True].answers[c, k] == generate_greedy(model, prompt, max_new(c, k), stop), (c, k)
        stopped += runs[True].answers[c, k][-1] in stop
    assert stopped >= 1


def test_prefills_over_the_cache_run_at_few_padded_shapes(target: LoadedTarget) -> None:
    """8 conversations of 3 turns through 6 slots, continuations of many widths side by side (one forward
    of 3 of them runs with an idle row): every prefill that attends over the cache runs at a power-of-two
    number of rows and a power-of-two width of at least 16 tokens, within the prefill budget, so that its
    shapes repeat (on CUDA each new one costs the masked attention kernel a plan); the answers stay those
    without reuse and of ``generate``."""
    model = target.model
    firsts = random_prompts(8, seed=1, vocab=target.info.vocab_size, lengths=(4, 40))

    def max_new(c: int, k: int) -> int:
        return 2 + (3 * c + k) % 7

    runs, engines = {}, {}
    for reuse in (True, False):
        settings = EngineSettings(
            num_slots=6, max_len=200, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=128,
            attend_granule=8,
        )  # fmt: skip
        engines[reuse] = DecodeEngine(model, settings)
        engine = engines[reuse]
        runs[reuse] = converse(engine, firsts, turns=3, rule=short_or_long, reuse=reuse, max_new=max_new)
    assert runs[True].answers == runs[False].answers
    for (c, k), prompt in runs[True].prompts.items():
        assert runs[True].answers[c, k] == generate_greedy(model, prompt, max_new(c, k), frozenset()), (c, k)
    over_cache = [s for s in engines[True].prefill_shapes if not s.fresh]
    assert len(over_cache) >= 2
    assert max(s.rows for s in over_cache) == 4
    powers = {2**i for i in range(8)}
    for s in over_cache:
        assert s.rows in powers, s
        assert s.width in powers, s
        assert s.width >= 16, s
        assert s.rows * s.width <= 128, s
    # Fresh prompts (causal over their own keys, no per-shape plan) keep their exact shapes.
    assert any(s.width not in powers for s in engines[True].prefill_shapes if s.fresh)


def run_to_end(engine: DecodeEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.pending():
        out.update({d.key: list(d.token_ids) for d in engine.poll(timeout=5.0)})
    return out


def record_graph_keys(engine: DecodeEngine) -> list[Hashable]:
    """The key of every decode step the engine runs from now on."""
    keys: list[Hashable] = []
    run = engine.graphs.run

    def spy(key: Hashable, step: Any, mutated: Any) -> None:
        keys.append(key)
        run(key, step, mutated)

    engine.graphs.run = spy  # type: ignore[method-assign]
    return keys


def test_parked_slots_are_released_evicted_oldest_first_and_never_decoded(target: LoadedTarget) -> None:
    """Two slots: A and B park (A first); a fresh prompt with no free slot evicts A, not B; B's
    continuation reuses its slot, A's is prefilled whole; ``release`` frees a parked slot and stops an
    in-flight request from parking; a parked slot never widens the decode step."""
    model = target.model
    a, b, fresh, a2_user, b2_user = random_prompts(5, seed=6, vocab=target.info.vocab_size, lengths=(6, 20))
    engine = small_engine(model, num_slots=2)
    engine.submit("A", a, max_new_tokens=2, keep_slot=True)
    engine.submit("B", b, max_new_tokens=5, keep_slot=True)
    got = run_to_end(engine)
    assert (engine.num_parked, engine.num_free_slots) == (2, 0)
    prefilled = engine.num_prefill_tokens

    engine.submit("F", fresh, max_new_tokens=4)
    got |= run_to_end(engine)
    assert (engine.num_evictions, engine.num_parked) == (1, 1)  # A went, B stayed
    a2, b2 = a + got["A"] + a2_user, b + got["B"] + b2_user
    engine.submit("A2", a2, max_new_tokens=4, continues="A")
    engine.submit("B2", b2, max_new_tokens=4, continues="B")
    got |= run_to_end(engine)
    # A2 whole; B2 past B's prompt and answer but its last token.
    assert engine.num_prefill_tokens - prefilled == len(fresh) + len(a2) + len(b2_user) + 1
    assert engine.num_reused_tokens == len(b) + len(got["B"]) - 1
    for key, prompt in {"A2": a2, "B2": b2}.items():
        assert got[key] == generate_greedy(model, prompt, 4, frozenset()), key

    # A long row alone in slot 0 while slot 1 is parked: the decode steps stay one row wide.
    engine.submit("L", fresh, max_new_tokens=8)
    engine.submit("S", a, max_new_tokens=2, keep_slot=True)
    keys = record_graph_keys(engine)
    got |= run_to_end(engine)
    assert engine.num_parked == 1
    assert keys[-1][:2] == ("decode", 1)
    engine.release("S")
    engine.release("S")  # twice, or a key never parked: nothing happens
    engine.release("unknown")
    engine.submit("K", b, max_new_tokens=6, keep_slot=True)
    engine.poll(timeout=0.0)  # in flight
    engine.release("K")
    got |= run_to_end(engine)
    assert got["K"] == generate_greedy(model, b, 6, frozenset())
    assert (engine.num_parked, engine.num_free_slots) == (0, 2)


def test_rows_are_compacted_around_a_parked_slot(target: LoadedTarget) -> None:
    """Four slots: slot 0 parks, slots 1–2 end, the row in slot 3 is moved to slot 1 (a 2-row bucket
    beside the parked slot, not slot 0); its answer and the parked slot's continuation stay exact."""
    model = target.model
    prompts = random_prompts(5, seed=8, vocab=target.info.vocab_size, lengths=(6, 20))
    engine = small_engine(model, num_slots=4)
    engine.submit("P", prompts[0], max_new_tokens=2, keep_slot=True)
    for i, n in ((1, 2), (2, 2), (3, 12)):
        engine.submit(f"r{i}", prompts[i], max_new_tokens=n)
    keys = record_graph_keys(engine)
    got = run_to_end(engine)
    assert engine.num_moves == 1
    assert keys[-1][:2] == ("decode", 2)
    for i, n in ((1, 2), (2, 2), (3, 12)):
        assert got[f"r{i}"] == generate_greedy(model, prompts[i], n, frozenset())
    follow = prompts[0] + got["P"] + prompts[4]
    engine.submit("P2", follow, max_new_tokens=6, continues="P")
    got |= run_to_end(engine)
    assert engine.num_reused_tokens == len(prompts[0]) + 1
    assert got["P2"] == generate_greedy(model, follow, 6, frozenset())
    assert (engine.num_parked, engine.num_free_slots) == (0, 4)


@pytest.mark.gpu
def test_multi_turn_reuse_on_cuda_with_graphs_equals_generate() -> None:
    """float32 on CUDA, decode steps replayed as CUDA graphs: the same conversations with and without
    reuse give the same answers, each batch-1 ``generate``'s."""
    cuda = load_target("random:tiny", device="cuda", dtype=torch.float32)
    firsts = random_prompts(6, seed=5, vocab=cuda.info.vocab_size, lengths=(4, 40))

    def max_new(c: int, k: int) -> int:
        return 4 + (c + k) % 5

    runs = {}
    for reuse in (True, False):
        settings = EngineSettings(
            num_slots=4, max_len=200, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=32,
            attend_granule=16,
        )  # fmt: skip
        engine = DecodeEngine(cuda.model, settings)
        runs[reuse] = converse(engine, firsts, turns=3, rule=as_generated, reuse=reuse, max_new=max_new)
        assert engine.graphs.num_captured >= 1
        assert engine.num_prefill_tokens == runs[reuse].expected_prefill
        assert (engine.num_parked, engine.num_free_slots) == (0, 4)
    assert runs[True].answers == runs[False].answers
    for (c, k), prompt in runs[True].prompts.items():
        assert runs[True].answers[c, k] == generate_greedy(cuda.model, prompt, max_new(c, k), frozenset())
