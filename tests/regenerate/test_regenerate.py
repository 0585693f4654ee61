"""``dflash regenerate``: answers are the target's own greedy decode, the output feeds the generate reader,
a rerun resumes (partial last line included, and after a real SIGKILL), failures are reported."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from bench.regenerate_variants import parse_throughput
from dflash_offline.cli import main
from dflash_offline.data.conversations import Conversation, Message
from dflash_offline.data.sources import iter_records
from dflash_offline.data.user_groups import user_groups
from dflash_offline.decode.sampling import SAMPLER
from dflash_offline.errors import ConfigError, DataError
from dflash_offline.locking import acquire_lock_beside
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.engine_protocol import EngineStats, Finished, sum_stats
from dflash_offline.regenerate.generation import GeneratedTokens
from dflash_offline.regenerate.jsonl_out import ResumableJsonl
from dflash_offline.regenerate.run import render_prompt, run_regenerate
from dflash_offline.regenerate.slot_engine import SlotEngine
from dflash_offline.target_model.loader import LoadedTarget, load_target, stop_token_ids
from tests.eval.helpers import conversations, one_thread, write_chat_jsonl
from tests.oracles.reference_decode import TargetCaller, target_only_decode


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu")


def _config(out: Path, data: Path, **kw: Any) -> RegenerateConfig:
    values: dict[str, Any] = {
        "target": "random:tiny",
        "max_new_tokens": 12,
        "batch_size": 3,
        "progress": False,
    }
    values.update(kw)
    return RegenerateConfig(out=out, data=str(data), **values)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _m(role: str, content: str) -> Message:
    return Message(role=role, content=content)  # type: ignore[arg-type]


def test_user_groups() -> None:
    s, u1, u2, a = _m("system", "s"), _m("user", "u1"), _m("user", "u2"), _m("assistant", "a")
    assert user_groups((s, u1, a, u2, a)) == [(s, u1), (u2,)]
    assert user_groups((u1, u2, a)) == [(u1, u2)]  # a run of user turns: one answer
    assert user_groups((u1,)) == [(u1,)]  # prompts only: answered
    assert user_groups((u1, a, u2)) == [(u1,), (u2,)]  # a trailing user turn is answered too
    assert user_groups((a, u1, a)) == [(u1,)]  # an assistant turn without a prompt is dropped
    assert user_groups((s, a, u1, a)) == [(s, u1)]  # ... and the system turn carries over
    assert user_groups((u1, a, s)) == [(u1,)]  # a system turn after the last user turn: dropped
    assert user_groups((s, a)) == []


def test_answers_are_the_targets_greedy_decode(tmp_path: Path, tiny: LoadedTarget) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 5, turns=2)
    out = tmp_path / "regen.jsonl"
    summary = run_regenerate(_config(out, data))
    assert (summary.written, summary.failed, summary.skipped, summary.answers) == (5, 0, 0, 10)
    assert summary.engine == "slots"  # --engine auto: the decode engine
    lines = _lines(out)
    convs = {c.sample_id: c for c in conversations(data)}
    caller, stop = TargetCaller(tiny.model), stop_token_ids(tiny.tokenizer, tiny.model)
    for line in lines:
        original = convs[line["source_sample_id"]]
        assert line["id"] == original.record_id
        messages = line["messages"]
        kept = [{"role": m.role, "content": m.content} for m in original.messages if m.role != "assistant"]
        assert [m for m in messages if m["role"] != "assistant"] == kept
        assert [m["role"] for m in messages][-4:] == ["user", "assistant", "user", "assistant"]
        # Each answer is the greedy continuation of the conversation so far, the target's own earlier
        # answers included (independent reference: the eval's KV-cache greedy loop, batch 1, no padding).
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            ref = target_only_decode(
                caller, render_prompt(tiny.tokenizer, messages[:k]), max_new_tokens=12, stop_ids=stop
            )
            tokens = [t for t in ref.tokens if t not in stop]
            assert m["content"] == tiny.tokenizer.decode(tokens, skip_special_tokens=False)
        assert line["finish_reasons"] == ["length", "length"]  # random weights never say <|im_end|> this soon
        assert line["regenerated_by"]["target"] == "random:tiny"
    # generate's reader takes the output as it is.
    parsed = [c for c in iter_records(out) if isinstance(c, Conversation)]
    assert [c.record_id for c in parsed] == [line["id"] for line in lines]


def test_the_throughput_line_says_what_the_engine_steps_did(tmp_path: Path, tiny: LoadedTarget) -> None:
    """One slot, 5 conversations of 2 turns, 12 new tokens per answer (random weights never stop this soon):
    a turn is prefilled in one forward that also gives its first token (a step whose decode has no row:
    the slot decodes from the next step), then 11 decode steps give the rest, and the next turn (a
    conversation's next, or another's first, already waiting) takes the slot at the step after its last.
    So 10 × 12 steps, the slot decoding in 110 of them, 10 prefill forwards, and each turn's prompt
    (rendered here from the output) either prefilled or found in the slot its conversation's previous
    turn kept (the CPU keeps it: ``slot_engine.reuses_kv``)."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 5, turns=2)
    out = tmp_path / "regen.jsonl"
    result = CliRunner().invoke(
        main, ["regenerate", "--target", "random:tiny", "--data", str(data), "--out", str(out),
               "--max-new-tokens", "12", "--batch-size", "1", "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = _lines(out)
    assert {r for line in lines for r in line["finish_reasons"]} == {"length"}
    prompts = [
        render_prompt(tiny.tokenizer, line["messages"][:k])
        for line in lines
        for k, m in enumerate(line["messages"])
        if m["role"] == "assistant"
    ]
    assert len(prompts) == 10
    (throughput,) = [line for line in result.output.splitlines() if "throughput:" in line]
    engine = re.search(
        r"; engine: 120 steps decoding a mean 0\.9 of 1 slots \(92 % busy\) in [0-9.]+ s, 10 prefill "
        r"forwards of ([0-9,]+) prompt tokens \(([0-9,]+) reused, 0 kept slots evicted\)$",
        throughput,
    )
    assert engine is not None, throughput
    prefilled, reused = (int(n.replace(",", "")) for n in engine.groups())
    assert prefilled + reused == sum(len(p) for p in prompts)
    assert reused > 0  # the second turns continue the first's slot
    # The start-up, and the worker's share of it (loading the target, building the engine), within it.
    timing = re.search(
        r"\(([0-9.]+) s in all: ([0-9.]+) s of start-up, ([0-9.]+) s of it loading the target and building "
        r"the engine; engine slots, 1 worker\(s\)\)",
        throughput,
    )
    assert timing is not None, throughput
    total, startup, load = (float(g) for g in timing.groups())
    assert 0 <= load <= startup < total  # the phrase itself is printed only for a load time above 0
    # bench/regenerate_variants.py reads the same line for its side by sides.
    figures = parse_throughput(result.output)
    assert figures is not None, throughput
    assert (figures["conversations"], figures["new_tokens"], figures["steps"]) == (5, 120, 120)
    assert figures["mean_decoding_slots"] == 0.9


def _regenerate_two_turns(tmp_path: Path, data: Path, *flags: str) -> tuple[list[Any], str]:
    """The conversations ``regenerate`` writes from ``data`` with ``flags`` (sorted by id), and its output."""
    out = tmp_path / f"regen{'-'.join(flags)}.jsonl"
    result = CliRunner().invoke(
        main, ["regenerate", "--target", "random:tiny", "--data", str(data), "--out", str(out),
               "--max-new-tokens", "10", "--batch-size", "3", *flags, "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return sorted((line["id"], line["messages"]) for line in _lines(out)), result.output


def test_prefill_graphs_on_answers_as_off(tmp_path: Path) -> None:
    """``--prefill-graphs on`` (new prompts prefilled at padded static shapes: CUDA graphs on a GPU, the
    same forwards eagerly here) writes the same conversations as the default."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6, turns=2)
    outputs = {
        mode: _regenerate_two_turns(tmp_path, data, "--prefill-graphs", mode)[0] for mode in ("off", "on")
    }
    assert len(outputs["on"]) == 6
    assert outputs["on"] == outputs["off"]


def test_reuse_kv_off_prefills_every_prompt_whole_and_answers_the_same(tmp_path: Path) -> None:
    """``--reuse-kv on`` (the CPU's auto) continues each conversation's slot: its second turns prefill only
    what they add; ``off`` prefills every prompt whole. The conversations written are the same, and the
    prompt tokens the two prefill and reuse add up to the same total."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 6, turns=2)
    outputs, counts = {}, {}
    for mode in ("on", "off", "auto"):
        outputs[mode], text = _regenerate_two_turns(tmp_path, data, "--reuse-kv", mode)
        found = re.search(r"of ([0-9,]+) prompt tokens \(([0-9,]+) reused", text)
        assert found is not None, text
        counts[mode] = tuple(int(g.replace(",", "")) for g in found.groups())
    assert len(outputs["on"]) == 6
    assert outputs["on"] == outputs["off"] == outputs["auto"]
    (on_prefilled, on_reused), (off_prefilled, off_reused) = counts["on"], counts["off"]
    assert off_reused == 0 < on_reused
    assert on_prefilled + on_reused == off_prefilled
    assert counts["auto"] == counts["on"]


def test_the_workers_engine_stats_sum() -> None:
    """Counts add up; the busy share and the seconds are over all workers' steps (per worker)."""
    a = EngineStats(slots=3, steps=10, slot_steps=30, decoded_tokens=20, prefills=4, prefill_tokens=100,
                    reused_tokens=7, evictions=1, step_seconds=2.0)  # fmt: skip
    b = EngineStats(slots=3, steps=5, slot_steps=15, decoded_tokens=15, prefills=2, prefill_tokens=50,
                    reused_tokens=0, evictions=0, step_seconds=4.0)  # fmt: skip
    total = sum_stats([a, b])
    assert total == EngineStats(
        engines=2, slots=6, steps=15, slot_steps=45, decoded_tokens=35, prefills=6, prefill_tokens=150,
        reused_tokens=7, evictions=1, step_seconds=6.0,
    )  # fmt: skip
    assert total.describe() == (
        "15 steps decoding a mean 2.3 of 3 slots (78 % busy) in 3.0 s per worker, 6 prefill forwards of 150 "
        "prompt tokens (7 reused, 1 kept slots evicted)"
    )
    assert sum_stats([None, None]) is None  # server engines report none


def test_resume_after_a_partial_last_line(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 7)
    out = tmp_path / "regen.jsonl"
    first = run_regenerate(_config(out, data, limit=4))
    assert first.written == 4
    complete = out.read_text()
    partial = json.dumps(_lines(out)[-1])[:37]  # a kill in the middle of writing a fifth line
    with open(out, "a") as f:
        f.write(partial)
    second = run_regenerate(_config(out, data))
    assert (second.written, second.skipped, second.failed) == (3, 4, 0)
    assert second.repaired_bytes == len(partial)
    text = out.read_text()
    assert text.startswith(complete)
    assert text.endswith("\n")
    ids = [line["source_sample_id"] for line in _lines(out)]
    assert sorted(ids) == sorted(c.sample_id for c in conversations(data))  # none missing, none twice
    third = run_regenerate(_config(out, data))
    assert (third.written, third.skipped) == (0, 7)


def test_a_resume_with_another_answer_length_is_refused_naming_both(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)
    out = tmp_path / "regen.jsonl"
    first = run_regenerate(_config(out, data, limit=2))
    assert first is not None
    assert first.written == 2
    before = out.read_bytes()
    result = CliRunner().invoke(
        main, ["regenerate", "--target", "random:tiny", "--data", str(data), "--out", str(out),
               "--max-new-tokens", "20", "--batch-size", "3", "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: --max-new-tokens 20 differs from the --max-new-tokens 12 that wrote {out}: resume with "
        "--max-new-tokens 12, or write to another --out"
    ]
    assert out.read_bytes() == before  # nothing appended
    # A part left by a killed multi-worker run is checked as well.
    out2 = tmp_path / "other.jsonl"
    parts = out2.with_name(out2.name + ".parts")
    parts.mkdir()
    (parts / "w1.jsonl").write_bytes(before)
    # Through the Python API the message names the config field.
    api = r"`RegenerateConfig.max_new_tokens` 20 differs from the `RegenerateConfig.max_new_tokens` 12"
    with pytest.raises(ConfigError, match=api):
        run_regenerate(_config(out2, data, max_new_tokens=20))


def test_a_sampled_resume_with_another_seed_or_top_p_is_refused_and_a_greedy_one_is_not(
    tmp_path: Path,
) -> None:
    """A sampled file resumed with another seed or nucleus would hold two samplings under one name; a greedy
    answer depends on neither, so a greedy resume may name any seed."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)
    out = tmp_path / "sampled.jsonl"
    first = run_regenerate(_config(out, data, limit=2, temperature=0.8, top_p=0.9, seed=1))
    assert first is not None
    recorded = _lines(out)[0]["regenerated_by"]
    assert (recorded["temperature"], recorded["top_p"], recorded["seed"]) == (0.8, 0.9, 1)
    before = out.read_bytes()
    for flag, value, wrote in (("--seed", "2", "1"), ("--top-p", "0.95", "0.9")):
        result = CliRunner().invoke(
            main, ["regenerate", "--target", "random:tiny", "--data", str(data), "--out", str(out),
                   "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--seed", "1",
                   flag, value, "--batch-size", "3", "--no-progress"],
        )  # fmt: skip
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines() == [
            f"Error: {flag} {value} differs from the {flag} {wrote} that wrote {out}: "
            f"resume with {flag} {wrote}, or write to another --out"
        ]
        assert out.read_bytes() == before  # nothing appended
    # The same sampling resumes it.
    second = run_regenerate(_config(out, data, temperature=0.8, top_p=0.9, seed=1))
    assert second is not None
    assert (second.written, second.skipped) == (2, 2)
    # Greedy: another seed (or top-p) chooses the same answers, and the resume goes on.
    greedy = tmp_path / "greedy.jsonl"
    assert run_regenerate(_config(greedy, data, limit=2)) is not None
    resumed = run_regenerate(_config(greedy, data, seed=5, top_p=0.5))
    assert resumed is not None
    assert (resumed.written, resumed.skipped) == (2, 2)


def test_a_sampled_file_of_the_earlier_sampling_algorithm_is_not_extended(tmp_path: Path) -> None:
    """Answers drawn by the Gumbel-max sampler (files written before answers recorded their sampler) and
    answers drawn by today's for the same seed differ: extending such a file would mix two samplings."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)
    out = tmp_path / "sampled.jsonl"
    assert run_regenerate(_config(out, data, limit=2, temperature=0.8, top_p=0.9, seed=1)) is not None
    lines = _lines(out)
    assert {line["regenerated_by"]["sampler"] for line in lines} == {SAMPLER}
    for line in lines:  # as the files written before the field was recorded
        del line["regenerated_by"]["sampler"]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = out.read_bytes()
    result = CliRunner().invoke(
        main, ["regenerate", "--target", "random:tiny", "--data", str(data), "--out", str(out),
               "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--seed", "1",
               "--batch-size", "3", "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: {out} was sampled by the gumbel-max sampler and this version samples by {SAMPLER}: its seed "
        "would draw other answers here; write to another --out"
    ]
    assert out.read_bytes() == before
    # A greedy file of that age resumes: greedy answers depend on no sampler.
    greedy = tmp_path / "greedy.jsonl"
    assert run_regenerate(_config(greedy, data, limit=2)) is not None
    old = _lines(greedy)
    for line in old:
        del line["regenerated_by"]["sampler"]
    greedy.write_text("".join(json.dumps(line) + "\n" for line in old))
    resumed = run_regenerate(_config(greedy, data))
    assert resumed is not None
    assert (resumed.written, resumed.skipped) == (2, 2)


def test_a_resume_by_another_target_is_refused_before_it_loads(tmp_path: Path) -> None:
    """Answers of two targets in one data set would train a drafter on a mix without a word: the target
    recorded in the output's first line must be the one resuming it (the answers in progress too)."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 4)
    out = tmp_path / "regen.jsonl"
    first = run_regenerate(_config(out, data, limit=2))
    assert first is not None
    assert _lines(out)[0]["regenerated_by"]["target"] == "random:tiny"
    before = out.read_bytes()
    with pytest.raises(ConfigError) as refused:
        run_regenerate(_config(out, data, target="random:tiny-llama"))
    assert str(refused.value) == (
        "`RegenerateConfig.target` random:tiny-llama (target random:tiny-llama) is not the target "
        f"random:tiny that wrote {out}: resume with that target, or write to another `RegenerateConfig.out`"
    )
    assert out.read_bytes() == before  # nothing appended
    # Only the conversations in progress were written (a run stopped early): they are checked as well.
    out2 = tmp_path / "only-partial.jsonl"
    partial = out2.with_name(out2.name + ".partial")
    partial.write_text(json.dumps({"regenerated_by": _lines(out)[0]["regenerated_by"]}) + "\n")
    with pytest.raises(ConfigError, match="is not the target random:tiny that wrote"):
        run_regenerate(_config(out2, data, target="random:tiny-llama"))
    # The same target resumes.
    second = run_regenerate(_config(out, data))
    assert second is not None
    assert (second.written, second.skipped) == (2, 2)


def test_a_second_run_on_one_out_is_refused_in_one_line(tmp_path: Path) -> None:
    """Two runs appending to one output would write conversations twice: the second is refused, naming
    the first's pid, before it writes anything."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 3)
    out = tmp_path / "out.jsonl"
    holder = "dflash regenerate --out out.jsonl (the first run)"
    with acquire_lock_beside(out, what="regenerate output", why="a test", command=holder):
        result = CliRunner().invoke(
            main,
            ["regenerate", "--target", "random:tiny", "--data", str(data), "--max-new-tokens", "4",
             "--no-progress", "--out", str(out)],
        )  # fmt: skip
    assert result.exit_code == 1, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert f"regenerate output {out} is in use by pid {os.getpid()}" in error
    assert holder in error
    assert not out.exists()
    assert "Traceback" not in result.output


def test_a_foreign_output_file_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "regen.jsonl"
    out.write_text('{"id": 1}\n')
    with pytest.raises(DataError, match="source_sample_id"):
        ResumableJsonl(out, key="source_sample_id")
    out.write_text("not json\n{}\n")
    with pytest.raises(DataError, match="not valid JSON"):
        ResumableJsonl(out, key="source_sample_id")
    with pytest.raises(ConfigError, match=r"\.jsonl"):
        _config(tmp_path / "x.json", out)


def test_failures_are_reported_and_skipped_on_rerun(
    tmp_path: Path, tiny: LoadedTarget, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "chat.jsonl"
    records = [
        {"id": "ok", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "no-user", "messages": [{"role": "assistant", "content": "hi"}]},
        {"id": "bad", "messages": [{"role": "robot", "content": "x"}]},
        {"id": "long", "messages": [{"role": "user", "content": "word " * 300}]},
        {"id": "empty", "messages": [{"role": "user", "content": "say nothing"}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    # The target answers "say nothing" with its end-of-turn token at once.
    real_submit, real_poll, silent_keys = SlotEngine.submit, SlotEngine.poll, set()

    def submit(engine: SlotEngine, key: str, prompt: Any, **hints: Any) -> None:
        if "say nothing" in tiny.tokenizer.decode(prompt):
            silent_keys.add(key)
        real_submit(engine, key, prompt, **hints)

    def poll(engine: SlotEngine, timeout: float) -> list[Finished]:
        silent = GeneratedTokens(token_ids=(), finish_reason="stop")
        return [replace(f, tokens=silent) if f.key in silent_keys else f for f in real_poll(engine, timeout)]

    monkeypatch.setattr(SlotEngine, "submit", submit)
    monkeypatch.setattr(SlotEngine, "poll", poll)
    out = tmp_path / "regen.jsonl"
    summary = run_regenerate(_config(out, data, max_prompt_tokens=100, batch_size=8))
    assert (summary.written, summary.failed) == (1, 4)
    failures = {
        f["record_id"] or f["source_index"]: f["reason"] for f in _lines(tmp_path / "regen.failures.jsonl")
    }
    assert failures == {
        "no-user": "empty_conversation",
        2: "unknown_role",
        "long": "too_long",
        "empty": "empty_response",
    }
    err = capsys.readouterr().err
    assert "too_long" in err
    assert "empty_response" in err
    assert [line["id"] for line in _lines(out)] == ["ok"]
    again = run_regenerate(_config(out, data, max_prompt_tokens=100))
    assert (again.written, again.failed, again.skipped) == (0, 0, 5)


def test_many_failures_print_ten_lines_and_list_every_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hundreds of over-long prompts must not bury the run's other lines: the first 10 failures are
    printed, then one line; the failures file lists all of them and the summary counts them."""
    data = tmp_path / "chat.jsonl"
    long = [{"role": "user", "content": "word " * 300}]
    records = [{"id": f"long{i}", "messages": long} for i in range(14)]
    records.append({"id": "ok", "messages": [{"role": "user", "content": "hello"}]})
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "regen.jsonl"
    summary = run_regenerate(_config(out, data, max_prompt_tokens=100, batch_size=4))
    assert (summary.written, summary.failed) == (1, 14)
    listed = _lines(tmp_path / "regen.failures.jsonl")
    assert sorted(f["record_id"] for f in listed) == sorted(f"long{i}" for i in range(14))
    err = capsys.readouterr().err.splitlines()
    printed = [line for line in err if "failed: too_long" in line]
    assert len(printed) == 10
    assert [line for line in err if "more records fail" in line] == [
        "regenerate: more records fail; the first 10 were printed, the end of the run counts them all and "
        "names the failures file that lists each with its reason"
    ]


def test_sampling_is_seeded(tmp_path: Path) -> None:
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 3)
    texts = []
    for name, kw in (
        ("a", {"temperature": 1.0, "seed": 3}),
        ("b", {"temperature": 1.0, "seed": 3}),
        ("c", {}),
    ):
        run_regenerate(_config(tmp_path / f"{name}.jsonl", data, **kw))
        texts.append([line["messages"] for line in _lines(tmp_path / f"{name}.jsonl")])
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_cli_and_sigkill_resume(tmp_path: Path) -> None:
    """A real process killed with SIGKILL mid-run; the rerun completes the file without loss or repeats,
    equal to an uninterrupted run."""
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 24, turns=2)
    args = ["regenerate", "--target", "random:tiny", "--data", str(data), "--max-new-tokens", "24",
            "--batch-size", "2", "--no-progress"]  # fmt: skip
    reference = tmp_path / "reference.jsonl"
    result = CliRunner().invoke(main, [*args, "--out", str(reference)])
    assert result.exit_code == 0, result.output
    assert "24 conversations written" in result.output

    out = tmp_path / "killed.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_offline", *args, "--out", str(out)], env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 3:
                break
            time.sleep(0.02)
        if proc.poll() is not None:
            pytest.fail("the run finished before it could be killed; make it longer")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    done_before = out.read_text().count("\n")
    assert 3 <= done_before < 24
    result = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    killed = {line["source_sample_id"]: line["messages"] for line in _lines(out)}
    expected = {line["source_sample_id"]: line["messages"] for line in _lines(reference)}
    assert len(_lines(out)) == 24
    assert killed == expected


def test_the_bar_shows_a_ready_worker_before_its_first_answer(capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_offline.regenerate.run import RegenerateProgress
    from dflash_offline.regenerate.worker import WorkerReady

    progress = RegenerateProgress(enabled=True, total=4, num_workers=1)
    try:
        assert "0/1 workers ready" in capsys.readouterr().err
        progress.ready(WorkerReady(worker=0, device="cpu", engine="slots", load_seconds=1.0))
        # No answer has finished yet (no progress event): the bar says the worker is ready all the same.
        assert "1/1 workers ready" in capsys.readouterr().err
    finally:
        progress.close()
