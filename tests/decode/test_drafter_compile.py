"""The speculative cycle's drafter through ``torch.compile`` (``decode/drafting.py:StaticDrafter`` with a
``compile_backend``; ``dflash eval --compile``): its context keys/values and its logits equal the eager
drafter's for every attended length without compiling again per length; a compiler failure leaves it eager
with a warning; in the cycle and in ``dflash eval`` (the target's layers compiled too:
test_target_compile.py) it accepts what the eager one accepts.

The CPU tests compile with ``aot_eager`` (the graphs inductor would get, run by eager kernels: seconds,
and the same numbers); the slow test compiles with inductor itself (C++ kernels on the CPU: numbers close
to eager's); the GPU test runs inductor's kernels inside the cycle's CUDA graphs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from dflash_offline.decode import SingleSequence
from dflash_offline.decode.drafting import DrafterCompileWarning, StaticDrafter
from dflash_offline.decode.forward import TargetCompileWarning
from dflash_offline.drafter import DFlashDrafter, DrafterConfig, resolve_mask_token_id
from dflash_offline.eval import run as eval_run
from dflash_offline.eval.config import EvalConfig, compiles
from dflash_offline.eval.report import format_table
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.eval.helpers import export_untrained

BLOCK = 4
CAPACITY = 96


def _drafter(target: LoadedTarget, *, num_layers: int = 2) -> DFlashDrafter:
    info = target.info
    config = DrafterConfig.from_target_config(
        info.hf_config,
        target_layer_ids=(0, 2),
        mask_token_id=resolve_mask_token_id(target.tokenizer, info.vocab_size),
        num_layers=num_layers,
        block_size=BLOCK,
    )
    torch.manual_seed(0)
    model = target.model
    drafter = DFlashDrafter(
        config, embed_VH=model.get_input_embeddings().weight, lm_head_VH=model.get_output_embeddings().weight
    )
    with torch.no_grad():
        drafter.norm.weight.fill_(
            20.0
        )  # logits far apart (random:tiny's head rows are tiny): a stable argmax
    return drafter.to(target.device).eval()


@pytest.fixture(scope="module")
def target() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class CountingBackend:
    """``aot_eager``, counting the calls of the graphs it compiled (so a test sees them run)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


@torch.inference_mode()
def _run_both(eager: StaticDrafter, compiled: StaticDrafter, *, rtol: float, atol: float) -> list[int]:
    """The same prompt features and cycles through both drafters; their caches and logits compared at every
    step. Returns the compiled graphs counted after each attended length."""
    width = eager.model.config.feature_width
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(40, width, generator=gen)
    zero_1 = torch.zeros(1, dtype=torch.int64)
    graphs = []
    for drafter in (eager, compiled):
        drafter.ingest(features[:23], zero_1)
    for n, attend_len in ((23, 32), (27, 32), (31, 48), (36, 64), (38, 80)):
        block = torch.randn(BLOCK, width, generator=gen)
        for drafter in (eager, compiled):
            drafter.ingest(block, torch.tensor([n - BLOCK]))  # the previous verify block's rows
        anchor_1, n_1 = torch.tensor([n % 50 + 3]), torch.tensor([n])
        want = eager.draft_logits(anchor_1, n_1, attend_len)
        got = compiled.draft_logits(anchor_1, n_1, attend_len)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        assert torch.equal(compiled.draft(anchor_1, n_1, attend_len), want.argmax(dim=-1))
        for mine, theirs in zip(
            (*compiled.keys, *compiled.values), (*eager.keys, *eager.values), strict=True
        ):
            torch.testing.assert_close(mine, theirs, rtol=rtol, atol=atol)
        graphs.append(_unique_graphs())
    return graphs


