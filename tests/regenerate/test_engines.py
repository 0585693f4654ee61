"""The engines of ``dflash regenerate``: the decode engine (``slots``) and transformers' continuous batching
give the same greedy answers as sorted static ``generate`` batches (float32 on the CPU; bf16 on a GPU,
with the divergence explained), static batches take the shortest prompts within the KV budget, the slot
count follows the KV budget, a stop request ends the decode engine between two steps, and the driver
keeps one turn per conversation in flight while other conversations fill the batch."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_offline.errors import ConfigError
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.driver import ConversationSink, Driver, render_prompt
from dflash_offline.regenerate.engine_protocol import EngineError, EngineOptions, Finished
from dflash_offline.regenerate.engines import (
    ContinuousEngine,
    FallbackEngine,
    StaticEngine,
    continuous_batching_support,
    make_engine,
)
from dflash_offline.regenerate.generation import GeneratedTokens, GenerationSettings
from dflash_offline.regenerate.jsonl_out import ResumableJsonl, merge_parts
from dflash_offline.regenerate.run import run_regenerate
from dflash_offline.regenerate.slot_engine import SlotEngine
from dflash_offline.target_model.loader import LoadedTarget, load_target, stop_token_ids
from tests.eval.helpers import conversations, one_thread, write_chat_jsonl


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


def _settings(target: LoadedTarget, max_new_tokens: int) -> GenerationSettings:
    stop = stop_token_ids(target.tokenizer, target.model)
    return GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=stop, pad_id=min(stop))


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for length in lengths]


def _answer_all(engine: Any, prompts: Sequence[Sequence[int]]) -> dict[str, GeneratedTokens]:
    for i, p in enumerate(prompts):
        engine.submit(f"p{i}", p)
    out: dict[str, GeneratedTokens] = {}
    try:
        while len(out) < len(prompts):
            for f in engine.poll(timeout=1.0):
                assert f.key not in out
                out[f.key] = f.tokens
    finally:
        engine.close()
    return out


def test_continuous_batching_greedy_equals_static(tiny: LoadedTarget) -> None:
    """More prompts than the batch holds, of mixed lengths, a small paged cache: requests must join and leave
    the running batch, and every answer equals the static path's (and batch-1 ``generate``'s)."""
    assert continuous_batching_support(tiny.model) is None
    settings = _settings(tiny, max_new_tokens=10)
    options = EngineOptions(batch_size=3, kv_tokens=1024, max_batch_tokens=64)
    prompts = _prompts(9, seed=1, vocab=tiny.info.vocab_size)
    cb = _answer_all(ContinuousEngine(tiny.model, settings, options), prompts)
    static = _answer_all(StaticEngine(tiny.model, settings, options), prompts)
    assert cb == static
    # Independent reference: one prompt at a time, no padding, HF generate.
    for i in (0, 4, 8):
        ids = torch.tensor([prompts[i]])
        ref = tiny.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False
        )
        assert list(cb[f"p{i}"].token_ids) == ref[0, len(prompts[i]) :].tolist()[: len(cb[f"p{i}"].token_ids)]
    # The model is left as it was loaded (the manager switches attention while it runs).
    assert tiny.model.config._attn_implementation == tiny.attn_implementation


def test_the_decode_engine_greedy_equals_static_and_generate(tiny: LoadedTarget) -> None:
    """More prompts than slots, of mixed lengths: every answer equals the static path's and batch-1
    ``generate``'s, cut before the stop token like the other engines'."""
    settings = _settings(tiny, max_new_tokens=10)
    options = EngineOptions(batch_size=3, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=60)
    prompts = _prompts(9, seed=1, vocab=tiny.info.vocab_size)
    engine = SlotEngine(tiny.model, settings, options)
    assert engine.num_slots == 3
    slots = _answer_all(engine, prompts)
    assert slots == _answer_all(StaticEngine(tiny.model, settings, options), prompts)
    for i in (0, 4, 8):
        ids = torch.tensor([prompts[i]])
        ref = tiny.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False
        )
        assert (
            list(slots[f"p{i}"].token_ids)
            == ref[0, len(prompts[i]) :].tolist()[: len(slots[f"p{i}"].token_ids)]
        )
    assert tiny.model.config._attn_implementation == tiny.attn_implementation  # the model is left as loaded


def test_the_slot_count_follows_the_kv_budget(tiny: LoadedTarget) -> None:
    settings = _settings(tiny, max_new_tokens=10)
    # Slots of 50 + 10 positions + 1: 200 tokens hold 3 of them (fewer than --batch-size).
    options = EngineOptions(batch_size=8, kv_tokens=200, max_batch_tokens=32, max_prompt_tokens=50)
    engine = SlotEngine(tiny.model, settings, options)
    assert engine.num_slots == 3
    engine.close()
    with pytest.raises(EngineError, match="--kv-tokens"):
        SlotEngine(tiny.model, settings, EngineOptions(batch_size=8, kv_tokens=40, max_batch_tokens=32,
                                                       max_prompt_tokens=50))  # fmt: skip


def test_a_stop_request_ends_the_decode_engine_between_two_steps(tmp_path: Path, tiny: LoadedTarget) -> None:
    """What Ctrl-C does in a worker: the driver sees ``should_stop`` after a poll, the engine is closed with
    the requests in flight dropped, and not one more step runs; the answers finished before are written."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 12, turns=2)
    settings = _settings(tiny, max_new_tokens=16)
    options = EngineOptions(batch_size=3, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=256)
    engine = SlotEngine(tiny.model, settings, options)
    written: list[int] = []
    key = "source_sample_id"
    with (
        ResumableJsonl(tmp_path / "o.jsonl", key=key) as out,
        ResumableJsonl(tmp_path / "f.jsonl", key=key) as fails,
    ):
        sink = ConversationSink(
            out=out, failures=fails, source="t", regenerated_by={},
            on_tally=lambda t: written.append(t.written), on_failure=lambda s: None,
        )  # fmt: skip
        driver = Driver(
            engine=engine, sink=sink, tokenizer=tiny.tokenizer, max_prompt_tokens=256, window=6,
            done=lambda s: False,
        )  # fmt: skip
        completed = driver.run(iter(conversations(data)), should_stop=lambda: sum(written) >= 2)
        steps = engine._engine.num_steps
        engine.close(abort=True)
    assert not completed
    assert engine._engine.num_steps == steps  # nothing ran after the stop
    assert engine.pending() == 0
    lines = (tmp_path / "o.jsonl").read_text().splitlines()
    assert 2 <= len(lines) < 12  # the finished conversations are kept


