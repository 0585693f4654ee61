"""The target's decoder layers through ``torch.compile`` (``decode/forward.py:SlotForward`` with a
``compile_backend``; ``dflash regenerate --compile on``, ``dflash eval --compile on``), against
transformers' own ``generate`` as the reference: the engine's answers are the same with every layer of
every forward run compiled (continuous batching, chunked prefill, continuations over a parked slot, the
live attention's path); one compiled graph serves every layer; a compiler that fails at once or mid-run
leaves the engine eager, with a warning and the same answers.

The CPU tests compile with ``aot_eager`` (the graphs inductor would get, run by eager kernels), through
one backend for the module: each preset's graphs are compiled by its first engine and run by the later
ones, which compile only the kinds of forward they meet first (a compile takes seconds, a run
milliseconds). The slow test compiles with inductor itself (C++ kernels on the CPU); the GPU test runs
inductor's kernels inside the engine's CUDA graphs, in bfloat16."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from dflash_offline.decode import DecodeEngine, EngineSettings
from dflash_offline.decode import forward as forward_module
from dflash_offline.decode.forward import SlotForward, TargetCompileWarning
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.decode.test_drafter_compile import CountingBackend, _broken_backend
from tests.decode.test_engine import generate_greedy, random_prompts, run_all
from tests.decode.test_live_attention import kernel_by_hand  # noqa: F401  (a fixture)
from tests.decode.test_parked_slots import converse, earlier_turn_rewritten

PRESETS = ["random:tiny", "random:tiny-llama"]  # Qwen3 (q_norm/k_norm) and Llama


@pytest.fixture(scope="module", params=PRESETS)
def target(request: pytest.FixtureRequest) -> LoadedTarget:
    return load_target(request.param, device="cpu")


class GraphLog(CountingBackend):
    """``aot_eager``, logging which compiled graph each call ran (graphs numbered as compiled). Once
    ``fail_after`` is set, its graphs fail from their ``fail_after``-th call on (a kernel that breaks on a
    shape met mid-run); ``attempts`` counts the calls from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[int] = []
        self.compiled = 0
        self.fail_after: int | None = None
        self.attempts = 0

    def start(self) -> None:
        """Forget the calls logged so far (a test counts its own); the graphs compiled are kept."""
        self.calls, self.ran, self.fail_after, self.attempts = 0, [], None, 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        counted = super().__call__(gm, example_inputs)
        number = self.compiled
        self.compiled += 1

        def run(*args: Any) -> Any:
            if self.fail_after is not None:
                self.attempts += 1
                if self.attempts > self.fail_after:
                    raise RuntimeError("a kernel broke")
            self.ran.append(number)
            return counted(*args)

        return run


@pytest.fixture(scope="module")
def _module_graphs() -> Iterator[GraphLog]:
    """One backend for the module: dynamo keeps the graphs it compiled per backend and code object, so
    every engine of a preset (whatever its model instance or settings) runs the graphs the first one
    compiled, and compiles only the kinds of forward not met before. Dynamo starts and ends empty."""
    torch._dynamo.reset()
    yield GraphLog()
    torch._dynamo.reset()


@pytest.fixture
def graphs(_module_graphs: GraphLog) -> Iterator[GraphLog]:
    """The module's backend, its calls counted from this test's start."""
    _module_graphs.start()
    yield _module_graphs
    _module_graphs.start()


