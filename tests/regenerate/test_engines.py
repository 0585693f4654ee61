"""The local engine of ``dflash regenerate``, the decode engine (``slots``): its greedy answers equal batch-1
HF ``generate`` token for token, rows ending at different times (a stop token, the answer length) and cut
before the stop token (float32 on the CPU; bf16 on a GPU, with the divergences explained), the slot count
follows the KV budget, a stop request ends it between two steps, and the driver keeps one turn per
conversation in flight while other conversations fill the batch."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_offline.errors import ConfigError
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.driver import ConversationSink, Driver, render_prompt
from dflash_offline.regenerate.engine_protocol import EngineError, EngineOptions, Finished
from dflash_offline.regenerate.generation import GeneratedTokens, GenerationSettings
from dflash_offline.regenerate.jsonl_out import ResumableJsonl, merge_parts
from dflash_offline.regenerate.slot_engine import SlotEngine, reuses_kv
from dflash_offline.target_model.loader import LoadedTarget, load_target, stop_token_ids
from tests.decode.test_engine import generate_greedy, random_prompts
from tests.eval.helpers import conversations, one_thread, write_chat_jsonl


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


def _settings(
    target: LoadedTarget, max_new_tokens: int, more_stops: frozenset[int] = frozenset()
) -> GenerationSettings:
    stop = stop_token_ids(target.tokenizer, target.model) | more_stops
    return GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=stop)


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


def _as_answer(generated: list[int], stop_ids: frozenset[int]) -> GeneratedTokens:
    """``generate``'s output (ending at its stop token, or at the length) as regenerate hands it on."""
    if generated and generated[-1] in stop_ids:
        return GeneratedTokens(token_ids=tuple(generated[:-1]), finish_reason="stop")
    return GeneratedTokens(token_ids=tuple(generated), finish_reason="length")


def test_the_decode_engine_greedy_equals_generate(tiny: LoadedTarget) -> None:
    """More prompts than slots, of mixed lengths, prefilled in chunks; a stop token the model does produce
    ends some answers early while the others run to --max-new-tokens: every answer is batch-1
    ``generate``'s (no padding), token for token, cut before its stop token, with its finish reason."""
    prompts = random_prompts(9, seed=1, vocab=tiny.info.vocab_size)
    # Stop tokens that three prompts' free runs produce at their 2nd, 4th and 7th token.
    free = {i: generate_greedy(tiny.model, prompts[i], 10, frozenset()) for i in (0, 3, 6)}
    stops = frozenset({free[0][3], free[3][6], free[6][1]})
    settings = _settings(tiny, max_new_tokens=10, more_stops=stops)
    options = EngineOptions(batch_size=3, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=60)
    engine = SlotEngine(tiny.model, settings, options)
    assert engine.num_slots == 3
    got = _answer_all(engine, prompts)
    want = {
        f"p{i}": _as_answer(generate_greedy(tiny.model, p, 10, settings.stop_ids), settings.stop_ids)
        for i, p in enumerate(prompts)
    }
    assert got == want
    assert len({len(a.token_ids) for a in want.values()}) >= 4  # the rows finished at different times
    assert {a.finish_reason for a in want.values()} == {"stop", "length"}
    assert tiny.model.config._attn_implementation == tiny.attn_implementation  # the model is left as loaded


