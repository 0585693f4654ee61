"""One home per option: a config dataclass field carries its default, its type and its command-line
spelling and help (``cli_field``); ``cli/options.py`` derives the click option from it.

The library never imports click: a field's ``Cli`` is plain data. Options shared by several commands
(``--cache``, ``--seed``, ``--gpus``/``--workers``/``--threads``, ``--progress``) are the ``Cli`` constants
below, used by every config that has them and by the shared decorators of ``cli/options.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

CLI_KEY = "cli"
"""The ``dataclasses.field`` metadata key holding a field's ``Cli``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cli:
    """How a config field is spelled on the command line; the default and type come from the field."""

    help: str | None = None
    flag: str | None = None
    """The option's name; None = ``--`` + the field name with ``-`` for ``_``."""
    secondary: str | None = None
    """The off switch of a boolean pair (``--no-progress``); None = a plain flag for a bool field."""
    negate: bool = False
    """A plain flag that sets the (True by default) bool field to False: ``--no-tensorboard``."""
    min: float | None = None
    """Lower bound checked by click (an IntRange/FloatRange); the config's own check may be tighter."""
    path: Literal["dir", "file", "any"] | None = None
    """For a Path field: what it names (click's file_okay/dir_okay)."""
    exists: bool = False
    """For a Path field: refuse a path that does not exist (at parse time)."""
    required: bool = False
    parse: Callable[[Any], Any] | None = None
    """Turns the option's text into the field's value (``--gpus 0-3`` -> (0, 1, 2, 3)); the option is
    then a string defaulting to None."""
    format: Callable[[Any], str] | None = None
    """With ``parse``: spells the field's default for --help (``(256, 512)`` -> ``256,512``); None =
    no default shown (the option defaults to None and the field keeps its own default)."""
    choices: tuple[str, ...] | None = None
    """Choices of a ``str`` field whose values are not a ``Literal`` (a list built elsewhere)."""
    show_default: bool | None = None
    """None: show it when the default is not None (and the option is not a plain flag)."""
    kind: Literal["value", "placement"] = "value"
    """``placement``: a ``Placement`` field, spelled ``--gpus``/``--workers``/``--threads``."""


def cli_field(default: Any = dataclasses.MISSING, cli: Cli | None = None, **spec: Any) -> Any:
    """A dataclass field with a command-line spelling: ``cli_field(5, help="...")`` or
    ``cli_field(0, cli=SEED)`` for a shared option."""
    if cli is None:
        cli = Cli(**spec)
    elif spec:
        cli = dataclasses.replace(cli, **spec)
    return dataclasses.field(default=default, metadata={CLI_KEY: cli})


def cli_spec(f: dataclasses.Field[Any]) -> Cli | None:
    spec = f.metadata.get(CLI_KEY)
    return spec if isinstance(spec, Cli) else None


def flag_of(name: str, spec: Cli) -> str:
    return spec.flag or "--" + name.replace("_", "-")


# Options shared by several commands (one spelling, one help text).
CACHE = Cli(flag="--cache", path="dir", required=True, help="The cache directory.")
SEED = Cli(help="Seed of every random choice.")
PROGRESS = Cli(flag="--progress", secondary="--no-progress", help="Show a progress bar.")
GPUS = Cli(help="GPUs to use, one worker process each: all, 0,1,2 or 0-7. Default: the CPU.")
WORKERS = Cli(flag="--workers", min=1, help="Worker processes on the CPU (used when --gpus is not given).")
PLACEMENT = Cli(kind="placement")
TARGET = Cli(
    help="default (embedded SmolLM2-135M-Instruct), a Hugging Face model directory, a .gguf file, "
    "or random:<preset> (random:tiny, random:smollm2-135m, random:qwen3-8b)."
)
DATA = Cli(
    help="Chat data: JSON or JSONL, optionally .gz/.zst; a Parquet file or directory; a Hugging Face "
    "datasets save_to_disk directory. Default: the embedded ShareGPT V3 file."
)
DATA_FORMAT = Cli(
    help="Record schema: sharegpt (conversations of from/value), messages (role/content), "
    "prompt-response, alpaca (instruction/input/output); auto picks per record."
)
DTYPE = Cli(choices=("float32", "bfloat16"), help="Compute dtype (default: float32 on CPU, bfloat16 on GPU).")
THREADS = Cli(
    flag="--threads", help="torch threads per CPU worker (0: the machine's cores divided among the workers)."
)
