"""The quality run's prompt files: code problems made from installed Python code, and the prompt file the
harness builds when they join the chat records. The chat records must keep their sample ids there (a
record's sample id hashes its source's name), or regenerate would answer again every conversation kept
from the runs before."""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_offline.data.conversations import Conversation
from dflash_offline.data.sources import iter_records
from tests.eval.helpers import write_chat_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _bench_module(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _write_code(path: Path, n: int) -> Path:
    with gzip.open(path, "wt") as f:
        for i in range(n):
            turns = [
                {"from": "human", "value": f"def f{i}():\n    '''Return {i}.'''"},
                {"from": "gpt", "value": "."},
            ]
            f.write(json.dumps({"id": f"code-m.f{i}", "conversations": turns}) + "\n")
    return path


def test_chat_records_keep_their_sample_ids_in_the_combined_prompt_file(tmp_path: Path) -> None:
    quality = _bench_module("quality_recipe")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 10, turns=2)
    code = _write_code(tmp_path / "code-prompts.jsonl.gz", 5)
    combined = tmp_path / "prompts" / "chat.jsonl"
    combined.parent.mkdir()
    assert quality.combine_prompts(data, 3, 4, code, 2, combined) == 2
    original = [c for c in iter_records(data) if isinstance(c, Conversation)]
    read = [c for c in iter_records(combined) if isinstance(c, Conversation)]
    # Records 3..6 of the chat file (what --skip 3 --limit 4 reads), same sample ids, then two code problems.
    assert [c.sample_id for c in read[:4]] == [c.sample_id for c in original[3:7]]
    assert [c.record_id for c in read[4:]] == ["code-m.f0", "code-m.f1"]
    # A code limit larger than the file takes what there is.
    assert quality.combine_prompts(data, 8, 100, code, 50, combined) == 5
    assert len([c for c in iter_records(combined) if isinstance(c, Conversation)]) == 2 + 5


def test_the_training_data_interleaves_its_files_in_proportion(tmp_path: Path) -> None:
    """Answers of this run and earlier ones (``--extra-answers``) are cached in one generate, which a deadline
    may stop: every prefix of the file it reads holds each part in proportion, each part in its order."""
    quality = _bench_module("quality_recipe")
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", 30, turns=2)
    code = _write_code(tmp_path / "code.jsonl.gz", 10)
    out = tmp_path / "train-data.jsonl"
    assert quality.concatenate_answers([chat, code], out) == 10
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    chat_ids = [c.record_id for c in iter_records(chat) if isinstance(c, Conversation)]
    assert sorted(ids) == sorted(chat_ids + [f"code-m.f{i}" for i in range(10)])  # each line once
    assert [i for i in ids if i.startswith("code-")] == [f"code-m.f{i}" for i in range(10)]
    assert [i for i in ids if not i.startswith("code-")] == chat_ids
    for n in (4, 8, 20, 40):  # a quarter of every prefix is code, give or take one line
        assert abs(sum(i.startswith("code-") for i in ids[:n]) - n / 4) <= 1, (n, ids[:n])


def test_a_files_code_answers_after_its_chat_are_interleaved_too(tmp_path: Path) -> None:
    """A regenerate's answers hold its code problems after the chat: they are spread like another file's."""
    quality = _bench_module("quality_recipe")
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", 30, turns=2)
    code = _write_code(tmp_path / "code.jsonl.gz", 10)
    answers = tmp_path / "answers.jsonl"
    answers.write_bytes(chat.read_bytes() + gzip.decompress(code.read_bytes()))
    out = tmp_path / "train-data.jsonl"
    assert quality.concatenate_answers([answers], out) == 0  # no file beside it
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(json.loads(line)["id"] for line in answers.read_text().splitlines())
    assert [i for i in ids if i.startswith("code-")] == [f"code-m.f{i}" for i in range(10)]
    for n in (4, 8, 20, 40):
        assert abs(sum(i.startswith("code-") for i in ids[:n]) - n / 4) <= 1, (n, ids[:n])


def test_code_problems_are_signatures_and_docstrings_of_public_functions(tmp_path: Path) -> None:
    stage = _bench_module("quality_prompts")
    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    (package / "mod.py").write_text(
        "import os\n\n"
        "@staticmethod\n"
        "def add(a: int, b: int = 2) -> int:\n"
        '    """Return the sum of a and b, which are two integers given by the caller."""\n'
        "    return a + b\n\n"
        "def _private(x):\n"
        '    """A private helper that is long enough to count as a documented function."""\n\n'
        "def short(x):\n"
        '    """Too short."""\n\n'
        "class Box:\n"
        "    def size(self):\n"
        '        """How many things the box holds, counted one by one from the first."""\n'
        "        return 0\n"
    )
    (package / "tests" / "test_mod.py").write_text(
        'def helper():\n    """A helper of the tests, long enough to count as a documented function."""\n'
    )
    problems = {name: problem for name, _, problem in stage.code_problems("pkg", package)}
    assert problems == {
        "pkg.mod.add": "def add(a: int, b: int = 2) -> int:\n"
        '    """Return the sum of a and b, which are two integers given by the caller."""',
        "pkg.mod.Box.size": "def size(self):\n"
        '    """How many things the box holds, counted one by one from the first."""',
    }
    for problem in problems.values():
        ast.parse(problem + "\n    pass\n")  # each problem is the head of a valid function


