"""Size and seam metrics of the package, read from the source tree alone (ast + tokenize, nothing imported).

    python bench/house_metrics.py [ROOT] [--json FILE] [--long 60]

ROOT is a checkout (default: this one). Run it on two checkouts to compare them. It prints:

- modules: ``.py`` files under ``dflash_offline/`` (and their line counts);
- long functions: ``def``s (methods and nested ones included) spanning more than ``--long`` lines,
  decorators excluded;
- flag literals outside ``cli/``: lines of package code (strings and comments) that spell a
  ``--flag``, the count ``grep -c`` gives, and the flag tokens inside string literals;
- option spellings: for ``--tokens-per-microbatch``, ``--block-size`` and the resume checks, the lines
  that write the flag, the lines where the option's name meets a number literal in code (a default
  or a bound), and the functions that raise ``ResumeError``;
- records: frozen dataclasses defined in ``train/`` and ``drafter/`` (the training data path);
- import cycles: strongly connected components of the ``dflash_offline`` import graph, three times:
  module-level imports (what runs at import time), imports inside functions too, and imports under
  ``if TYPE_CHECKING:`` too (a cycle of types: the modules cannot be read or moved apart);
- the repository around the package and the seams of training (``bench/repo_metrics.py`` says how each
  is counted): README, RESULTS and facts lines, bench scripts serving a user against GPU-machine plumbing,
  tracked files mentioning that plumbing; train/ files, modules calling ``flag(``, imports eval → train and
  train → generate, decode loops, records between the index and the drafter.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import repo_metrics

PACKAGE = "dflash_offline"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
OPTIONS = {"tokens_per_microbatch": "--tokens-per-microbatch", "block_size": "--block-size"}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    """(qualified name, first line, span) of every def longer than ``limit`` lines."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    span = (child.end_lineno or child.lineno) - child.lineno + 1
                    if span > limit:
                        found.append((name, child.lineno, span))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def flag_lines(source: str) -> tuple[int, int]:
    """(lines with a ``--flag`` in a string or comment, flag tokens inside string literals)."""
    lines: set[int] = set()
    in_strings = 0
    text_types = (tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in text_types:
            text_lines = tok.string.split("\n")
            for offset, text in enumerate(text_lines):
                if FLAG.search(text):
                    lines.add(tok.start[0] + offset)
            if tok.type != tokenize.COMMENT:
                in_strings += len(FLAG.findall(tok.string))
    return len(lines), in_strings


def default_or_bound_lines(source: str, name: str) -> list[int]:
    """Lines of code where identifier ``name`` gets a number as its default (``name: T = 16``,
    ``name = 16``, ``cli_field(16, ...)``) or is bounded by one (``min=2``, ``name < 2``, ``2 <= name``).
    Strings and comments do not count."""
    by_line: dict[int, list[tokenize.TokenInfo]] = defaultdict(list)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.NUMBER, tokenize.OP):
            by_line[tok.start[0]].append(tok)
    found = []
    for line, toks in by_line.items():
        texts = [t.string for t in toks]
        if name not in texts or not any(t.type == tokenize.NUMBER for t in toks):
            continue
        i = texts.index(name)
        after = texts[i + 1 :]
        compared = any(op in texts for op in ("<", "<=", ">", ">="))
        keyword_bound = any(
            t in ("min", "max") and texts[j + 1 : j + 2] == ["="] for j, t in enumerate(texts)
        )
        default = False
        if after[:1] == [":"] and "=" in after and "," not in after[: after.index("=")]:  # annotated
            rest = after[after.index("=") + 1 :]
            default = bool(rest) and (rest[0].isdigit() or rest[:2] == ["cli_field", "("])
        elif after[:1] == ["="]:
            default = len(after) > 1 and after[1][:1].isdigit()
        if compared or keyword_bound or default:
            found.append(line)
    return sorted(found)


