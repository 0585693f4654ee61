"""The sampled answers kept in ``bench/answers/`` (README there) answer again conversations that the greedy
files already hold, and nothing else: the same record ids and the same human turns, less those a record
says it dropped (so the same decontaminated prompts, and no held-out record), each file at its own seed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

ANSWERS = Path(__file__).resolve().parents[2] / "bench" / "answers"
GREEDY = ("answers-00", "extra-answers-code-1", "code-answers-2", "sources-answers-3")
HELD_OUT_FROM = 16_000
"""ShareGPT records from this index of the prompt file on are held out for eval (the quality recipe's
--regen-limit 16000; bench/RESULTS.md's eval commands skip them): no sampled answer may train on one."""


def _records(name: str) -> list[dict[str, Any]]:
    with gzip.open(ANSWERS / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _turns(record: dict[str, Any]) -> tuple[list[str], int]:
    """The human turns of a record, and its answers (one a group of consecutive human turns)."""
    messages = record["messages"]
    return [m["content"] for m in messages if m["role"] != "assistant"], sum(
        m["role"] == "assistant" for m in messages
    )


def test_the_sampled_answers_answer_the_greedy_files_conversations_again_at_their_own_seed() -> None:
    # Two kept code problems share an id (a property's getter and setter in code-answers-2, written before
    # bench/quality_prompts.py gave the second a "#2"), so an id maps to every greedy record that has it.
    greedy: dict[str, list[tuple[list[str], int]]] = {}
    for name in GREEDY:
        for r in _records(name):
            greedy.setdefault(r["id"], []).append(_turns(r))
    held_out = {r["id"] for r in _records("answers-00") if r["source_index"] >= HELD_OUT_FROM}
    assert len(held_out) > 500  # answers-00 answers every record of the file, the held-out ones too
    sampled = sorted(p.name.removesuffix(".jsonl.gz") for p in ANSWERS.glob("sampled-answers-*.jsonl.gz"))
    assert sampled, "no sampled answers in bench/answers"
    for name in sampled:
        seed = int(name.rpartition("seed")[2])
        records = _records(name)
        conversations = [(r["id"], _turns(r)[0][0]) for r in records]
        assert len(set(conversations)) == len(conversations), name  # each conversation once a file
        # One sampler a file (a record naming none was drawn by the first one, Gumbel-max): regenerate
        # refuses to extend a file by another sampler, whose answers for the same seed differ.
        samplers = {r["regenerated_by"].get("sampler", "gumbel-max") for r in records}
        assert len(samplers) == 1, (name, samplers)
        for r in records:
            key = (name, r["id"])
            assert r["id"] in greedy, key
            assert r["id"] not in held_out, key
            human, answers = _turns(r)
            # A longer sampled answer can make a later turn's prompt outgrow --max-prompt-tokens: that turn
            # and those after it are dropped, and the record counts them (one a group of human turns).
            assert any(
                human == greedy_human[: len(human)] and answers + r["dropped_turns"] == greedy_answers
                for greedy_human, greedy_answers in greedy[r["id"]]
            ), key
            assert answers > 0, key
            by = r["regenerated_by"]
            assert (by["target"], by["seed"], by["max_new_tokens"]) == ("default", seed, 256), key
            assert by["temperature"] > 0, key
            lengths = [len(m["token_ids"]) for m in r["messages"] if m["role"] == "assistant"]
            assert all(0 < n <= 256 for n in lengths), key