def test_staged_code_records_parse_as_one_turn_conversations_and_alternate_packages(tmp_path: Path) -> None:
    stage = _bench_module("quality_prompts")
    records = list(stage.code_records(("stdlib", "click")))
    assert records, "the standard library alone has thousands of documented functions"
    path = tmp_path / "code-prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:50]))
    read = [c for c in iter_records(path) if isinstance(c, Conversation)]
    assert len(read) == 50
    assert all([m.role for m in c.messages] == ["user", "assistant"] for c in read)
    assert all("```python\n" in c.messages[0].content for c in read)
    # The packages take turns: stdlib, click, stdlib, click, … while both last.
    assert [r["id"].split("-", 1)[1].split(".")[0] for r in records[:4]] == ["stdlib", "click"] * 2
    assert len({r["id"] for r in records}) == len(records)


def test_a_code_set_after_another_holds_none_of_its_problems_or_docstrings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage = _bench_module("quality_prompts")
    # Each package's files are parsed once for the whole test (the standard library's take seconds): the
    # problems of a package are a function of its files alone, and every call below asks for the same ones.
    parsed: dict[tuple[str, Path], list[tuple[str, str, str]]] = {}
    parse = stage.code_problems

    def parsed_once(name: str, root: Path) -> Iterator[tuple[str, str, str]]:
        if (name, root) not in parsed:
            parsed[name, root] = list(parse(name, root))
        return iter(parsed[name, root])

    monkeypatch.setattr(stage, "code_problems", parsed_once)
    first = list(stage.code_records(("stdlib", "click")))
    second = list(stage.code_records(("stdlib", "click", "jinja2"), after=("stdlib", "click")))
    assert second, "jinja2 has documented functions of its own"
    assert all(r["id"].startswith("code-jinja2.") for r in second)
    # Brute force: no docstring of the first set is in a problem of the second.
    docs = {
        doc
        for pkg, root in stage.code_roots(("stdlib", "click"))
        for _, doc, _ in stage.code_problems(pkg, root)
    }
    jinja = {f"code-{q}": doc for q, doc, _ in stage.code_problems(*stage.code_roots(("jinja2",))[0])}
    assert not any(jinja[r["id"].split("#")[0]] in docs for r in second)
    assert {r["id"] for r in first}.isdisjoint(r["id"] for r in second)
    # Without ``after`` the same jinja2 problems come, the duplicates of the first set's docstrings too.
    alone = list(stage.code_records(("jinja2",)))
    assert {r["id"] for r in second} <= {r["id"] for r in alone}