def raises_resume_error(tree: ast.AST) -> list[str]:
    """Functions with a ``raise ResumeError(...)`` (each is a resume-compatibility decision)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                call = inner.exc if isinstance(inner, ast.Raise) else None
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "ResumeError":
                    found.append(node.name)
                    break
    return found


def frozen_records(tree: ast.AST) -> list[str]:
    """Classes decorated ``@dataclass(frozen=True, ...)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for dec in node.decorator_list:
                if (
                    isinstance(dec, ast.Call)
                    and getattr(dec.func, "id", None) == "dataclass"
                    and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in dec.keywords)
                ):
                    found.append(node.name)
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(name: str, path: Path, tree: ast.AST, known: set[str]) -> tuple[set[str], set[str], set[str]]:
    """Package-internal modules imported (at module level, anywhere at run time, anywhere including
    ``if TYPE_CHECKING:`` blocks)."""
    skip = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    top: set[str] = set()
    anywhere: set[str] = set()
    typed: set[str] = set()

    def resolve(base: str, names: list[str]) -> set[str]:
        out = set()
        for n in names:
            full = f"{base}.{n}" if base else n
            if full in known:
                out.add(full)
            elif base in known:
                out.add(base)
        return out

    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        targets: set[str] = set()
        if isinstance(node, ast.Import):
            targets = {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not base.startswith(PACKAGE):
                continue
            targets = resolve(base, [a.name for a in node.names])
        targets.discard(name)
        typed |= targets
        if id(node) in skip:
            continue
        anywhere |= targets
        if id(node) not in in_function:
            top |= targets
    return top, anywhere, typed


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def measure(root: Path, long_limit: int) -> dict:
    mods = modules(root)
    known = set(mods)
    lines_per_module = {}
    long: list[str] = []
    flags_outside_cli = 0
    flag_tokens_outside_cli = 0
    option_flags: dict[str, list[str]] = defaultdict(list)
    option_numbers: dict[str, list[str]] = defaultdict(list)
    resume_decisions: list[str] = []
    records: list[str] = []
    top_graph: dict[str, set[str]] = {}
    any_graph: dict[str, set[str]] = {}
    typed_graph: dict[str, set[str]] = {}
    trees: dict[str, ast.AST] = {}
    for name, path in mods.items():
        source = path.read_text()
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(source)
        trees[rel.removeprefix(f"{PACKAGE}/")] = tree
        lines_per_module[rel] = source.count("\n")
        long += [f"{rel}:{n} {qual} ({span} lines)" for qual, n, span in long_functions(tree, long_limit)]
        if not rel.startswith(f"{PACKAGE}/cli/"):
            n_lines, n_tokens = flag_lines(source)
            flags_outside_cli += n_lines
            flag_tokens_outside_cli += n_tokens
        for number, text in enumerate(source.splitlines(), 1):
            for flag in OPTIONS.values():
                if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    option_flags[flag].append(f"{rel}:{number}")
        for option in OPTIONS:
            option_numbers[option] += [f"{rel}:{n}" for n in default_or_bound_lines(source, option)]
        resume_decisions += [f"{rel}:{fn}" for fn in raises_resume_error(tree)]
        if rel.startswith((f"{PACKAGE}/train/", f"{PACKAGE}/drafter/")):
            records += [f"{rel}:{r}" for r in frozen_records(tree)]
        top_graph[name], any_graph[name], typed_graph[name] = imports(name, path, tree, known)
    sizes = sorted(lines_per_module.values())
    return {
        "root": str(root),
        "modules": len(mods),
        "module_lines": {"total": sum(sizes), "median": sizes[len(sizes) // 2], "max": sizes[-1]},
        "long_function_limit": long_limit,
        "long_functions": sorted(long),
        "flag_lines_outside_cli": flags_outside_cli,
        "flag_tokens_in_strings_outside_cli": flag_tokens_outside_cli,
        "option_flag_lines": dict(option_flags),
        "option_number_lines": dict(option_numbers),
        "resume_decisions": resume_decisions,
        "train_drafter_records": records,
        "import_cycles_module_level": cycles(top_graph),
        "import_cycles_any_level": cycles(any_graph),
        "import_cycles_with_type_checking": cycles(typed_graph),
        "repository": repo_metrics.product_metrics(root, repo_metrics.tracked_files(root)),
        "seams": repo_metrics.seam_metrics(root, trees, any_graph),
    }


def repo_rows(repo: dict, seams: dict) -> list[tuple[str, object]]:
    """The printed rows of the repository and seam metrics (issues 42 and 43)."""
    serving = repo["bench_script_lines"] - repo["bench_plumbing_lines"]
    return [
        ("README.md lines", repo["readme_lines"]),
        ("bench/RESULTS.md lines", repo["results_lines"]),
        ("docs/facts.md lines", repo["facts_lines"]),
        ("bench/ scripts (files / lines)", f"{repo['bench_scripts']} / {repo['bench_script_lines']}"),
        ("bench/ lines serving a user / plumbing", f"{serving} / {repo['bench_plumbing_lines']}"),
        ("tracked files mentioning the GPU plumbing", len(repo["files_mentioning_plumbing"])),
        ("train/ files", seams["train_files"]),
        ("modules calling flag(", len(seams["modules_calling_flag"])),
        ("imports eval -> train (module pairs)", len(seams["imports_eval_to_train"])),
        ("imports train -> generate (module pairs)", len(seams["imports_train_to_generate"])),
        (
            "decode loops (functions / modules)",
            f"{len(seams['decode_loops'])} / {len(seams['decode_loop_modules'])}",
        ),
        ("records between the index and the drafter", len(seams["records_index_to_drafter"])),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--json", type=Path, help="also write the full result (every list) here")
    parser.add_argument("--long", type=int, default=60, help="a function longer than this is long")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every item, not only counts")
    args = parser.parse_args()
    result = measure(args.root.resolve(), args.long)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    size = result["module_lines"]
    modules_text = f"{result['modules']} ({size['total']} lines, median {size['median']}, max {size['max']})"
    rows = [
        ("modules", modules_text),
        (f"functions over {args.long} lines", len(result["long_functions"])),
        ("--flag lines outside cli/ (grep -c)", result["flag_lines_outside_cli"]),
        ("--flag tokens in strings outside cli/", result["flag_tokens_in_strings_outside_cli"]),
    ]
    for flag, where in sorted(result["option_flag_lines"].items()):
        files = len({w.split(":")[0] for w in where})
        rows.append((f"{flag} written (lines / files)", f"{len(where)} / {files}"))
    for option, where in sorted(result["option_number_lines"].items()):
        rows.append((f"{option} next to a number (default/bound)", len(where)))
    rows.append(("functions raising ResumeError", len(result["resume_decisions"])))
    rows.append(("frozen records in train/ + drafter/", len(result["train_drafter_records"])))
    rows.append(("import cycles, module level", len(result["import_cycles_module_level"])))
    rows.append(("import cycles, any level", len(result["import_cycles_any_level"])))
    rows.append(("import cycles, with TYPE_CHECKING", len(result["import_cycles_with_type_checking"])))
    rows += repo_rows(result["repository"], result["seams"])
    if args.verbose:
        for key in ("bench_plumbing_scripts", "files_mentioning_plumbing"):
            print(f"{key}: {json.dumps(result['repository'][key], indent=1)}")
        for key, value in result["seams"].items():
            if isinstance(value, list):
                print(f"{key}: {json.dumps(value, indent=1)}")
        for key in (
            "long_functions",
            "option_flag_lines",
            "option_number_lines",
            "resume_decisions",
            "train_drafter_records",
        ):
            print(f"{key}: {json.dumps(result[key], indent=1)}")
    for key in ("import_cycles_module_level", "import_cycles_any_level", "import_cycles_with_type_checking"):
        for component in result[key]:
            print(f"{key}: {' <-> '.join(component)}")
    width = max(len(r[0]) for r in rows)
    print(f"\n{'metric':<{width}}  value  ({result['root']})")
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


if __name__ == "__main__":
    main()