class CountedForwards:
    """Counts ``SlotForward.hidden`` calls (each one runs every decoder layer once)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        hidden = SlotForward.hidden

        def counted(fwd: SlotForward, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return hidden(fwd, *args, **kwargs)

        monkeypatch.setattr(SlotForward, "hidden", counted)


def _settings(**overrides: Any) -> EngineSettings:
    values: dict[str, Any] = dict(
        num_slots=3, max_len=80, max_new_tokens=8, stop_ids=frozenset(), prefill_tokens=16, attend_granule=8
    )
    values.update(overrides)
    return EngineSettings(**values)


def _prompts_and_budgets(target: LoadedTarget) -> tuple[list[list[int]], list[int], frozenset[int]]:
    prompts = random_prompts(7, seed=11, vocab=target.info.vocab_size)
    max_new = [4 + (i * 5) % 9 for i in range(len(prompts))]
    stop = frozenset({generate_greedy(target.model, prompts[0], 12, frozenset())[3]})
    return prompts, max_new, stop


def _assert_equals_generate(target: LoadedTarget, got: dict[str, Any], prompts, max_new, stop) -> None:
    for i, p in enumerate(prompts):
        assert list(got[f"p{i}"].token_ids) == generate_greedy(target.model, p, max_new[i], stop), i


@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["eager-prefill", "static-prefill"])
def test_compiled_engine_equals_generate(
    target: LoadedTarget, graphs: GraphLog, monkeypatch: pytest.MonkeyPatch, prefill_graphs: bool
) -> None:
    """7 prompts of 3–59 tokens through 3 slots in prefill chunks of 16 tokens, 4–12 new tokens each, some
    ended by a stop token: every layer of every forward runs compiled, the answers are ``generate``'s, and
    every layer of a forward runs the same compiled graph (the layer index is not baked into it)."""
    prompts, max_new, stop = _prompts_and_budgets(target)
    backend = graphs
    forwards = CountedForwards(monkeypatch)
    engine = DecodeEngine(
        target.model, _settings(stop_ids=stop, prefill_graphs=prefill_graphs, compile_backend=backend)
    )
    got = run_all(engine, prompts, max_new)
    _assert_equals_generate(target, got, prompts, max_new, stop)
    assert engine.fwd.compiled
    layers = target.info.num_layers
    assert backend.calls == layers * forwards.calls  # every layer, every forward
    assert forwards.calls > len(prompts)  # decode steps and prefill chunks
    per_forward = [set(backend.ran[i : i + layers]) for i in range(0, len(backend.ran), layers)]
    assert all(len(graphs) == 1 for graphs in per_forward), per_forward
    assert len(set(backend.ran)) <= 6  # a few kinds of forward (decode, prefill, one row or many)


def test_compiled_continuations_over_parked_slots_equal_generate(
    target: LoadedTarget, graphs: GraphLog
) -> None:
    """Conversations of three turns whose later turns continue their parked slot (a chunk attending over
    the cache, the rows gathered) with compiled layers: the answers are ``generate``'s."""
    firsts = random_prompts(4, seed=4, vocab=target.info.vocab_size, lengths=(4, 30))
    engine = DecodeEngine(target.model, _settings(compile_backend=graphs))
    seen = converse(
        engine, firsts, turns=3, rule=earlier_turn_rewritten, reuse=True, max_new=lambda c, k: 3 + (c + k) % 4
    )
    for key, prompt in seen.prompts.items():
        want = generate_greedy(target.model, prompt, len(seen.answers[key]), frozenset())
        assert seen.answers[key] == want, key
    assert engine.fwd.compiled
    assert graphs.calls > 0  # the compiled graphs ran


def test_compiled_engine_over_live_keys_equals_generate(
    target: LoadedTarget,
    graphs: GraphLog,
    kernel_by_hand: Counter[int],  # noqa: F811  (the fixture imported above)
) -> None:
    """The live attention's path (the kernel run by hand on the CPU) inside compiled layers: the attention
    operator reads each row's live keys, and the answers are ``generate``'s."""
    prompts, max_new, stop = _prompts_and_budgets(target)
    engine = DecodeEngine(target.model, _settings(stop_ids=stop, live_attention=True, compile_backend=graphs))
    got = run_all(engine, prompts, max_new)
    _assert_equals_generate(target, got, prompts, max_new, stop)
    assert engine.fwd.compiled
    assert graphs.calls > 0  # the compiled graphs ran
    assert engine.cache.reads_live_lengths
    assert kernel_by_hand[1] > 0  # decode steps over live keys, under the compiled layers