def test_the_slot_engine_counts_its_steps_and_prefill(tiny: LoadedTarget) -> None:
    """Two slots, three prompts of 4 new tokens each (random weights: no stop this soon). A step decodes a
    token for every row already decoding, then prefills what waits (the rows it completes decode from the
    next step): an answer's first token comes from its prefill forward, the other 3 from the 3 decode
    steps after it. The first two prompts share one prefill forward (step 1) and end after step 4; the
    third takes a slot at step 5 and ends after step 8. So 8 steps, 9 decoded tokens of 8 × 2 slot-steps
    (56 % busy), 2 prefill forwards of every prompt token once, nothing reused or evicted."""
    prompts = random_prompts(3, seed=4, vocab=tiny.info.vocab_size, lengths=(5, 20))
    settings = _settings(tiny, max_new_tokens=4)
    options = EngineOptions(batch_size=2, kv_tokens=None, max_batch_tokens=64, max_prompt_tokens=30)
    engine = SlotEngine(tiny.model, settings, options)
    got = _answer_all(engine, prompts)  # closes the engine: its counts stay
    assert {a.finish_reason for a in got.values()} == {"length"}
    stats = engine.stats()
    assert (stats.engines, stats.slots, stats.steps, stats.slot_steps, stats.decoded_tokens) == (
        1,
        2,
        8,
        16,
        9,
    )
    prompt_tokens = sum(len(p) for p in prompts)
    assert (stats.prefills, stats.prefill_tokens, stats.reused_tokens, stats.evictions) == (
        2,
        prompt_tokens,
        0,
        0,
    )
    assert stats.step_seconds > 0
    assert stats.describe() == (
        f"8 steps decoding a mean 1.1 of 2 slots (56 % busy) in {stats.step_seconds:.1f} s, 2 prefill "
        f"forwards of {prompt_tokens} prompt tokens (0 reused, 0 kept slots evicted)"
    )


def test_the_slot_count_follows_the_kv_budget(tiny: LoadedTarget) -> None:
    settings = _settings(tiny, max_new_tokens=10)
    # Slots of 50 + 10 positions + 1: 200 tokens hold 3 of them (fewer than --batch-size).
    options = EngineOptions(batch_size=8, kv_tokens=200, max_batch_tokens=32, max_prompt_tokens=50)
    engine = SlotEngine(tiny.model, settings, options)
    assert engine.num_slots == 3
    engine.close()
    with pytest.raises(EngineError, match=r"lower `RegenerateConfig\.kv_tokens` \(KV-cache size\)"):
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
            out=out, failures=fails, partial=tmp_path / "o.jsonl.partial", source="t", regenerated_by={},
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


def test_kv_budget_must_hold_one_conversation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not fit in `RegenerateConfig\.kv_tokens` 4000"):
        RegenerateConfig(out=tmp_path / "o.jsonl", max_prompt_tokens=4096, max_new_tokens=512, kv_tokens=4000)


class _OneAtATimeEngine:
    """Answers the oldest submitted request per poll with a fixed text, and records what was in flight."""

    name = "slots"

    def __init__(self, answer_ids: list[int], consumed: list[int]) -> None:
        self.queue: list[tuple[str, tuple[int, ...]]] = []
        self.answer_ids = tuple(answer_ids)
        self.consumed = consumed
        self.polls: list[tuple[int, list[str]]] = []
        """(records read so far, keys in flight) at each poll."""

    def submit(self, key: str, prompt: Sequence[int], **hints: Any) -> None:
        self.queue.append((key, tuple(prompt)))

    def release(self, key: str) -> None:
        pass

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
            out=out, failures=fails, partial=tmp_path / "o.jsonl.partial", source="t", regenerated_by={},
            on_tally=lambda t: None, on_failure=lambda s: None,
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


