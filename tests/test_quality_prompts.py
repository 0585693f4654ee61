"""The quality run's prompt files: code problems made from installed Python code, and the prompt file the
harness builds when they join the chat records. The chat records must keep their sample ids there (a
record's sample id hashes its source's name), or regenerate would answer again every conversation kept
from the runs before."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import sys
from collections import Counter
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


def test_a_code_set_after_another_holds_none_of_its_problems_or_docstrings(tmp_path: Path) -> None:
    stage = _bench_module("quality_prompts")
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
