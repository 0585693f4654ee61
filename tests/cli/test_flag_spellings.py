"""Every option named outside ``cli/`` is one of ours, spelled as ``dflash`` spells it.

Messages name an option by its field with ``config_fields.field_ref`` (``field_ref(TrainConfig,
"max_steps")``, ``field_ref(SEED)``), which ``cli/flags.py`` spells as the flag; the tests below call every
such use (and every ``flag()`` of ``cli/``) in the package, and check each ``--flag`` still typed in the
package (docstrings, comments, the recipes of demo.py and the model card, command lines quoted in
messages) and in every command's help against the options of the real click commands, so a renamed option
leaves no stale message behind."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from dflash_offline.cli import COMMANDS, main
from dflash_offline.cli.flags import flag, render
from dflash_offline.config_fields import DATA, PLACEMENT, SEED, Cli, field_ref
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.train.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainConfig

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_offline"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
# "dflash CMD" and the words after it up to a quote, a backtick or a bracket: a command line whose
# flags must be CMD's own.
COMMAND_LINE = re.compile(r"\bdflash ([a-z]+)((?: +[^\s`'\"()\[\];,|]+)*)")

FOREIGN = {
    # pip, in install hints.
    "--no-deps": "pip install --no-deps (the embedded assets and the question sets)",
    # vLLM's and SGLang's serve commands that drafter/model_card.py writes into the model card.
    "--speculative-config": "vllm serve",
    "--attention-backend": "vllm serve",
    "--model-path": "python -m sglang.launch_server",
    "--speculative-algorithm": "python -m sglang.launch_server",
    "--speculative-draft-model-path": "python -m sglang.launch_server",
    "--speculative-num-draft-tokens": "python -m sglang.launch_server",
    # demo.py's own argparse options (python -m dflash_offline.demo, make demo).
    "--records": "demo.py",
    "--train-steps": "demo.py",
}
"""Flags of other programs (or of the demo script) that the package spells; none is a dflash option."""


@functools.cache
def command_options() -> dict[str, frozenset[str]]:
    """Command name -> every long flag it accepts (both halves of a --x/--no-x pair, --help)."""
    out = {}
    for name in COMMANDS:
        command = main.get_command(click.Context(main), name)
        assert command is not None, name
        params = command.get_params(click.Context(command))
        out[name] = frozenset(o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    return out


def any_option() -> frozenset[str]:
    group = {o for p in main.get_params(click.Context(main)) for o in p.opts if o.startswith("--")}
    return frozenset().union(group, *command_options().values())


def stale_flags(text: str, own: frozenset[str]) -> list[str]:
    """The flags of ``text`` that are not options: those of a ``dflash CMD …`` command line are checked
    against CMD's options, the others against ``own`` and the foreign flags."""
    bad = []
    checked: set[int] = set()
    for line in COMMAND_LINE.finditer(text):
        options = command_options().get(line.group(1))
        if options is None:
            continue
        for found in FLAG.finditer(line.group(2)):
            checked.add(line.start(2) + found.start())
            if found.group() not in options:
                bad.append(f"{found.group()} (not an option of dflash {line.group(1)})")
    for found in FLAG.finditer(text):
        if found.start() not in checked and found.group() not in own and found.group() not in FOREIGN:
            bad.append(found.group())
    return bad


def package_files(*, with_cli: bool) -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if with_cli or "cli" not in p.relative_to(PACKAGE).parts]


def texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every string (an f-string with ``{}`` for its fields) and comment of a module."""
    source = path.read_text()
    nested = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            nested.update(id(v) for v in node.values)
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            yield node.lineno, "".join(str(p) for p in parts)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in nested:
            yield node.lineno, node.value
    with path.open() as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string


def stale_literals(files: list[Path]) -> list[str]:
    found = sorted(
        (path, line, flag_text)
        for path in files
        for line, text in texts(path)
        for flag_text in stale_flags(text, any_option())
    )
    return [f"{path}:{line}: {flag_text}" for path, line, flag_text in found]


def test_every_flag_typed_in_the_package_is_an_option_of_a_command() -> None:
    """Docstrings, comments and the messages of modules that cannot import the command's config (they sit
    above it: ``target_model/layers.py`` for generate's ``--layer-ids``) name real options."""
    assert stale_literals(package_files(with_cli=False)) == []


