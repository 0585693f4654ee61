"""Prefill forwards that wait for prompts (``EngineSettings.prefill_wait_steps``, float32, CPU): the answers
equal the engine's without waiting and batch-1 ``generate`` (rows ending at different times, prompts of
different lengths split into chunks, continuations of parked slots); on a scripted workload of small
prompts arriving while rows decode, the forwards run exactly in the steps counted by hand (when the
prompts fill the budget, at once with no row decoding, ``prefill_wait_steps`` after the oldest prompt
came, a long prompt's later chunk in the next step), and 0 runs one in every step as before."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dflash_offline.decode import DecodeEngine, DecodeError, EngineSettings
from dflash_offline.target_model.loader import LoadedTarget
from tests.decode.test_engine import generate_greedy, random_prompts, run_all
from tests.decode.test_parked_slots import NextPrompt, as_generated, converse, earlier_turn_rewritten

Answers = dict[str, list[int]]


def scripted(engine: DecodeEngine, vocab: int) -> tuple[list[int], Answers, Answers]:
    """Step 0: one prompt of 10 tokens (20 new tokens: it decodes through step 18). Before each of steps
    1–9: two more prompts of 10 tokens (2 to 9 new tokens). Then steps until every answer is in. Returns
    the prefill forwards of each step, the prompts and the answers."""
    prompts: dict[str, list[int]] = {}
    max_new: dict[str, int] = {}
    answers: dict[str, list[int]] = {}
    pool = iter(random_prompts(19, seed=7, vocab=vocab, lengths=(10, 11)))
    per_step: list[int] = []
    step = 0
    while step < 10 or engine.pending():
        arrivals = 1 if step == 0 else 2 if step < 10 else 0
        for _ in range(arrivals):
            key = f"p{len(prompts)}"
            prompts[key] = next(pool)
            max_new[key] = 20 if key == "p0" else 2 + len(prompts) % 8
            engine.submit(key, prompts[key], max_new_tokens=max_new[key])
        before = engine.num_prefills
        engine.step()
        per_step.append(engine.num_prefills - before)
        step += 1
    for done in engine.poll(timeout=0.0):  # nothing pending: no step runs, every answer comes
        answers[done.key] = list(done.token_ids)
    for key, n in max_new.items():
        assert len(answers[key]) == n, key
    return per_step, prompts, answers


def settings(*, slots: int, budget: int, wait: int) -> EngineSettings:
    return EngineSettings(
        num_slots=slots, max_len=200, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=budget,
        attend_granule=8, prefill_wait_steps=wait,
    )  # fmt: skip


def test_small_prompts_wait_to_fill_the_forward_and_no_longer_than_the_bound(target: LoadedTarget) -> None:
    """Budget 64: six prompts of 10 tokens fill a forward (7 × 10 > 64). With a wait of 4 steps:
    step 0: p0, no row decodes → at once; steps 1–3: 2, 4, 6 prompts (60 tokens) → wait; step 4: 8 → six
    run (full), two stay (came at step 4); steps 5–6: 4, 6 → wait; step 7: 8 → six run, two stay (came at
    step 7); steps 8–9: 4, 6 → wait; step 10: the oldest came 3 steps ago → wait; step 11: 4 steps → run.
    4 forwards against 10 without waiting (one each step 0–9), and the same answers as ``generate``."""
    runs = {}
    for wait in (0, 4):
        engine = DecodeEngine(target.model, settings(slots=32, budget=64, wait=wait))
        per_step, prompts, answers = scripted(engine, target.info.vocab_size)
        runs[wait] = answers
        ran = [i for i, n in enumerate(per_step) if n]
        assert ran == ([0, 4, 7, 11] if wait else list(range(10))), wait
        assert engine.num_prefills == len(ran)
        assert sum(engine.prefill_shapes.values()) == len(ran)
        assert engine.num_prefill_tokens == 19 * 10
    assert runs[4] == runs[0]
    for key, prompt in prompts.items():
        assert runs[4][key] == generate_greedy(target.model, prompt, len(runs[4][key]), frozenset()), key


def test_a_long_prompt_s_later_chunk_runs_in_the_next_step(target: LoadedTarget) -> None:
    """Budget 64, a wait of 5 steps. Step 0: a lone prompt, no row decoding → at once. Step 1: a prompt of
    70 tokens fills the forward (64 tokens, cut for room). Step 2: its last 6 tokens (a forward over the
    cache padded to 16 tokens, not full) run at once, not 5 steps after it came. Step 3: a short prompt
    comes; steps 3–7 wait; step 8 (5 steps after) runs it."""
    model = target.model
    engine = DecodeEngine(model, settings(slots=4, budget=64, wait=5))
    lone, long, short = random_prompts(3, seed=8, vocab=target.info.vocab_size, lengths=(5, 6))
    long = (long * 14)[:70]
    arrivals = {0: ("lone", lone, 30), 1: ("long", long, 6), 3: ("short", short, 4)}
    ran: list[int] = []
    step = 0
    while step <= 3 or engine.pending():
        if step in arrivals:
            key, prompt, n = arrivals[step]
            engine.submit(key, prompt, max_new_tokens=n)
        before = engine.num_prefills
        engine.step()
        if engine.num_prefills > before:
            ran.append(step)
        step += 1
    answers = {d.key: list(d.token_ids) for d in engine.poll(timeout=0.0)}
    assert ran == [0, 1, 2, 8]
    for key, prompt, n in arrivals.values():
        assert answers[key] == generate_greedy(model, prompt, n, frozenset()), key


def test_waiting_answers_equal_generate(target: LoadedTarget) -> None:
    """``test_continuous_batching_equals_generate``'s workload (9 prompts of 3–59 tokens through 3 slots,
    chunks of at most 16 tokens, 5 to 14 new tokens, a stop token) with waits of 1, 2 and 5 steps."""
    model = target.model
    prompts = random_prompts(9, seed=1, vocab=target.info.vocab_size)
    max_new = [5 + (i * 4) % 10 for i in range(len(prompts))]
    stop = frozenset({generate_greedy(model, prompts[0], 12, frozenset())[4]})
    expected = {f"p{i}": generate_greedy(model, p, max_new[i], stop) for i, p in enumerate(prompts)}
    for wait in (1, 2, 5):
        engine = DecodeEngine(
            model,
            EngineSettings(
                num_slots=3, max_len=80, max_new_tokens=8, stop_ids=stop, prefill_tokens=16, attend_granule=8,
                prefill_wait_steps=wait,
            ),
        )  # fmt: skip
        got = run_all(engine, prompts, max_new)
        assert {k: list(d.token_ids) for k, d in got.items()} == expected, wait
        assert engine.pending() == 0


@pytest.mark.parametrize("rule", [as_generated, earlier_turn_rewritten], ids=lambda r: r.__name__)
def test_waiting_continuations_of_parked_slots_equal_no_waiting(
    target: LoadedTarget, rule: Callable[[list[int], list[int], list[int]], NextPrompt]
) -> None:
    """5 conversations of 3 turns through 3 slots with their slots kept for the next turn: a wait of 3 steps
    gives the answers and the prefilled tokens of no waiting, and fewer forwards."""
    model = target.model
    firsts = random_prompts(5, seed=4, vocab=target.info.vocab_size, lengths=(4, 30))

    def max_new(c: int, k: int) -> int:
        return 3 + (c + 2 * k) % 6

    runs = {}
    prefills = {}
    for wait in (0, 3):
        engine = DecodeEngine(
            model,
            EngineSettings(
                num_slots=3, max_len=160, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=64,
                attend_granule=8, prefill_wait_steps=wait,
            ),
        )  # fmt: skip
        runs[wait] = converse(engine, firsts, turns=3, rule=rule, reuse=True, max_new=max_new)
        assert engine.num_prefill_tokens == runs[wait].expected_prefill
        assert engine.num_reused_tokens > 0
        assert (engine.num_parked, engine.num_free_slots) == (0, 3)
        prefills[wait] = engine.num_prefills
    assert runs[3].answers == runs[0].answers
    assert prefills[3] < prefills[0]
    for (c, k), prompt in runs[3].prompts.items():
        assert runs[3].answers[c, k] == generate_greedy(model, prompt, max_new(c, k), frozenset()), (c, k)


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(DecodeError, match="out of range"):
        EngineSettings(num_slots=1, max_len=8, max_new_tokens=1, stop_ids=frozenset(), prefill_wait_steps=-1)
