"""Only ``cli/`` spells flags: the library names an option by its config field (``field_ref``), so a Python
caller reads "`GenerateConfig.store_size`" or "`gpus`", and ``dflash`` prints "--store-size" or "--gpus"
(``cli.flags.render``, applied to every error the command line prints and to every help text)."""

from __future__ import annotations

import ast
import io
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dflash_offline import cli as cli_module
from dflash_offline import config_fields
from dflash_offline.cli import main
from dflash_offline.cli.flags import TOP_CONFIGS, FlagsOnStream, _owner, flag, render
from dflash_offline.config_fields import Cli, cli_spec, option_fields
from dflash_offline.data.sources import iter_records
from dflash_offline.errors import ConfigError, DataError, TargetError
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.placement import Placement, parse_gpus
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.target_model.source import resolve_target

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_offline"

SPELLING_FUNCTIONS = {"flag", "flag_of", "spelling", "render", "arguments"}
"""The functions that turn a field into its flag (``cli/flags.py``; ``config_fields`` stays watched so that
no spelling function comes back there)."""
SPELLING_MODULES = {"dflash_offline.cli.flags", "dflash_offline.config_fields"}

ALLOWED = {"demo.py": "writes dflash command lines to run (cli.flags.arguments)"}
"""Modules outside ``cli/`` that spell flags on purpose, and why."""


def spellings(path: Path) -> list[str]:
    """Where a module spells a flag: it imports a spelling function (or ``cli.flags``) and calls it, or
    builds a ``--`` string from parts (``"--" + name``, ``f"--{name}"``)."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in SPELLING_MODULES
        for alias in node.names
        if alias.name in SPELLING_FUNCTIONS
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in imported:
                found.append(f"{node.lineno}: calls {func.id}()")
            elif isinstance(func, ast.Attribute) and func.attr in ("flag", "flag_of", "spelling"):
                found.append(f"{node.lineno}: calls .{func.attr}()")
        elif isinstance(node, ast.ImportFrom) and node.module == "dflash_offline.cli.flags":
            found.append(f"{node.lineno}: imports dflash_offline.cli.flags")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = node.left
            if isinstance(left, ast.Constant) and isinstance(left.value, str) and left.value.endswith("--"):
                found.append(f"{node.lineno}: builds '--' + ...")
        elif isinstance(node, ast.JoinedStr):
            for before, after in zip(node.values, node.values[1:]):
                if (
                    isinstance(before, ast.Constant)
                    and str(before.value).endswith("--")
                    and isinstance(after, ast.FormattedValue)
                ):
                    found.append(f"{node.lineno}: builds f'--{{...}}'")
    return sorted(found)


def outside_cli() -> dict[str, list[str]]:
    """Path under the package -> its spellings, for every module outside ``cli/`` that has any."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith("cli/") and (where := spellings(path)):
            found[rel] = where
    return found


def test_no_module_outside_cli_spells_a_flag() -> None:
    unexpected = {rel: where for rel, where in outside_cli().items() if rel not in ALLOWED}
    assert unexpected == {}


def test_the_check_catches_a_module_that_spells_a_flag(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from dflash_offline.config_fields import flag\n"
        "from dflash_offline.cli.flags import render\n"
        "def check(config, name):\n"
        "    print(f\"--{name.replace('_', '-')} is wrong\", \"--\" + name)\n"
        '    raise ValueError(f"{flag(config, name)} is wrong")\n'
    )
    assert spellings(planted) == [
        "2: imports dflash_offline.cli.flags",
        "4: builds '--' + ...",
        "4: builds f'--{...}'",
        "5: calls flag()",
    ]


def test_a_shared_option_is_named_by_the_field_every_config_gives_it() -> None:
    """``field_ref(SEED)`` reads "`seed`": each config field carrying a shared option has that name."""
    checked = 0
    for owner in {name: _owner(name) for name in TOP_CONFIGS}.values():
        assert owner is not None
        for f in (o.field for o in option_fields(owner)):  # its sections' fields too (TrainConfig's)
            spec = cli_spec(f)
            if spec is not None and spec.field is not None:
                assert f.name == spec.field, (owner.__name__, f.name, spec.field)
                checked += 1
    shared = [v for v in vars(config_fields).values() if isinstance(v, Cli) and v.flag is not None]
    assert all(v.field is not None for v in shared)
    assert checked >= 20