def test_a_failed_compile_runs_eagerly_with_a_warning(target: LoadedTarget) -> None:
    prompts, max_new, stop = _prompts_and_budgets(target)
    engine = DecodeEngine(target.model, _settings(stop_ids=stop, compile_backend=_broken_backend))
    with pytest.warns(TargetCompileWarning, match="no compiler here.*eagerly from now on"):
        got = run_all(engine, prompts, max_new)
    assert not engine.fwd.compiled
    _assert_equals_generate(target, got, prompts, max_new, stop)


def test_a_compiled_forward_that_fails_midway_is_run_again_eagerly(
    target: LoadedTarget, graphs: GraphLog
) -> None:
    """The compiled graphs break inside a forward, some layers in (their keys already written): that
    forward runs again eagerly, and so does every later one; the answers are still ``generate``'s."""
    prompts, max_new, stop = _prompts_and_budgets(target)
    graphs.fail_after = 5 * target.info.num_layers + 2
    engine = DecodeEngine(target.model, _settings(stop_ids=stop, compile_backend=graphs))
    with pytest.warns(TargetCompileWarning, match="a kernel broke"):
        got = run_all(engine, prompts, max_new)
    assert not engine.fwd.compiled
    assert graphs.attempts == graphs.fail_after + 1  # the one failure, then eager for good
    _assert_equals_generate(target, got, prompts, max_new, stop)


def test_regenerate_compile_on_writes_what_off_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, graphs: GraphLog
) -> None:
    from tests.regenerate.test_regenerate import _regenerate_two_turns, write_chat_jsonl

    backend = graphs  # aot_eager, counting its graphs' calls: the compiled layers must run
    monkeypatch.setattr(forward_module, "DEFAULT_COMPILE_BACKEND", backend)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 5, turns=2)
    outputs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", TargetCompileWarning)  # a fallback to eager would pass unseen
        for mode in ("off", "on"):
            calls = backend.calls
            outputs[mode] = _regenerate_two_turns(tmp_path, data, "--compile", mode)[0]
            assert (backend.calls > calls) == (mode == "on"), (mode, backend.calls)
    assert len(outputs["on"]) == 5
    assert outputs["on"] == outputs["off"]


@pytest.mark.slow
def test_inductor_compiled_engine_equals_generate() -> None:
    """Inductor's C++ kernels (float32, CPU): numbers close to eager's, the greedy answers ``generate``'s."""
    cpu = load_target("random:tiny", device="cpu")
    prompts, max_new, stop = _prompts_and_budgets(cpu)
    engine = DecodeEngine(cpu.model, _settings(stop_ids=stop, compile_backend="inductor"))
    got = run_all(engine, prompts, max_new)
    assert engine.fwd.compiled
    _assert_equals_generate(cpu, got, prompts, max_new, stop)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("live", [False, True], ids=["padded", "live"])
def test_on_cuda_compiled_layers_inside_the_graphs_answer_as_eager(live: bool) -> None:
    """bf16 on CUDA, decode steps replayed as CUDA graphs with inductor's kernels in them: the answers
    agree with the eager engine's up to rounding (most answers identical, the others diverging late)."""
    cuda = load_target("random:tiny", device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts(8, seed=5, vocab=cuda.info.vocab_size)
    max_new = [12] * len(prompts)
    answers = {}
    for backend in (None, "inductor"):
        settings = _settings(
            num_slots=4, max_new_tokens=12, prefill_tokens=32, attend_granule=16, live_attention=live,
            compile_backend=backend,
        )  # fmt: skip
        engine = DecodeEngine(cuda.model, settings)
        answers[backend] = run_all(engine, prompts, max_new)
        assert engine.graphs.num_captured >= 1
        assert engine.fwd.compiled == (backend is not None)
    same = sum(answers[None][k].token_ids == answers["inductor"][k].token_ids for k in answers[None])
    assert same >= len(prompts) // 2, same