def test_a_failing_continuous_batching_hands_over_to_static_batches(tiny: LoadedTarget) -> None:
    """``--engine auto`` on a GPU: when the CB loop dies mid-run, the prompts in flight go to static batches;
    every prompt is answered once, with the static path's answer."""
    settings = _settings(tiny, max_new_tokens=8)
    options = EngineOptions(batch_size=2, kv_tokens=1024, max_batch_tokens=32)
    prompts = _prompts(6, seed=3, vocab=tiny.info.vocab_size)
    primary = ContinuousEngine(tiny.model, settings, options)
    notes: list[str] = []
    engine = FallbackEngine(primary, lambda: StaticEngine(tiny.model, settings, options), notes.append)
    for i, p in enumerate(prompts):
        engine.submit(f"p{i}", p)
    got: dict[str, GeneratedTokens] = {}
    while not got:
        got.update({f.key: f.tokens for f in engine.poll(timeout=1.0)})
    primary._manager.stop(block=True, hard_stop=True)  # the loop dies with requests in flight
    while len(got) < len(prompts):
        for f in engine.poll(timeout=1.0):
            assert f.key not in got
            got[f.key] = f.tokens
    engine.close()
    assert engine.name == "static"
    assert any("continuing with static batches" in n for n in notes)
    assert got == _answer_all(StaticEngine(tiny.model, settings, options), prompts)


