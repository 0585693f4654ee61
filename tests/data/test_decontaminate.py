"""Decontamination against the real MT-Bench and HumanEval files (installed here): planted records are
caught with the question's id, near misses are not, and ``dflash generate`` / ``regenerate`` record a
caught record as a ``contaminated`` failure (on by default, off with ``--no-decontaminate``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_offline.data.conversations import Conversation, Message, SourceFailure
from dflash_offline.data.decontaminate import Decontaminator, screen_records
from dflash_offline.data.question_sets import read_humaneval, read_mt_bench
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.context import RunContext
from dflash_offline.generate.feed import plan_events
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.regenerate.run import run_regenerate
from dflash_offline.target_model.loader import load_tokenizer
from tests.eval.helpers import tiny_fingerprint


@pytest.fixture(scope="module")
def decontaminator() -> Decontaminator:
    d, note = Decontaminator.from_installed()
    assert d is not None, note
    assert d.num_questions == 80 + 164
    return d


def _conv(*users: str, answer: str = "fine") -> Conversation:
    messages: list[Message] = []
    for u in users:
        messages += [Message(role="user", content=u), Message(role="assistant", content=answer)]
    return Conversation(sample_id="s", source_index=7, record_id="r", messages=tuple(messages))


def test_planted_questions_are_found_with_their_id(decontaminator: Decontaminator) -> None:
    humaneval_0 = read_humaneval()[0].texts[0]
    mt_81 = next(q for q in read_mt_bench() if q.question_id == "81")
    # A HumanEval problem pasted into a longer message, its layout and case changed.
    pasted = "Hi! Please help with my homework:\n" + " ".join(humaneval_0.upper().split()) + "\nThanks"
    hit = decontaminator.find(_conv("hello", pasted))
    assert hit is not None
    assert (hit.question, hit.turn) == ("humaneval HumanEval/0", 2)
    # MT-Bench 81's first turn, reworded at both ends: a 13-word run in the middle is left.
    inner = " ".join(mt_81.texts[0].split()[1:-1])
    hit = decontaminator.find(_conv(f"Please {inner}!"))
    assert hit is not None
    assert hit.question == "mt-bench 81 turn 1"
    # Its 11-word second turn, whole, inside other text.
    hit = decontaminator.find(_conv("ok", f"Now: {mt_81.texts[1]} Thanks."))
    assert hit is not None
    assert hit.question == "mt-bench 81 turn 2"
    # A 4-word follow-up counts only as the whole turn.
    hit = decontaminator.find(_conv("Can you parallelize it?"))
    assert hit is not None
    assert hit.question == "mt-bench 121 turn 2"
    assert decontaminator.find(_conv("Can you parallelize it? I mean the loop in my C code above")) is None
    # The record becomes a failure naming the question.
    failure = decontaminator.screen(_conv(pasted))
    assert isinstance(failure, SourceFailure)
    assert failure.reason == "contaminated"
    assert "humaneval HumanEval/0" in failure.detail


def test_near_misses_are_kept(decontaminator: Decontaminator) -> None:
    mt_81 = read_mt_bench()[0].texts[0].split()
    assert decontaminator.find(_conv(" ".join(mt_81[:12]))) is None  # 12 words: below the n-gram
    assert (
        decontaminator.find(_conv("Convert 0 1 2 3 4 5 6 7 8 9 A B C D E F to binary")) is None
    )  # HumanEval/78
    assert decontaminator.find(_conv("hi", answer=read_humaneval()[3].texts[0])) is None  # answers not read
    clean = _conv("What is the capital of France?")
    assert decontaminator.screen(clean) is clean
    items = [clean, _conv("Can you parallelize it?")]
    screened = list(screen_records(items, decontaminator, checked=lambda _s: True))
    assert screened[0] is clean
    assert isinstance(screened[1], SourceFailure)
    assert list(screen_records(items, decontaminator, checked=lambda _s: False)) == items
    assert list(screen_records(items, None)) == items


def _data(path: Path) -> Path:
    """Three records; the second asks MT-Bench 121's follow-up."""
    rows = [
        [{"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": "Write a loop"}, {"role": "assistant", "content": "for"},
         {"role": "user", "content": "Can you parallelize it?"}, {"role": "assistant", "content": "yes"}],
        [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "red"}],
    ]  # fmt: skip
    path.write_text("".join(json.dumps({"id": f"rec-{i}", "messages": m}) + "\n" for i, m in enumerate(rows)))
    return path


@pytest.mark.parametrize("on", [True, False])
def test_generate_plans_a_contaminated_record_as_a_failure(tmp_path: Path, on: bool) -> None:
    config = GenerateConfig(
        cache_dir=tmp_path / "cache", target="random:tiny", data=_data(tmp_path / "d.jsonl")
    )
    ctx = RunContext(
        config=GenerateConfig(
            **{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "decontaminate": on}
        ),
        fingerprint=tiny_fingerprint(data_source="d"),
        tokenizer=load_tokenizer("random:tiny"),
        pad_id=0,
        done_ids=frozenset(),
        run_id="r",
        session="s",
    )
    events = list(plan_events(ctx))
    failures = [f for e in events for f in e.failures]
    planned = [s.sample_id for e in events if e.job is not None for s in e.job.samples]
    if on:
        assert [(f.reason, f.source_index) for f in failures] == [("contaminated", 1)]
        assert "mt-bench 121 turn 2" in failures[0].detail
        assert len(planned) == 2
    else:
        assert failures == []
        assert len(planned) == 3


def test_regenerate_records_a_contaminated_record_as_a_failure(tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    summary = run_regenerate(
        RegenerateConfig(
            target="random:tiny", data=str(_data(tmp_path / "d.jsonl")), out=out, max_new_tokens=2,
            progress=False,
        )
    )  # fmt: skip
    assert summary is not None
    assert (summary.written, summary.failed) == (2, 1)
    failures = [json.loads(line) for line in (tmp_path / "answers.failures.jsonl").read_text().splitlines()]
    assert [(f["reason"], f["source_index"]) for f in failures] == [("contaminated", 1)]
    assert "mt-bench 121 turn 2" in failures[0]["detail"]
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["rec-0", "rec-2"]
