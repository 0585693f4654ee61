"""Metrics of the repository around the package, for ``bench/house_metrics.py`` (read from files alone).

The product apart from the lab:

- lines of README.md, bench/RESULTS.md and docs/facts.md;
- bench scripts (``.py`` and ``.sh`` under ``bench/``) and their lines, split into those that serve a user
  (benchmarks, the quality recipe) and plumbing: a script is plumbing when its text names a way of
  moving files to or from a remote GPU machine (``PLUMBING``: wheel staging, parts, detached jobs
  followed call by call, a run's numbered sessions);
- tracked files that mention that plumbing (this file, which spells the patterns, and ``.gitignore``,
  which must name the ignored folders, are left out of both counts).

Training and its seams:

- ``.py`` files under ``dflash_offline/train/``, ``__init__.py`` left out;
- modules that call ``flag(`` (an option's CLI spelling, ``cli.flags.flag``: cli/ modules only);
- import edges eval → train and train → generate (module pairs, imports inside functions included);
- decode loops: functions with a ``for`` or ``while`` loop whose head names the new-token budget
  (``*new_tokens*``) or the stop check ``is_done``: a loop that produces an answer token after token;
- records between the index and the drafter: public dataclasses defined in ``DATA_PATH`` (the modules
  between the index snapshot and the drafter's input tensors) that carry samples: a field that is a tensor,
  an array or the sample ids, or a field typed with such a record (a plan of them, a snapshot of them).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

PACKAGE = "dflash_offline"
_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth"
    "|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
PLUMBING = re.compile(
    "|".join(
        (
            r"h200(?:_engine_ab|_quality_run)?\.sh",
            r"h200_quality\.py",
            r"drafter_parts",
            r"follow\.sh",
            r"/tmp/site",
            r"/tmp/stag[e]",
            r"\.device/",
            r"\.whl\b",
            r"device\s+time",
            rf"\b(?:{_ORDINALS}) session",
            r"next GPU (?:run|session)",
            r"staging calls?",
        )
    ),
    re.IGNORECASE,
)
"""Phrases that only GPU-machine plumbing uses."""
NOT_SCANNED = ("bench/repo_metrics.py", ".gitignore")
DATA_PATH = (
    "train/snapshot.py",
    "train/planner.py",
    "train/packing.py",
    "train/loader.py",
    "drafter/batch.py",
)
"""The modules (under the package) between the index snapshot and the drafter's input; a module that is
missing counts nothing."""
LOOP_HEAD = re.compile(r"new_tokens|\bis_done\b")
CARRIES = re.compile(r"\b(?:Tensor|ndarray)\b")


def tracked_files(root: Path) -> list[str]:
    """Paths tracked by git (the working tree's files where ``root`` is no git checkout)."""
    done = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=False)
    if done.returncode == 0:
        return sorted(p for p in done.stdout.decode().split("\0") if p)
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts
    )


def _text(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _lines(root: Path, rel: str) -> int:
    text = _text(root, rel)
    return 0 if text is None else text.count("\n")


def product_metrics(root: Path, files: list[str]) -> dict:
    """The issue-42 figures: document sizes, bench scripts by purpose, files mentioning the plumbing."""
    scripts = [f for f in files if f.startswith("bench/") and f.endswith((".py", ".sh"))]
    plumbing = [f for f in scripts if f not in NOT_SCANNED and PLUMBING.search(_text(root, f) or "")]
    mentions = [
        f
        for f in files
        if f not in NOT_SCANNED and not f.endswith(".gz") and PLUMBING.search(_text(root, f) or "")
    ]
    return {
        "readme_lines": _lines(root, "README.md"),
        "results_lines": _lines(root, "bench/RESULTS.md"),
        "facts_lines": _lines(root, "docs/facts.md"),
        "bench_scripts": len(scripts),
        "bench_script_lines": sum(_lines(root, f) for f in scripts),
        "bench_plumbing_scripts": plumbing,
        "bench_plumbing_lines": sum(_lines(root, f) for f in plumbing),
        "files_mentioning_plumbing": mentions,
    }


def _calls_flag(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "flag":
                return True
    return False


def decode_loops(tree: ast.AST) -> list[str]:
    """Functions with a loop whose head names the new-token budget or the stop check (see the module doc)."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for loop in ast.walk(fn):
            head = (
                loop.test if isinstance(loop, ast.While) else loop.iter if isinstance(loop, ast.For) else None
            )
            if head is not None and LOOP_HEAD.search(ast.unparse(head)):
                found.append(fn.name)
                break
    return found


def public_dataclasses(tree: ast.AST) -> dict[str, list[tuple[str, str]]]:
    """Each public dataclass's name -> its fields as (name, annotation text)."""
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if (
                target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            ) == "dataclass":
                out[node.name] = [
                    (stmt.target.id, ast.unparse(stmt.annotation))
                    for stmt in node.body
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                ]
                break
    return out


def sample_records(records: dict[str, list[tuple[str, str]]]) -> list[str]:
    """The records that carry samples (see the module doc): those holding a tensor, an array or the sample
    ids, grown through the fields typed with a record already found."""
    found = {
        n for n, fields in records.items() if any(CARRIES.search(a) or f == "sample_ids" for f, a in fields)
    }
    while True:
        grown = found | {
            name
            for name, fields in records.items()
            if any(re.search(rf"\b{re.escape(other)}\b", a) for _, a in fields for other in found)
        }
        if grown == found:
            return sorted(found)
        found = grown


def _edges(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    src, dst = f"{PACKAGE}.{source}", f"{PACKAGE}.{target}"
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a == src or a.startswith(src + ".")
        for b in targets
        if b == dst or b.startswith(dst + ".")
    )


def seam_metrics(root: Path, trees: dict[str, ast.AST], any_graph: dict[str, set[str]]) -> dict:
    """The issue-43 figures. ``trees``: package-relative path -> parsed module; ``any_graph``: the package's
    imports at any level (module name -> modules it imports)."""
    defined = {rel: public_dataclasses(trees[rel]) for rel in DATA_PATH if rel in trees}
    where = {name: rel for rel, classes in defined.items() for name in classes}
    fields = {name: f for classes in defined.values() for name, f in classes.items()}
    records = [f"{where[name]}:{name}" for name in sample_records(fields)]
    loops = [f"{rel}:{name}" for rel, tree in sorted(trees.items()) for name in decode_loops(tree)]
    return {
        "train_files": sum(1 for p in (root / PACKAGE / "train").rglob("*.py") if p.name != "__init__.py"),
        "modules_calling_flag": sorted(rel for rel, tree in trees.items() if _calls_flag(tree)),
        "imports_eval_to_train": _edges(any_graph, "eval", "train"),
        "imports_train_to_generate": _edges(any_graph, "train", "generate"),
        "decode_loops": loops,
        "decode_loop_modules": sorted({loop.split(":")[0] for loop in loops}),
        "records_index_to_drafter": records,
    }