def test_static_batches_are_the_shortest_prompts_within_budget(tiny: LoadedTarget) -> None:
    settings = _settings(tiny, max_new_tokens=10)
    engine = StaticEngine(
        tiny.model, settings, EngineOptions(batch_size=3, kv_tokens=80, max_batch_tokens=64)
    )
    for key, length in {"a": 5, "b": 50, "c": 7, "d": 30, "e": 6, "f": 5}.items():
        engine.submit(key, [11] * length)
    # rows × (longest + 10) <= 80: three rows of <= 16 tokens fit; "c" (7 + 10) × 4 rows would not.
    assert engine.next_batch() == ["a", "f", "e"]
    engine = StaticEngine(
        tiny.model, settings, EngineOptions(batch_size=8, kv_tokens=80, max_batch_tokens=64)
    )
    for key, length in {"a": 5, "f": 5, "e": 6, "c": 7, "b": 50}.items():
        engine.submit(key, [11] * length)
    assert engine.next_batch() == ["a", "f", "e", "c"]  # 4 × 17 = 68 <= 80; 5 × 60 > 80
    engine = StaticEngine(
        tiny.model, settings, EngineOptions(batch_size=8, kv_tokens=40, max_batch_tokens=64)
    )
    engine.submit("b", [11] * 50)
    assert engine.next_batch() == ["b"]  # one row always runs (its fit is checked at config time)


def test_kv_budget_must_hold_one_conversation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--kv-tokens"):
        RegenerateConfig(out=tmp_path / "o.jsonl", max_prompt_tokens=4096, max_new_tokens=512, kv_tokens=4000)


def test_auto_engine_is_the_decode_engine(tiny: LoadedTarget) -> None:
    settings = _settings(tiny, max_new_tokens=4)
    options = EngineOptions(batch_size=2, kv_tokens=512, max_batch_tokens=32, max_prompt_tokens=64)
    engine = make_engine("auto", tiny.model, settings, options)
    assert engine.name == "slots"
    engine.close()
    for name in ("cb", "static"):
        engine = make_engine(name, tiny.model, settings, options)  # type: ignore[arg-type]
        assert engine.name == name
        engine.close()


class _OneAtATimeEngine:
    """Answers the oldest submitted request per poll with a fixed text, and records what was in flight."""

    name = "static"

    def __init__(self, answer_ids: list[int], consumed: list[int]) -> None:
        self.queue: list[tuple[str, tuple[int, ...]]] = []
        self.answer_ids = tuple(answer_ids)
        self.consumed = consumed
        self.polls: list[tuple[int, list[str]]] = []
        """(records read so far, keys in flight) at each poll."""

    def submit(self, key: str, prompt: Sequence[int]) -> None:
        self.queue.append((key, tuple(prompt)))

    def pending(self) -> int:
        return len(self.queue)

    def poll(self, timeout: float) -> list[Finished]:
        self.polls.append((self.consumed[0], [k for k, _ in self.queue]))
        key, _ = self.queue.pop(0)
        return [Finished(key=key, tokens=GeneratedTokens(token_ids=self.answer_ids, finish_reason="stop"))]

    def close(self, *, abort: bool = False) -> None:
        pass


def test_driver_keeps_one_turn_per_conversation_and_the_window_full(
    tmp_path: Path, tiny: LoadedTarget
) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 7, turns=3)
    consumed = [0]

    def records() -> Iterator[Any]:
        for c in conversations(data):
            consumed[0] += 1
            yield c

    engine = _OneAtATimeEngine(tiny.tokenizer("fine thanks", add_special_tokens=False)["input_ids"], consumed)
    key = "source_sample_id"
    with (
        ResumableJsonl(tmp_path / "o.jsonl", key=key) as out,
        ResumableJsonl(tmp_path / "f.jsonl", key=key) as fails,
    ):
        sink = ConversationSink(
            out=out, failures=fails, source="t", regenerated_by={}, on_tally=lambda t: None,
            on_failure=lambda s: None,
        )  # fmt: skip
        driver = Driver(
            engine=engine, sink=sink, tokenizer=tiny.tokenizer, max_prompt_tokens=4096, window=3,
            done=lambda s: False,
        )  # fmt: skip
        assert driver.run(records(), should_stop=lambda: False)
    assert (sink.total.written, sink.total.answers) == (7, 21)
    assert len(engine.polls) == 21  # one answer per poll: the engine was never polled with nothing to do
    for read, in_flight in engine.polls:
        convs = [k.split("#")[0] for k in in_flight]
        assert len(convs) == len(set(convs))  # never two turns of one conversation at once
        if read < 7:
            assert len(in_flight) == 3  # while records remain, the window is full
    # Turn k of a conversation comes after its turn k-1 was answered, with that answer in its prompt.
    lines = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert all(
        [m["content"] for m in ln["messages"] if m["role"] == "assistant"] == ["fine thanks"] * 3
        for ln in lines
    )