def test_compiled_static_drafter_equals_eager_for_every_attended_length(target: LoadedTarget) -> None:
    model = _drafter(target)
    eager = StaticDrafter(model, CAPACITY)
    backend = CountingBackend()
    compiled = StaticDrafter(model, CAPACITY, compile_backend=backend)  # type: ignore[arg-type]
    assert compiled.compiled
    assert not eager.compiled
    # The trial compile's rows were cleared: the cache holds no context yet.
    assert all(not c.any() for c in (*compiled.keys, *compiled.values))
    before = backend.calls
    graphs = _run_both(eager, compiled, rtol=0, atol=0)
    # Every layer step ran compiled: per cycle an ingest (keys_values) and a draft (attention_inputs and
    # finish) of each layer, and a draft of the compared argmax (both steps of each layer again).
    layers = model.config.num_layers
    assert backend.calls - before == 5 * (layers + 2 * layers + 2 * layers) + layers  # + the prompt's ingest
    # Dynamic shapes: the second context length may specialise once, later ones reuse those graphs.
    assert graphs[1:] == [graphs[1]] * (len(graphs) - 1), graphs


@pytest.mark.slow
def test_inductor_compiled_static_drafter_is_close_to_eager(target: LoadedTarget) -> None:
    model = _drafter(target)
    compiled = StaticDrafter(model, CAPACITY, compile_backend="inductor")
    assert compiled.compiled
    _run_both(StaticDrafter(model, CAPACITY), compiled, rtol=1e-4, atol=1e-4)


def _broken_backend(gm: Any, example_inputs: Any) -> Any:
    raise RuntimeError("no compiler here")


def test_a_failed_compile_drafts_eagerly_with_a_warning(target: LoadedTarget) -> None:
    model = _drafter(target)
    with pytest.warns(DrafterCompileWarning, match="no compiler here"):
        fallen = StaticDrafter(model, CAPACITY, compile_backend=_broken_backend)  # type: ignore[arg-type]
    assert not fallen.compiled
    assert all(not c.any() for c in (*fallen.keys, *fallen.values))
    _run_both(StaticDrafter(model, CAPACITY), fallen, rtol=0, atol=0)


