"""Standard question sets for ``dflash eval --bench``: MT-Bench, HumanEval, held-out ShareGPT, validation.

The question files ship inside PyPI wheels and are read as package data (data/question_sets.py).

Prompts follow DFlash's own benchmark harness: a HumanEval problem becomes the user turn
"Write a solution to the following problem and make sure that it passes the tests:\\n```python\\n
{prompt}\\n```"; an MT-Bench question is asked turn by turn, turn 2 after the target's own greedy answer
to turn 1 (both turns are decoded and counted). ``sharegpt`` is the first user turn of held-out ShareGPT
conversations (see prompts.py; every user turn with ``--turns all``); ``validation`` the records the
drafter's training run held out (validation_set.py).

Selection with ``--limit N`` is fixed and needs no seed: N questions evenly spaced over the file,
indices ⌊i·total/N⌋ for i = 0..N−1 (all of them when N ≥ total). MT-Bench's file is ordered by
category, ten questions each, so any N ≥ 8 draws from all eight categories.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from dflash_offline.config_fields import LIMIT, field_ref
from dflash_offline.data.question_sets import (
    HUMANEVAL_FILE,
    MT_BENCH_FILE,
    PIP_INSTALL,
    package_file,
    read_humaneval,
    read_mt_bench,
)
from dflash_offline.errors import ConfigError

__all__ = ["HUMANEVAL_FILE", "MT_BENCH_FILE", "PIP_INSTALL", "package_file", "require_question_sets"]

BenchName = Literal["mt-bench", "humaneval", "sharegpt", "validation"]
BENCHES: tuple[BenchName, ...] = ("mt-bench", "humaneval", "sharegpt", "validation")
STANDARD_BENCHES: tuple[BenchName, ...] = ("mt-bench", "humaneval", "sharegpt")
"""The sets of ``--bench all``."""
BENCH = field_ref("EvalConfig", "bench")
"""How messages name the option (EvalConfig imports this module: it names the class)."""
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchQuestion:
    """One question of a standard set: its user turns, asked in order."""

    bench: BenchName
    question_id: str
    """MT-Bench ``question_id`` or HumanEval ``task_id``."""
    category: str
    """MT-Bench category; ``code`` for HumanEval."""
    turns: tuple[str, ...]
    """User turns, already formatted (HumanEval: the template above around the problem)."""


def evenly_spaced(items: Sequence[T], limit: int | None) -> list[T]:
    """``limit`` items at indices ⌊i·len/limit⌋ (all items when limit is None or ≥ len)."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit < 1:
        raise ConfigError(f"{field_ref(LIMIT)} must be >= 1, got {limit}")
    return [items[i * len(items) // limit] for i in range(limit)]


def load_mt_bench(limit: int | None = None) -> list[BenchQuestion]:
    """MT-Bench's questions (80, two turns each), ``limit`` of them evenly spaced."""
    questions = [
        BenchQuestion(bench="mt-bench", question_id=q.question_id, category=q.category, turns=q.texts)
        for q in read_mt_bench()
    ]
    return evenly_spaced(questions, limit)


def humaneval_user_turn(prompt: str) -> str:
    """The user turn DFlash's benchmark asks for a HumanEval problem."""
    return HUMANEVAL_TEMPLATE.format(prompt=prompt)


def load_humaneval(limit: int | None = None) -> list[BenchQuestion]:
    """HumanEval's 164 problems as one-turn questions, ``limit`` of them evenly spaced."""
    questions = [
        BenchQuestion(
            bench="humaneval",
            question_id=q.question_id,
            category=q.category,
            turns=(humaneval_user_turn(q.texts[0]),),
        )
        for q in read_humaneval()
    ]
    return evenly_spaced(questions, limit)


def require_question_sets(sets: Sequence[str]) -> None:
    """Raise now, with how to install it, for a package that a set of ``sets`` reads and that is missing: eval
    checks before loading its target, so that a missing package fails at once, not after the target's
    loading (bench/quality_recipe.py asks the same before its first stage)."""
    for name in sets:
        if name == "mt-bench":
            package_file(*MT_BENCH_FILE)
        elif name == "humaneval":
            package_file(*HUMANEVAL_FILE)


def parse_bench(value: str) -> tuple[BenchName, ...]:
    """``--bench`` value: set names separated by commas, in table order; ``all`` stands for the standard
    sets (mt-bench, humaneval, sharegpt)."""
    names: list[BenchName] = []
    for part in value.split(","):
        part = part.strip()
        found: tuple[BenchName, ...] = (
            STANDARD_BENCHES if part == "all" else tuple(b for b in BENCHES if b == part)
        )
        if not found:
            raise ConfigError(
                f"{BENCH} {value!r}: {part!r} is none of {[*BENCHES, 'all']} (names separated by commas)"
            )
        names += [b for b in found if b not in names]
    return tuple(names)