def test_render_spells_field_markers_and_leaves_other_backticks() -> None:
    text = (
        "`RegenerateConfig.max_prompt_tokens` 9 > `GenerateConfig.max_length`, see `seed` and `gpus`; "
        "`contaminated` rows; `GenerateConfig.placement`, `GenerateConfig.no_such` and `NoConfig.seed` "
        "are no one option; run `dflash verify --repair`"
    )
    # A class named by a module below it is checked where the command line spells it.
    assert flag("GenerateConfig", "layer_ids") == "--layer-ids"
    with pytest.raises(ValueError, match="option"):
        flag("GenerateConfig", "layer_idz")
    assert render(text) == (
        "--max-prompt-tokens 9 > --max-len, see --seed and --gpus; "
        "`contaminated` rows; `GenerateConfig.placement`, `GenerateConfig.no_such` and `NoConfig.seed` "
        "are no one option; run `dflash verify --repair`"
    )


def cli_error(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 1, (result.output, result.exception)
    return result.output


def test_a_bounds_error_names_the_field_in_python_and_the_flag_on_the_command_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        Placement(num_cpu_workers=0)
    assert str(raised.value) == "invalid `Placement.num_cpu_workers` 0: expected an integer in 1..1024"
    assert cli_error("generate", "--cache", str(tmp_path / "c"), "--workers", "0") == (
        "Error: invalid --workers 0: expected an integer in 1..1024\n"
    )


def test_a_config_check_names_fields_in_python_and_flags_on_the_command_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        GenerateConfig(cache_dir=tmp_path / "c", store_size=10**10, window_limit=10**9)
    rest = (
        ": training could never retire a store before the window is full; give a store size of at most "
        "half the limit"
    )
    assert str(raised.value) == (
        "`GenerateConfig.store_size` 10000000000 is larger than "
        f"`GenerateConfig.window_limit` 1000000000{rest}"
    )
    cache = str(tmp_path / "c")
    assert cli_error("generate", "--cache", cache, "--store-size", "10GB", "--window-limit", "1GB") == (
        f"Error: --store-size 10000000000 is larger than --window-limit 1000000000{rest}\n"
    )
    with pytest.raises(ConfigError) as raised:
        RegenerateConfig(out=tmp_path / "x.jsonl", engine="openai", base_url="http://a b")
    assert (
        str(raised.value)
        == "`RegenerateConfig.base_url` 'http://a b': a URL has no spaces or control characters"
    )
    assert cli_error(
        "regenerate", "--out", str(tmp_path / "x.jsonl"), "--engine", "openai", "--base-url", "http://a b"
    ) == ("Error: --base-url 'http://a b': a URL has no spaces or control characters\n")


def test_a_shared_option_is_its_field_in_python_and_its_flag_on_the_command_line(tmp_path: Path) -> None:
    """Library functions below every config (the target, the --gpus parser, the data reader) name the
    shared option's field."""
    with pytest.raises(ConfigError) as raised:
        parse_gpus("0,0")
    assert str(raised.value) == "`gpus` '0,0' names a device twice"
    assert cli_error("generate", "--cache", str(tmp_path / "c"), "--gpus", "0,0") == (
        "Error: --gpus '0,0' names a device twice\n"
    )
    missing = str(tmp_path / "no-model")
    accepted = "a model directory (config.json + *.safetensors), a .gguf file, default or random:<preset>"
    with pytest.raises(TargetError) as raised:
        resolve_target(missing)
    assert str(raised.value) == f"`target` {missing!r} does not exist; give {accepted}"
    assert cli_error("generate", "--cache", str(tmp_path / "c"), "--target", missing) == (
        f"Error: --target {missing!r} does not exist; give {accepted}\n"
    )
    with pytest.raises(DataError) as raised:
        next(iter_records(None, skip=-1))
    assert str(raised.value) == "`skip` must be >= 0, got -1"


@click.command()
def _note_probe() -> None:
    """A command whose library-side note names an option by its field, as train's resume note does."""
    from dflash_offline.config_fields import field_ref
    from dflash_offline.train.config import OptimizerConfig

    print(f"resuming with {field_ref(OptimizerConfig, 'lr')} 0.001", file=sys.stderr)


def test_a_note_on_stderr_reaches_the_command_line_user_with_the_flag(monkeypatch):
    """Notes the library prints to stderr name fields; ``dflash`` prints them with the flags, and puts
    the caller's stderr back when the command ends."""
    monkeypatch.setitem(cli_module.COMMANDS, "note-probe", f"{__name__}:_note_probe")
    before = sys.stderr
    result = CliRunner().invoke(main, ["note-probe"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "resuming with --lr 0.001\n"
    assert sys.stderr is before


def test_the_stderr_wrapper_renders_each_write_and_counts_what_it_was_given():
    out = io.StringIO()
    stream = FlagsOnStream(out)
    text = "invalid `Placement.num_cpu_workers` 0; `seed` 3 and `no-such` stay\n"
    assert stream.write(text) == len(text)
    assert out.getvalue() == "invalid --workers 0; --seed 3 and `no-such` stay\n"
    assert stream.getvalue() == out.getvalue()  # any other attribute is the wrapped stream's