def test_a_function_named_as_a_humaneval_function_is_left_out_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage = _bench_module("quality_prompts")
    package = tmp_path / "algos"
    package.mkdir()
    (package / "__init__.py").write_text("")
    doc = '    """{what}, as the caller asks for it and explains in the arguments given."""\n'
    (package / "strings.py").write_text(
        "def is_palindrome(text):\n" + doc.format(what="Whether text reads the same both ways")
        + "def reverse_words(text):\n" + doc.format(what="The words of text in reverse order")
        + "class Stats:\n    def median(self, xs):\n" + "    " + doc.format(what="The middle value of xs")
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    names = stage.humaneval_function_names()
    assert {"is_palindrome", "median", "has_close_elements"} <= names
    assert len(names) == 158  # HumanEval's 164 problems ask for 158 distinct function names
    left_out: Counter[str] = Counter()
    records = list(stage.code_records(("algos",), banned_names=names, left_out=left_out))
    assert [r["id"] for r in records] == ["code-algos.strings.reverse_words"]
    assert left_out == Counter({"algos": 2})
    # Without the names, all three come.
    assert len(list(stage.code_records(("algos",)))) == 3


def test_package_groups_expand_each_package_once() -> None:
    stage = _bench_module("quality_prompts")
    assert stage.expand_packages("default")[:2] == ("stdlib", "numpy")
    assert stage.expand_packages("default,numpy,torch") == (*stage.expand_packages("default"), "torch")
    four = stage.expand_packages("code-4,torch")
    assert four[0] == "algorithms"
    assert four[-1] == "torch"
    assert len(four) == len(set(four)) == len(stage.CODE_4_PACKAGES) + 1
    assert stage.expand_packages("") == ()


def test_chatterbot_conversations_become_records_and_a_repeated_first_turn_is_left_out(
    tmp_path: Path,
) -> None:
    stage = _bench_module("quality_prompts")
    folder = tmp_path / "english"
    folder.mkdir()
    (folder / "ai.yml").write_text(
        "categories:\n- AI\nconversations:\n"
        "- - What is AI?\n  - Artificial intelligence.\n"
        "- - Hello there\n  - Hi\n  - How are you?\n  - Fine.\n  - Tell me a joke\n"
        "- - what is ai\n  - The same question in other case and punctuation.\n"
        "- - 42\n  - A number the YAML reader gives as an int.\n"
    )
    (folder / "coding.yml").write_text(
        "conversations:\n"
        "- - can you write a sorting algorithm?\n  - |\n    Sure:\n    ```\n    sorted(xs)\n    ```\n"
        "- - Hello there!\n  - Hi again\n"
    )
    (folder / "notes.txt").write_text("- - not a corpus file\n")
    records = list(stage.chatterbot_records(folder))
    dot = {"from": "gpt", "value": "."}

    def human(text: str) -> dict[str, str]:
        return {"from": "human", "value": text}

    assert records == [
        {"id": "chatterbot-ai-0", "conversations": [human("What is AI?"), dot]},
        {
            "id": "chatterbot-ai-1",
            "conversations": [
                human("Hello there"),
                dot,
                human("How are you?"),
                dot,
                human("Tell me a joke"),
                dot,
            ],
        },
        {"id": "chatterbot-ai-2", "conversations": [human("what is ai"), dot]},
        {"id": "chatterbot-ai-3", "conversations": [human("42"), dot]},
        {"id": "chatterbot-coding-0", "conversations": [human("can you write a sorting algorithm?"), dot]},
        {"id": "chatterbot-coding-1", "conversations": [human("Hello there!"), dot]},
    ]
    # A set written before (ShareGPT) asked "What is 42" first: nothing here repeats it. Its own repeats go.
    seen = {tuple(stage.normalised_words("What is 42?"))}
    left_out: Counter[str] = Counter()
    kept = list(stage.first_turns_unseen(records, seen, left_out, "chatterbot"))
    assert [r["id"] for r in kept] == [
        "chatterbot-ai-0",
        "chatterbot-ai-1",
        "chatterbot-ai-3",
        "chatterbot-coding-0",
    ]
    assert left_out == Counter({"chatterbot": 2})
    # A later set meets the first turns of both: "42" and "what is 42" are taken.
    later = [
        {"id": "m-1", "conversations": [human("42."), dot]},
        {"id": "m-2", "conversations": [human("43"), dot]},
    ]
    assert [r["id"] for r in stage.first_turns_unseen(later, seen, left_out, "math")] == ["m-2"]
    assert left_out["math"] == 1


class _Problem:
    def __init__(self, question: str, answer: str = "1") -> None:
        self.question, self.answer = question, answer


def test_math_records_take_distinct_short_questions_from_each_module_in_turn() -> None:
    stage = _bench_module("quality_prompts")
    calls: Counter[str] = Counter()

    def cycling(name: str, problems: list[_Problem | None]):  # type: ignore[no-untyped-def]
        def module() -> _Problem:
            problem = problems[calls[name] % len(problems)]
            calls[name] += 1
            if problem is None:
                raise AttributeError("module 'numpy' has no attribute 'object'")
            return problem

        return module

    too_long = "Is " + "9" * 157 + "?"
    assert len(too_long) == stage.MATH_LIMITS[0] + 1
    modules = {
        "algebra__solve": cycling(
            "algebra__solve",
            [
                _Problem("Solve x = 1."),
                _Problem("Solve x = 1."),
                _Problem(too_long),
                _Problem("Solve y = 2."),
            ],
        ),
        "broken": cycling("broken", [None]),
        "numbers__flaky": cycling(
            "numbers__flaky",
            [None, _Problem("Is 7 prime?"), _Problem("x", answer="1" * 31), _Problem("Is 9 prime?")],
        ),
        "same": cycling("same", [_Problem("What is 1 + 1?")]),
    }
    failed: Counter[str] = Counter()
    records = list(stage.math_records(modules, per_module=2, failed=failed))
    questions = [(r["id"].rsplit("-", 1)[0], r["conversations"][0]["value"]) for r in records]
    assert questions == [
        ("math-algebra__solve", "Solve x = 1."),
        ("math-numbers__flaky", "Is 7 prime?"),
        ("math-same", "What is 1 + 1?"),
        ("math-algebra__solve", "Solve y = 2."),
        ("math-numbers__flaky", "Is 9 prime?"),
    ]
    for record, (_, question) in zip(records, questions, strict=True):
        assert record["id"].rsplit("-", 1)[1] == hashlib.sha1(question.encode()).hexdigest()[:12]
        assert record["conversations"][1] == {"from": "gpt", "value": "."}
    # A module that only fails is given up after MATH_FAILED_TRIES calls; one that repeats itself after
    # 2 * per_module + MATH_FAILED_TRIES; the others once they have their questions.
    assert calls == Counter({"algebra__solve": 4, "broken": 20, "numbers__flaky": 4, "same": 24})
    assert failed == Counter({"broken": 20, "numbers__flaky": 1})


def test_math_records_from_the_installed_mathematics_dataset_package() -> None:
    stage = _bench_module("quality_prompts")
    modules = stage.math_modules()
    assert modules is not None, "the Makefile installs mathematics-dataset and six"
    assert len(modules) == 56
    first = list(stage.math_records(modules, per_module=2, seed=3))
    second = list(stage.math_records(modules, per_module=2, seed=3))
    per_module = Counter(r["id"].rsplit("-", 1)[0].removeprefix("math-") for r in first)
    assert set(per_module) <= set(modules)
    assert len(per_module) >= 40  # numpy 2 breaks calculus and most polynomial manipulation, not the rest
    assert len({r["id"] for r in first}) == len(first)
    assert all(0 < len(r["conversations"][0]["value"]) <= stage.MATH_LIMITS[0] for r in first)
    # The same seed, the same questions, but for the order of a composed question's "Let …" statements.
    assert Counter(r["id"].rsplit("-", 1)[0] for r in second) == Counter(
        r["id"].rsplit("-", 1)[0] for r in first
    )
    plain = [r for r in first if not r["id"].rsplit("-", 1)[0].endswith("_composed")]
    assert len(plain) >= 40
    assert [r for r in second if not r["id"].rsplit("-", 1)[0].endswith("_composed")] == plain
    # Another seed, other questions.
    other = list(stage.math_records(modules, per_module=2, seed=4))
    assert {r["id"] for r in other}.isdisjoint(r["id"] for r in plain)


def test_the_stage_writes_the_new_sets_decontaminated_and_without_repeats(tmp_path: Path) -> None:
    """The script end to end: ShareGPT, Chit-Chat and ChatterBot from small files, math from the package."""
    from dflash_offline.data.question_sets import read_mt_bench

    question = next(q for q in read_mt_bench() if q.question_id == "81").texts[0]
    sharegpt = tmp_path / "sharegpt.json"
    pairs = {"abcdefg_0": "Tell me a joke.", "abcdefh_0": "Who are you?"}
    sharegpt.write_text(
        json.dumps(
            [
                {
                    "id": key,
                    "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "Hm."}],
                }
                for key, text in pairs.items()
            ]
        )
    )
    chitchat = tmp_path / "chitchat.json"
    said = [[{"sender": "a", "text": "Hi! Do you like hiking?"}], [{"sender": "b", "text": "Yes."}]]
    said += [[{"sender": "a", "text": "Where do you go?"}], [{"sender": "b", "text": "Up."}]]
    chitchat.write_text(json.dumps({"c1": {"messages": said}}))
    folder = tmp_path / "english"
    folder.mkdir()
    (folder / "misc.yml").write_text(
        "conversations:\n"
        "- - tell me a JOKE\n  - Knock knock.\n"
        f"- - {json.dumps(question)}\n  - An MT-Bench question.\n"
        "- - What is your name?\n  - Bot.\n"
    )
    out = tmp_path / "prompts"
    counts = tmp_path / "counts.json"
    args = ["--out", str(out), "--sharegpt", str(sharegpt), "--chitchat", str(chitchat)]
    args += ["--chatterbot", str(folder), "--math-per-module", "1", "--no-code", "--json", str(counts)]
    script = str(ROOT / "bench" / "quality_prompts.py")
    done = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    rows = {r["set"]: r for r in json.loads(counts.read_text())}
    assert sorted(rows) == ["chatterbot", "chitchat", "math", "sharegpt"]
    assert rows["chatterbot"]["contaminated_left_out"] == 1
    assert rows["chatterbot"]["repeats_left_out"] == 1
    kept = [c for c in iter_records(out / "chatterbot-prompts.jsonl.gz") if isinstance(c, Conversation)]
    assert [(c.record_id, c.messages[0].content) for c in kept] == [
        ("chatterbot-misc-2", "What is your name?")
    ]
    math = [c for c in iter_records(out / "math-prompts.jsonl.gz") if isinstance(c, Conversation)]
    assert len(math) == rows["math"]["conversations"] >= 40
    assert all(
        c.record_id.startswith("math-") and [m.role for m in c.messages] == ["user", "assistant"]
        for c in math
    )
