"""One home per option: a config dataclass field carries its default, its type and its command-line
spelling and help (``cli_field``); ``cli/options.py`` derives the click option from it.

The library never imports click: a field's ``Cli`` is plain data. Options shared by several commands
(``--cache``, ``--seed``, ``--gpus``/``--workers``/``--threads``, ``--progress``, ``--skip``/``--limit``,
``--device``…) are the ``Cli`` constants below, used by every config that has them and by the shared
decorators of ``cli/options.py``. Messages and help texts name an option by its field, with
``field_ref(Config, "field")`` ("`Config.field`") or ``field_ref(SHARED)`` ("`field`"), never by its flag:
a Python caller reads the field, and ``cli/flags.py``, the one place that spells flags, turns each such
marker into the flag when the command line prints the text."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from dflash_offline.errors import ConfigError

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
    """Lower bound, checked by ``check_fields`` when the config is built (from the command line or code)."""
    max: float | None = None
    """Upper bound (inclusive unless ``max_open``)."""
    min_open: bool = False
    """The bound ``min`` itself is refused (``--lr`` > 0)."""
    max_open: bool = False
    """The bound ``max`` itself is refused (``--val-fraction`` < 1)."""
    why: str | None = None
    """Why the bounds are what they are, appended to the error that names them."""
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
    field: str | None = None
    """For a shared option: the field name the configs give it, which ``field_ref(SHARED)`` names."""


def cli_field(
    default: Any = dataclasses.MISSING,
    cli: Cli | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    **spec: Any,
) -> Any:
    """A dataclass field with a command-line spelling: ``cli_field(5, help="...")`` or
    ``cli_field(0, cli=SEED)`` for a shared option; ``metadata`` adds what a config declares beside it
    (train/config.py: the option's resume rule)."""
    if cli is None:
        cli = Cli(**spec)
    elif spec:
        cli = dataclasses.replace(cli, **spec)
    return dataclasses.field(default=default, metadata={**(metadata or {}), CLI_KEY: cli})


def cli_spec(f: dataclasses.Field[Any]) -> Cli | None:
    spec = f.metadata.get(CLI_KEY)
    return spec if isinstance(spec, Cli) else None


def field_ref(owner: type[Any] | str | Cli, name: str | None = None) -> str:
    """How a message names an option: ``field_ref(OptimizerConfig, "max_steps")`` is
    "`OptimizerConfig.max_steps`" (a field of a config dataclass, or of a section of one: named by the class
    declaring it), ``field_ref(SEED)`` is "`seed`" (a shared option, by its field name).
    A Python caller reads that; the command line shows the flag instead (``cli.flags.render``). A field
    that does not exist, has no ``Cli`` or is several options (a ``Placement``) raises ``ValueError``:
    a renamed option breaks every message naming it (a test calls every use). A module the config
    imports, which cannot import it back, names the class: ``field_ref("GenerateConfig", "layer_ids")``
    (checked by that test only)."""
    if isinstance(owner, Cli):
        if name is not None or owner.field is None:
            raise ValueError(f"field_ref(shared option) takes a Cli with a field and no name, not {owner!r}")
        return f"`{owner.field}`"
    owner_name = owner if isinstance(owner, str) else owner.__name__
    if name is None:
        raise ValueError(f"field_ref({owner_name}) needs the name of one of its option fields")
    if not isinstance(owner, str):
        fields = {f.name: f for f in dataclasses.fields(owner)}
        spec = cli_spec(fields[name]) if name in fields else None
        if spec is None or spec.kind != "value":
            raise ValueError(
                f"{owner_name}.{name} is not a command-line option (no such field, or no one flag)"
            )
    return f"`{owner_name}.{name}`"


def literal_choices(hint: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` annotation (or ``Literal[...] | None``), else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return typing.get_args(args[0])
    return None


def bounds_text(spec: Cli, *, integer: bool) -> str:
    """The values ``spec``'s bounds allow, in words: "an integer in 1..64", "a finite number > 0"."""
    lo, hi = spec.min, spec.max
    if integer:
        lo_i = None if lo is None else int(lo) + int(spec.min_open)
        hi_i = None if hi is None else int(hi) - int(spec.max_open)
        text = (
            f"an integer in {lo_i}..{hi_i}"
            if lo_i is not None and hi_i is not None
            else (f"an integer ≥ {lo_i}" if lo_i is not None else f"an integer ≤ {hi_i}")
        )
    elif lo is not None and hi is not None:
        text = f"a number in {'(' if spec.min_open else '['}{lo:g}, {hi:g}{')' if spec.max_open else ']'}"
    elif lo is not None:
        text = f"a finite number {'>' if spec.min_open else '≥'} {lo:g}"
    else:
        text = f"a finite number {'<' if spec.max_open else '≤'} {hi:g}"
    return text if spec.why is None else f"{text} ({spec.why})"


def _one_of(choices: tuple[Any, ...]) -> str:
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _within(value: float, spec: Cli) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if spec.min is not None and (value < spec.min or (spec.min_open and value == spec.min)):
        return False
    return spec.max is None or not (value > spec.max or (spec.max_open and value == spec.max))


def invalid_fields(config: Any) -> list[str]:
    """One line per option of the config dataclass (its fields and its sections') whose value breaks its
    ``Cli`` bounds or is not one of its ``Literal`` choices (None, an unset optional, always passes)."""
    values = {
        o.name: getattr(config if o.section is None else getattr(config, o.section), o.name)
        for o in option_fields(type(config))
    }
    return invalid_values(type(config), values)


def invalid_values(cls: type[Any], values: dict[str, Any]) -> list[str]:
    """``invalid_fields`` for the values of some options of the config dataclass ``cls`` (by option name,
    as the command line has them; names that are not options are ignored)."""
    bad = []
    for o in option_fields(cls):
        spec = cli_spec(o.field)
        value = values.get(o.name)
        if spec is None or spec.kind != "value" or value is None:
            continue
        named = field_ref(o.owner, o.name)
        hint = typing.get_type_hints(o.owner)[o.name]
        choices = literal_choices(hint) or spec.choices
        if choices is not None and value not in choices:  # a bool too: an option once a flag
            bad.append(f"{named} {value!r}: expected {_one_of(choices)}")
        elif isinstance(value, int | float) and not isinstance(value, bool) and not _within(value, spec):
            integer = int in (hint, *typing.get_args(hint))
            bad.append(f"{named} {value}: expected {bounds_text(spec, integer=integer)}")
    return bad


def section_class(f: dataclasses.Field[Any]) -> type[Any] | None:
    """The class of the section a config field holds (``field(default_factory=OptimizerConfig)``: a config
    dataclass of its own, whose fields are options of the config), else None."""
    factory = f.default_factory
    if cli_spec(f) is not None or not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
        return None  # a ``Placement`` is one field of several flags, not a section
    return factory


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptionField:
    """One option of a config dataclass: a field of its own or of one of its sections."""

    name: str
    """The field's name: the option's, unique across the config and its sections."""
    owner: type[Any]
    """The class declaring the field (the config, or the section's class): ``field_ref(owner, name)``."""
    section: str | None
    """The config's field holding the section; None for a field of the config itself."""
    field: dataclasses.Field[Any]


def option_fields(cls: type[Any]) -> list[OptionField]:
    """Every option of the config dataclass ``cls``: its fields in order, a section's fields in its place.
    Two options of one name raise ``TypeError`` (the command line is flat)."""
    found: list[OptionField] = []
    for f in dataclasses.fields(cls):
        section = section_class(f)
        if section is None:
            found.append(OptionField(name=f.name, owner=cls, section=None, field=f))
        else:
            found += [
                OptionField(name=g.name, owner=section, section=f.name, field=g)
                for g in dataclasses.fields(section)
            ]
    names = [o.name for o in found]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise TypeError(f"{cls.__name__} has options of the same name in two sections: {twice}")
    return found


def _by_section(cls: type[Any], options: Mapping[str, Any]) -> dict[str | None, dict[str, Any]]:
    owners = {o.name: o for o in option_fields(cls)}
    grouped: dict[str | None, dict[str, Any]] = {}
    for name, value in options.items():
        if name not in owners:
            raise TypeError(f"{cls.__name__} has no option {name!r}")
        grouped.setdefault(owners[name].section, {})[name] = value
    return grouped


def from_options(cls: type[Any], options: Mapping[str, Any]) -> Any:
    """The config dataclass ``cls`` built from options by name (flat, as the command line has them), each
    put in its section; the others keep their defaults."""
    grouped = _by_section(cls, options)
    values = grouped.pop(None, {})
    for f in dataclasses.fields(cls):
        section = section_class(f)
        if section is not None:
            values[f.name] = section(**grouped.get(f.name, {}))
    return cls(**values)


def replace_options(config: Any, options: Mapping[str, Any]) -> Any:
    """``config`` with some options changed, by name (flat), each in its section."""
    grouped = _by_section(type(config), options)
    values = grouped.pop(None, {})
    for section, changed in grouped.items():
        assert section is not None
        values[section] = dataclasses.replace(getattr(config, section), **changed)
    return dataclasses.replace(config, **values)


def check_fields(config: Any) -> None:
    """Raise one ``ConfigError`` naming every option of ``config`` outside its bounds or choices: the
    bounds written once, in the field's ``Cli``, for the command line and for a config built in code."""
    bad = invalid_fields(config)
    if bad:
        raise ConfigError("invalid " + "; ".join(bad))


# Options shared by several commands (one spelling, one help text), named by their field.
CACHE = Cli(field="cache_dir", flag="--cache", path="dir", required=True, help="The cache directory.")
SEED = Cli(field="seed", flag="--seed", help="Seed of every random choice.")
PROGRESS = Cli(field="progress", flag="--progress", secondary="--no-progress", help="Show a progress bar.")
GPUS = Cli(
    field="gpus",
    flag="--gpus",
    help="GPUs to use, one worker process each: all, 0,1,2 or 0-7. Default: the CPU.",
)
WORKERS = Cli(
    field="num_cpu_workers",
    flag="--workers",
    min=1,
    max=1024,
    help=f"Worker processes on the CPU (used when {field_ref(GPUS)} is not given).",
)
PLACEMENT = Cli(kind="placement")
TARGET = Cli(
    field="target",
    flag="--target",
    help="default (embedded SmolLM2-135M-Instruct), a Hugging Face model directory, a .gguf file, "
    "or random:<preset> (random:tiny, random:smollm2-135m, random:qwen3-8b).",
)
DATA = Cli(
    field="data",
    flag="--data",
    help="Chat data: JSON or JSONL, optionally .gz/.zst; a Parquet file or directory; a Hugging Face "
    "datasets save_to_disk directory. Default: the embedded ShareGPT V3 file.",
)
DATA_FORMAT = Cli(
    field="data_format",
    flag="--data-format",
    help="Record schema: sharegpt (conversations of from/value), messages (role/content), "
    "prompt-response, alpaca (instruction/input/output); auto picks per record.",
)
SKIP = Cli(field="skip", flag="--skip", min=0, help="Records to skip first.")
LIMIT = Cli(field="limit", flag="--limit", min=0, help=f"Records to read after {field_ref(SKIP)}.")
DEVICE = Cli(field="device", flag="--device", help="cpu, cuda or cuda:N (default: cuda when available).")
DTYPE = Cli(
    field="dtype",
    flag="--dtype",
    choices=("float32", "bfloat16"),
    help="Compute dtype (default: float32 on CPU, bfloat16 on GPU).",
)
THREADS = Cli(
    field="threads_per_worker",
    flag="--threads",
    min=0,
    max=4096,
    why="0: the machine's cores divided among the workers",
    help="torch threads per CPU worker (0: the machine's cores divided among the workers).",
)