def test_a_message_naming_no_option_is_caught(tmp_path: Path) -> None:
    """The check above fails for a message naming an option that no command has (or one another
    command has, on a ``dflash CMD`` command line)."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def check(n):\n"
        "    if n < 1:\n"
        '        raise ValueError(f"--max-stepz must be >= 1, got {n}")  # see --seed\n'
        '    return f"run `dflash generate --cache C --out {n}` first"\n'
    )
    assert stale_literals([planted]) == [
        f"{planted}:3: --max-stepz",
        f"{planted}:4: --out (not an option of dflash generate)",
    ]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_in_a_command_s_help_is_its_own_option(name: str) -> None:
    """An option's help that names another option (``--limit``: "after --skip") names one of the same
    command, stricter than the check above."""
    command = main.get_command(click.Context(main), name)
    assert command is not None
    own = command_options()[name]
    helps = {"the command": command.help or ""}
    helps.update({p.opts[0]: p.help or "" for p in command.params if isinstance(p, click.Option)})
    assert [f"{where}: {bad}" for where, text in helps.items() for bad in stale_flags(text, own)] == []


NAMING = {"field_ref": lambda *args: render(field_ref(*args)), "flag": flag}
"""The functions that name an option, each as the command line spells what it returns."""


class FlagCalls(ast.NodeVisitor):
    """Every ``field_ref(...)`` and ``flag(...)`` call of a module, with whether it runs inside a function
    (only when called)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, list[ast.expr], bool]] = []
        self._depth = 0

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in NAMING:
            self.calls.append((node.lineno, node.func.id, node.args, self._depth > 0))
        self.generic_visit(node)


UNRESOLVED = object()


def resolve(module: Any, imports: dict[str, tuple[str, str]], arg: ast.expr) -> Any:
    """A ``field_ref(...)`` or ``flag(...)`` argument: a string, or a name imported anywhere in the module
    or defined in it (``UNRESOLVED`` for a variable)."""
    if isinstance(arg, ast.Constant):
        return arg.value
    if not isinstance(arg, ast.Name):
        return UNRESOLVED
    if arg.id in imports:
        source, attr = imports[arg.id]
        return getattr(importlib.import_module(source), attr)
    return getattr(module, arg.id, UNRESOLVED)


CALLS_CHECKED_ELSEWHERE = {
    "dflash_offline/cli/flags.py": "flag() is field_ref() spelled; arguments() is run by tests/test_demo.py, "
    "which parses every stage of the demo's recipe with the real commands",
    "dflash_offline/config_fields.py": "invalid_values() names the field it checks, one with a one-flag Cli; "
    "tests/cli/test_flags_in_cli_only.py renders a bounds error on the command line",
}
"""Modules whose ``field_ref()``/``flag()`` of a variable, inside a function, another test runs."""


def test_every_flag_call_in_the_package_names_an_option() -> None:
    """Each ``field_ref(...)`` and ``flag(...)`` of the package, called as written: a field renamed or
    without a ``Cli`` raises here, before any user meets the message. A call with a variable argument must
    run at import (at module level), where importing the module checks it, or be run by a test of its own."""
    called = 0
    for path in package_files(with_cli=True):
        if path.name == "__main__.py":  # importing it runs the command line
            continue
        tree = ast.parse(path.read_text())
        imports = {
            alias.asname or alias.name: (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
            for alias in node.names
        }
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(name)  # runs the module-level calls
        visitor = FlagCalls()
        visitor.visit(tree)
        for line, function, args, in_function in visitor.calls:
            values = [resolve(module, imports, a) for a in args]
            if any(v is UNRESOLVED for v in values):
                where = path.relative_to(PACKAGE.parent).as_posix()
                assert not in_function or where in CALLS_CHECKED_ELSEWHERE, (
                    f"{where}:{line}: {function}() of a variable inside a function"
                )
                continue
            spelled = NAMING[function](*values)
            assert spelled in any_option(), f"{path}:{line}: {spelled}"
            called += 1
    assert called >= 20


def test_flag_spells_fields_and_shared_options_and_refuses_the_rest() -> None:
    """``cli.flags.flag`` spells what ``field_ref`` names; both refuse what is not one option."""
    assert flag(OptimizerConfig, "max_steps") == "--max-steps"  # an option of a section of TrainConfig
    assert flag(TrainConfig, "out_dir") == "--out"  # an explicit spelling
    assert flag(OptimizerConfig, "algorithm") == "--optimizer"
    assert flag(LoggingConfig, "tensorboard") == "--no-tensorboard"  # a plain off switch
    assert flag(GenerateConfig, "max_length") == "--max-len"
    assert (flag(SEED), flag(DATA)) == ("--seed", "--data")
    for bad in [
        (OptimizerConfig, "max_stepz"),  # no such field
        (TrainConfig, "max_steps"),  # an option of a section, named by the config holding the section
        (CheckpointConfig, "export_at_end"),  # a field with no option
        (GenerateConfig, "placement"),  # three options (--gpus/--workers/--threads)
        (TrainConfig,),
        (PLACEMENT,),
        (Cli(help="a shared option with no spelling"),),
        (SEED, "seed"),
    ]:
        with pytest.raises(ValueError, match="option"):
            flag(*bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="option"):
            field_ref(*bad)  # type: ignore[arg-type]