PAST_ANSWERS_MARKED = (
    "{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('boom') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}{{ '(earlier) ' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML that renders a past answer with a mark the answer did not have (as Qwen3's template drops an
earlier turn's thinking), and refuses any message holding ``boom``."""


class _Hints:
    """A ``SlotEngine`` whose reuse hints are recorded, or dropped (``reuse=False``: every prompt
    prefilled whole), and whose answers to ``silent`` keys are emptied (the target said nothing)."""

    name = "slots"

    def __init__(self, engine: SlotEngine, *, reuse: bool, silent: frozenset[str] = frozenset()) -> None:
        self.engine = engine
        self.reuse = reuse
        self.silent = silent
        self.prompts: dict[str, list[int]] = {}
        self.answers: dict[str, GeneratedTokens] = {}
        self.released: list[str] = []

    def submit(
        self, key: str, prompt: Sequence[int], *, keep_slot: bool = False, continues: str | None = None
    ) -> None:
        self.prompts[key] = list(prompt)
        if self.reuse:
            self.engine.submit(key, prompt, keep_slot=keep_slot, continues=continues)
        else:
            self.engine.submit(key, prompt)

    def release(self, key: str) -> None:
        self.released.append(key)
        self.engine.release(key)

    def pending(self) -> int:
        return self.engine.pending()

    def poll(self, timeout: float) -> list[Finished]:
        done = self.engine.poll(timeout)
        self.answers |= {f.key: f.tokens for f in done}
        silence = GeneratedTokens(token_ids=(), finish_reason="stop")
        return [Finished(key=f.key, tokens=silence) if f.key in self.silent else f for f in done]

    def close(self, *, abort: bool = False) -> None:
        self.engine.close(abort=abort)


def _write(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


def _drive(
    tmp_path: Path, engine: _Hints, data: Path, *, tokenizer: Any, max_prompt_tokens: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Regenerate ``data`` through ``engine``: the output lines and the failure lines."""
    out, failed = tmp_path / f"o-{engine.reuse}.jsonl", tmp_path / f"f-{engine.reuse}.jsonl"
    key = "source_sample_id"
    with ResumableJsonl(out, key=key) as o, ResumableJsonl(failed, key=key) as f:
        sink = ConversationSink(
            out=o,
            failures=f,
            partial=tmp_path / f"o-{engine.reuse}.jsonl.partial",
            source="t",
            regenerated_by={},
            on_tally=lambda t: None,
            on_failure=lambda s: None,
        )
        driver = Driver(
            engine=engine, sink=sink, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, window=6,
            done=lambda s: False,
        )  # fmt: skip
        assert driver.run(iter(conversations(data)), should_stop=lambda: False)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    failures = failed.read_text().splitlines() if failed.exists() else []
    return lines, [json.loads(x) for x in failures]


def _prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _chat_records(n: int, turns: int) -> list[dict[str, Any]]:
    rng = torch.Generator().manual_seed(3)
    words = "red green blue cat dog sun moon tree river stone".split()  # noqa: SIM905
    records = []
    for i in range(n):
        messages = []
        for _ in range(turns):
            picks = torch.randint(
                0, len(words), (int(torch.randint(3, 9, (1,), generator=rng)),), generator=rng
            )
            messages += [
                {"role": "user", "content": " ".join(words[int(j)] for j in picks)},
                {"role": "assistant", "content": "old answer"},
            ]
        records.append({"id": f"r{i}", "messages": messages})
    return records


@pytest.mark.parametrize("template", ["own", "past_answers_marked"])
def test_the_driver_reuses_each_turns_slot_with_the_same_answers(
    tmp_path: Path, tiny: LoadedTarget, template: str
) -> None:
    """7 conversations of 3 turns through 3 slots: with the previous turn's slot kept for the next, the
    output equals a run that prefills every prompt whole, every answer is batch-1 ``generate``'s on its
    turn's whole prompt, and the tokens prefilled are exactly each turn's prompt past its common prefix
    with the previous prompt and answer; with a template that re-renders past answers the prefix ends
    before the answer. No slot is left parked."""
    tokenizer = copy.deepcopy(tiny.tokenizer)
    if template != "own":
        tokenizer.chat_template = PAST_ANSWERS_MARKED
    firsts = [render_prompt(tokenizer, [m]) for m in (r["messages"][0] for r in _chat_records(7, 3))]
    free = generate_greedy(tiny.model, firsts[0], 10, frozenset())
    settings = _settings(tiny, max_new_tokens=10, more_stops=frozenset({free[5]}))
    options = EngineOptions(batch_size=3, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=256)
    data = _write(tmp_path, _chat_records(7, 3))
    runs = {}
    for reuse in (True, False):
        engine = _Hints(SlotEngine(tiny.model, settings, options), reuse=reuse)
        runs[reuse] = engine, _drive(tmp_path, engine, data, tokenizer=tokenizer, max_prompt_tokens=256)
    (reused, (lines, failures)), (whole, (lines_whole, _)) = runs[True], runs[False]
    assert (len(lines), failures) == (7, [])
    assert lines == lines_whole
    raw = {k: generate_greedy(tiny.model, p, 10, settings.stop_ids) for k, p in reused.prompts.items()}
    expected = 0
    for key, prompt in reused.prompts.items():
        assert reused.answers[key] == _as_answer(raw[key], settings.stop_ids), key
        conv, turn = key.rsplit("#", 1)
        if turn == "0":
            expected += len(prompt)
            continue
        previous = f"{conv}#{int(turn) - 1}"
        # The previous turn's slot: its prompt and its answer but the last token (never fed back).
        common = _prefix_len(reused.prompts[previous] + raw[previous][:-1], prompt)
        if template != "own":
            assert common <= len(reused.prompts[previous])  # the re-rendered answer is not reused
        expected += len(prompt) - min(common, len(prompt) - 1)
    decode = reused.engine._engine
    assert decode.num_prefill_tokens == expected
    assert whole.engine._engine.num_prefill_tokens == sum(len(p) for p in whole.prompts.values()) > expected
    assert {a.finish_reason for a in reused.answers.values()} == {"stop", "length"}
    assert (decode.num_parked, decode.num_free_slots, decode.num_evictions) == (0, 3, 0)


def test_reuse_off_prefills_every_prompt_whole_whatever_the_hints(tmp_path: Path, tiny: LoadedTarget) -> None:
    """With ``reuse_kv=False`` the engine ignores the driver's hints: it prefills every turn's prompt whole
    (the prefill count is the prompts' total), keeps no slot, and answers as with reuse. By default it
    reuses on the CPU and not on CUDA (where reuse measured slower)."""
    settings = _settings(tiny, max_new_tokens=8)
    data = _write(tmp_path, _chat_records(4, 3))
    runs = {}
    for reuse_kv in (True, False):
        options = EngineOptions(
            batch_size=2, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=256, reuse_kv=reuse_kv
        )
        engine = _Hints(SlotEngine(tiny.model, settings, options), reuse=True)
        runs[reuse_kv] = engine, _drive(tmp_path / str(reuse_kv), engine, data, tokenizer=tiny.tokenizer,
                                        max_prompt_tokens=256)  # fmt: skip
    (kept, (lines_kept, _)), (whole, (lines_whole, failures)) = runs[True], runs[False]
    assert (len(lines_whole), failures) == (4, [])
    assert lines_whole == lines_kept
    decode = whole.engine._engine
    assert decode.num_prefill_tokens == sum(len(p) for p in whole.prompts.values())
    assert decode.num_reused_tokens == 0 < kept.engine._engine.num_reused_tokens
    assert (decode.num_parked, decode.num_free_slots) == (0, 2)
    default = EngineOptions(batch_size=2, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=256)
    assert reuses_kv(default, torch.device("cpu"))
    assert not reuses_kv(default, torch.device("cuda"))  # the masked attention: prefill whole
    assert reuses_kv(replace(default, live_attention=True), torch.device("cuda"))


def _by_id(line: dict[str, Any]) -> str:
    return str(line["id"])


def test_prefill_wait_gives_the_same_lines_in_fewer_prefill_forwards(
    tmp_path: Path, tiny: LoadedTarget
) -> None:
    """``prefill_wait`` reaches the decode engine (``EngineStats.prefills``): 8 conversations of 3 turns
    through 4 slots, every prompt prefilled whole (CUDA's default), a forward of 256 tokens holding several
    prompts: waiting up to 4 steps writes the same lines as not waiting, each turn's answer batch-1
    ``generate``'s, in fewer prefill forwards."""
    records = _chat_records(8, 3)
    first = render_prompt(tiny.tokenizer, [records[0]["messages"][0]])
    free = generate_greedy(tiny.model, first, 8, frozenset())
    settings = _settings(tiny, max_new_tokens=8, more_stops=frozenset({free[3]}))  # answers of many lengths
    data = _write(tmp_path, records)
    runs = {}
    for wait in (0, 4):
        options = EngineOptions(
            batch_size=4, kv_tokens=None, max_batch_tokens=256, max_prompt_tokens=256, reuse_kv=False,
            prefill_wait=wait,
        )  # fmt: skip
        engine = _Hints(SlotEngine(tiny.model, settings, options), reuse=False)
        runs[wait] = engine, _drive(tmp_path / str(wait), engine, data, tokenizer=tiny.tokenizer,
                                    max_prompt_tokens=256)  # fmt: skip
    (waited, (lines_waited, failures)), (_, (lines_eager, _)) = runs[4], runs[0]
    assert (len(lines_waited), failures) == (8, [])
    assert sorted(lines_waited, key=_by_id) == sorted(lines_eager, key=_by_id)  # written as they end
    for key, prompt in waited.prompts.items():
        raw = generate_greedy(tiny.model, prompt, 8, settings.stop_ids)
        assert waited.answers[key] == _as_answer(raw, settings.stop_ids), key
    assert waited.engine._engine.settings.prefill_wait_steps == 4
    stats = {w: engine.engine.stats() for w, (engine, _) in runs.items()}
    assert stats[4].prefill_tokens == stats[0].prefill_tokens
    assert stats[4].prefills < stats[0].prefills


def test_a_conversation_that_ends_early_releases_its_kept_slot(tmp_path: Path, tiny: LoadedTarget) -> None:
    """Three conversations end before their last turn: the next prompt is refused by the template, too
    long, or the target answered nothing; each releases the slot kept for its next turn, and no slot is
    left parked (none had to be evicted either)."""
    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.chat_template = PAST_ANSWERS_MARKED
    records = _chat_records(5, 2)
    records[0]["messages"][2]["content"] = "boom"
    records[1]["messages"][2]["content"] = "word " * 300
    settings = _settings(tiny, max_new_tokens=8)
    options = EngineOptions(batch_size=2, kv_tokens=None, max_batch_tokens=32, max_prompt_tokens=200)
    data = _write(tmp_path, records)
    ids = [c.sample_id for c in conversations(data)]
    engine = _Hints(SlotEngine(tiny.model, settings, options), reuse=True, silent=frozenset({f"{ids[2]}#0"}))
    lines, failures = _drive(tmp_path, engine, data, tokenizer=tokenizer, max_prompt_tokens=200)
    assert {ln["id"]: ln["dropped_turns"] for ln in lines} == {"r1": 1, "r3": 0, "r4": 0}
    assert {f["record_id"]: f["reason"] for f in failures} == {"r0": "template_error", "r2": "empty_response"}
    decode = engine.engine._engine
    assert (decode.num_parked, decode.num_free_slots, decode.num_evictions) == (0, 2, 0)
    assert sorted(engine.released) == sorted(f"{ids[i]}#0" for i in range(3))
    assert decode.num_reused_tokens > 0


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


@pytest.mark.gpu
def test_the_decode_engine_in_bf16_on_cuda_equals_generate_up_to_near_ties() -> None:
    """bf16 on a GPU, CUDA graphs on: the engine's answers (packed chunked prefill, slot attention) and
    batch-1 ``generate``'s may part where the top two logits are within bf16 noise. Every divergence is
    reported with its token and top-2 gap, and must be such a near-tie."""
    from tests.embedded_assets import smollm2_gguf_available

    spec = "default" if smollm2_gguf_available() else "random:smollm2-135m"
    target = load_target(spec, device="cuda", dtype=torch.bfloat16)
    settings = _settings(target, max_new_tokens=64)
    options = EngineOptions(batch_size=16, kv_tokens=None, max_batch_tokens=1024, max_prompt_tokens=256)
    text = ["Explain photosynthesis.", "Write a haiku about rain.", "What is 17 * 23?", "Name three rivers."]
    prompts = [
        render_prompt(target.tokenizer, [{"role": "user", "content": t * (1 + i % 3)}])
        for i, t in enumerate(text * 8)
    ]
    got = _answer_all(SlotEngine(target.model, settings, options), prompts)
    report = []
    for i, prompt in enumerate(prompts):
        ref = _as_answer(generate_greedy(target.model, prompt, 64, settings.stop_ids), settings.stop_ids)
        a, b = list(got[f"p{i}"].token_ids), list(ref.token_ids)
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
        f"(prompt, token index, engine token, generate token, top-2 logit gap): {report}"
    )
    assert all(gap < 0.5 for *_, gap in report), report