def test_merge_parts_adds_each_line_once(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"source_sample_id": "a", "v": 1}) + "\n")
    part = tmp_path / "w0.jsonl"
    lines = [json.dumps({"source_sample_id": k, "v": i}) for i, k in enumerate("abc")]
    part.write_text("\n".join(lines) + "\n" + lines[0][:9])  # a torn last line from a kill
    with ResumableJsonl(out, key="source_sample_id") as target:
        assert merge_parts(target, [part]) == 2
    assert not part.exists()
    merged = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(m["source_sample_id"], m["v"]) for m in merged] == [("a", 1), ("b", 1), ("c", 2)]


def _lines(path: Path) -> dict[str, Any]:
    return {
        (d := json.loads(line))["source_sample_id"]: d["messages"]
        for line in path.read_text().splitlines()
        if line
    }


def test_regenerate_with_each_engine_writes_the_same_conversations(tmp_path: Path) -> None:
    """The whole command on 3-turn conversations: turn k is answered from the target's own earlier answers
    by every engine, and the conversations written are the same."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6, turns=3, seed=4)
    common: dict[str, Any] = {
        "target": "random:tiny", "data": str(data), "max_new_tokens": 8, "batch_size": 3, "progress": False,
        "kv_tokens": 2048, "max_prompt_tokens": 512, "max_batch_tokens": 64,
    }  # fmt: skip
    cb = run_regenerate(RegenerateConfig(out=tmp_path / "cb.jsonl", engine="cb", **common))
    static = run_regenerate(RegenerateConfig(out=tmp_path / "static.jsonl", engine="static", **common))
    slots = run_regenerate(RegenerateConfig(out=tmp_path / "slots.jsonl", **common))  # auto
    assert cb is not None
    assert static is not None
    assert slots is not None
    assert (cb.engine, static.engine, slots.engine) == ("cb", "static", "slots")
    assert (cb.written, static.written, slots.written, cb.answers) == (6, 6, 6, 18)
    assert cb.new_tokens == static.new_tokens == slots.new_tokens == 18 * 8
    assert (
        _lines(tmp_path / "cb.jsonl") == _lines(tmp_path / "static.jsonl") == _lines(tmp_path / "slots.jsonl")
    )


@pytest.mark.gpu
def test_continuous_batching_bf16_on_cuda_matches_static_up_to_near_ties() -> None:
    """bf16 on a GPU: CB (packed, paged attention) and static (padded) answers may part where the top two
    logits are within bf16 noise. Every divergence is reported with its token and top-2 gap, and must be such
    a near-tie."""
    from tests.embedded_assets import smollm2_gguf_available

    spec = "default" if smollm2_gguf_available() else "random:smollm2-135m"
    target = load_target(spec, device="cuda", dtype=torch.bfloat16)
    settings = _settings(target, max_new_tokens=64)
    options = EngineOptions(batch_size=16, kv_tokens=65536, max_batch_tokens=1024)
    text = ["Explain photosynthesis.", "Write a haiku about rain.", "What is 17 * 23?", "Name three rivers."]
    prompts = [
        render_prompt(target.tokenizer, [{"role": "user", "content": t * (1 + i % 3)}])
        for i, t in enumerate(text * 8)
    ]
    cb = _answer_all(make_engine("cb", target.model, settings, options), prompts)
    static = _answer_all(StaticEngine(target.model, settings, options), prompts)
    report = []
    for i, prompt in enumerate(prompts):
        a, b = list(cb[f"p{i}"].token_ids), list(static[f"p{i}"].token_ids)
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + b[:at]], device="cuda")).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        report.append((i, at, a[at] if at < len(a) else None, b[at] if at < len(b) else None, gap))
    print(
        f"{len(report)} of {len(prompts)} answers diverge "
        f"(prompt, token index, cb token, static token, top-2 logit gap): {report}"
    )
    assert all(gap < 0.5 for *_, gap in report), report