class FailingLater(CountingBackend):
    """Compiles, then its compiled graphs fail from their ``after``-th call on (a kernel that breaks on a
    shape met mid-run)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.attempts = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        counted = super().__call__(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.attempts += 1
            if self.attempts > self.after:
                raise RuntimeError("a kernel broke")
            return counted(*args)

        return run


def test_a_compiled_step_that_fails_later_falls_back_for_good(target: LoadedTarget) -> None:
    model = _drafter(target)
    backend = FailingLater(after=4 * model.config.num_layers)  # past the trial, inside the first cycles
    compiled = StaticDrafter(model, CAPACITY, compile_backend=backend)  # type: ignore[arg-type]
    assert compiled.compiled
    with pytest.warns(DrafterCompileWarning, match="a kernel broke.*eagerly from now on"):
        _run_both(StaticDrafter(model, CAPACITY), compiled, rtol=0, atol=0)
    assert not compiled.compiled
    assert backend.attempts == backend.after + 1  # the one failure, then eager
    with torch.inference_mode():
        compiled.draft(torch.tensor([3]), torch.tensor([30]), 32)
    assert backend.attempts == backend.after + 1  # eager for good: the compiled graphs are not tried again


def _prompts(target: LoadedTarget) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    vocab = target.info.vocab_size
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (9, 17, 30)]


@pytest.mark.slow  # over 20 s on 2 cores
def test_cycle_with_a_compiled_drafter_accepts_what_the_eager_one_accepts(target: LoadedTarget) -> None:
    model = _drafter(target)
    stop: frozenset[int] = frozenset()
    eager = SingleSequence(target.model, max_len=CAPACITY, attend_granule=16)
    compiled = SingleSequence(target.model, max_len=CAPACITY, attend_granule=16, compile_backend="aot_eager")
    for prompt in _prompts(target):
        only = eager.target_only(prompt, max_new_tokens=40, stop_ids=stop)
        want = eager.speculative(prompt, model, layer_ids=(0, 2), max_new_tokens=40, stop_ids=stop)
        got = compiled.speculative(prompt, model, layer_ids=(0, 2), max_new_tokens=40, stop_ids=stop)
        assert got.tokens == want.tokens == only.tokens
        assert got.accepted_per_cycle == want.accepted_per_cycle
    assert compiled.drafter_compiled
    assert compiled.target_compiled
    assert not eager.drafter_compiled
    assert not eager.target_compiled


@pytest.mark.slow  # over 20 s on 2 cores
def test_eval_compile_option(target: LoadedTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compile``: auto compiles on CUDA alone, off never, on always (the report says so); a failed
    compile still evaluates, eagerly, and the report warns."""
    on = {
        (c, d): compiles(EvalConfig(drafter_dir=tmp_path, compile=c), d)
        for c in ("auto", "off", "on")
        for d in ("cpu", "cuda")
    }
    assert [k for k, v in on.items() if v] == [("auto", "cuda"), ("on", "cpu"), ("on", "cuda")]
    drafter_dir = export_untrained(target, tmp_path / "drafter", block_size=BLOCK)

    def evaluate(compile: Any) -> Any:
        return eval_run.run_eval(
            EvalConfig(
                target="random:tiny", drafter_dir=drafter_dir, limit=2, max_new_tokens=12, device="cpu",
                warmup=False, progress=False, compile=compile,
            )
        )  # fmt: skip

    eager = evaluate("off")
    monkeypatch.setattr(eval_run, "COMPILE_BACKEND", "aot_eager")
    compiled = evaluate("on")
    assert compiled.drafter["compiled"] is compiled.target["compiled"] is True
    assert eager.drafter["compiled"] is eager.target["compiled"] is False
    assert format_table(compiled).splitlines()[0].count(", compiled)") == 2  # the target's and the drafter's
    assert [p.accepted_histogram for p in compiled.prompts] == [p.accepted_histogram for p in eager.prompts]
    assert not any("compile" in w for w in compiled.warnings)
    monkeypatch.setattr(eval_run, "COMPILE_BACKEND", _broken_backend)
    with pytest.warns(DrafterCompileWarning), pytest.warns(TargetCompileWarning):
        fallen = evaluate("on")
    assert fallen.drafter["compiled"] is fallen.target["compiled"] is False
    for model in ("target", "drafter"):
        fell_back = f"`EvalConfig.compile` on: torch.compile of the {model} failed"  # the field, in Python
        assert any(fell_back in w for w in fallen.warnings)
    assert [p.accepted_histogram for p in fallen.prompts] == [p.accepted_histogram for p in eager.prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_drafter_inside_the_cycle_graphs_on_the_gpu() -> None:
    """bf16 on CUDA, the cycle replayed as CUDA graphs with inductor's kernels in them: the same proposals
    as the eager drafter's up to rounding: accepted lengths agree on most cycles."""
    gpu_target = load_target("random:tiny", device="cuda", dtype=torch.bfloat16)
    model = _drafter(gpu_target).cast_parameters(torch.bfloat16)  # as eval casts it
    stop: frozenset[int] = frozenset()
    eager = SingleSequence(gpu_target.model, max_len=CAPACITY, attend_granule=16)
    compiled = SingleSequence(
        gpu_target.model, max_len=CAPACITY, attend_granule=16, compile_backend="inductor"
    )
    same = total = 0
    for prompt in _prompts(gpu_target):
        want = eager.speculative(prompt, model, layer_ids=(0, 2), max_new_tokens=40, stop_ids=stop)
        got = compiled.speculative(prompt, model, layer_ids=(0, 2), max_new_tokens=40, stop_ids=stop)
        pairs = list(zip(got.accepted_per_cycle, want.accepted_per_cycle, strict=False))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
    assert compiled.drafter_compiled
    assert compiled.graphs.num_captured > 0
    assert same >= 0.9 * total, (same, total)
