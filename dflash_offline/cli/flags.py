"""How ``dflash`` spells its options, and the one place it does: the library names a config field with a
marker (``config_fields.field_ref``: "`OptimizerConfig.lr`", or "`seed`" for a shared option), and ``render``
turns each marker of a message or a help text into the flag ("--lr", "--seed") when the command line
prints it. A Python caller reads the field names; a ``dflash`` user reads the flags."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import typing
from typing import Any

from dflash_offline import config_fields
from dflash_offline.config_fields import Cli, cli_spec

TOP_CONFIGS = {
    "GenerateConfig": "dflash_offline.generate.config",
    "RegenerateConfig": "dflash_offline.regenerate.config",
    "TrainConfig": "dflash_offline.train.config",
    "EvalConfig": "dflash_offline.eval.config",
    "Placement": "dflash_offline.placement",
}
"""The configs the commands are built from (class name -> module), imported only when a marker names
one; a config nested in one of their fields (a section) is found through them."""

MARKER = re.compile(r"`(?:([A-Z][A-Za-z0-9]*)\.)?([a-z][a-z0-9_]*)`")
"""What ``config_fields.field_ref`` writes: "`Owner.field`" or "`field`"."""


def spelling(name: str, spec: Cli) -> str:
    """The flag of the field ``name`` with this ``Cli``: its own ``flag``, else ``--`` + the name."""
    return spec.flag or "--" + name.replace("_", "-")


def flag(owner: type[Any] | str | Cli, name: str | None = None) -> str:
    """The flag of a config field or a shared option, for a message of ``cli/`` itself:
    ``flag(TrainConfig, "max_steps")`` is ``--max-steps``, ``flag(SEED)`` is ``--seed``. What names no
    option raises ``ValueError``, as ``field_ref`` does."""
    marker = config_fields.field_ref(owner, name)
    spelled = render(marker)
    if spelled == marker:
        raise ValueError(f"{marker} is not a command-line option")
    return spelled


def arguments(config: type[Any], **values: object) -> list[str]:
    """The command-line options that set these options of ``config`` (a command's config dataclass; an
    option of one of its sections by its name), in order: the flag and the value, or the bare flag for
    True."""
    owners = {o.name: o.owner for o in config_fields.option_fields(config)}
    args: list[str] = []
    for name, value in values.items():
        spelled = flag(owners.get(name, config), name)
        args += [spelled] if value is True else [spelled, str(value)]
    return args


def render(text: str) -> str:
    """``text`` with each field marker replaced by its flag; a marker that names no option, and any
    other backticked word, is left as it is."""
    return MARKER.sub(_flag_of_marker, text)


def _flag_of_marker(match: re.Match[str]) -> str:
    owner_name, name = match.groups()
    if owner_name is None:
        spec = _shared().get(name)
        return match.group() if spec is None or spec.flag is None else spec.flag
    owner = _owner(owner_name)
    field = None if owner is None else {f.name: f for f in dataclasses.fields(owner)}.get(name)
    spec = None if field is None else cli_spec(field)
    return match.group() if spec is None or spec.kind != "value" else spelling(name, spec)


@functools.cache
def _shared() -> dict[str, Cli]:
    """Field name -> the shared option (``config_fields.SEED``, ...) configs give that name."""
    return {
        value.field: value
        for value in vars(config_fields).values()
        if isinstance(value, Cli) and value.field is not None
    }


def _owner(name: str) -> type[Any] | None:
    if name in TOP_CONFIGS:
        cls: type[Any] = getattr(importlib.import_module(TOP_CONFIGS[name]), name)
        return cls
    return _nested_configs().get(name)


@functools.cache
def _nested_configs() -> dict[str, type[Any]]:
    """Class name -> every dataclass reachable through the fields of the top-level configs."""
    found: dict[str, type[Any]] = {}
    todo = [_owner(name) for name in TOP_CONFIGS]
    while todo:
        cls = todo.pop()
        if cls is None or cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        try:
            hints = typing.get_type_hints(cls)
        except NameError:  # a hint only imported for type checking: no section is nested there
            continue
        for hint in hints.values():
            todo.extend(
                a
                for a in (hint, *typing.get_args(hint))
                if isinstance(a, type) and dataclasses.is_dataclass(a)
            )
    return found


class FlagsOnStream:
    """A text stream that writes through ``render``: the command line puts it in place of
    ``sys.stderr`` while a command runs, so the library's notes and warnings, which name options by
    their config field (``config_fields.field_ref``), reach a command-line user with the flags. Every
    other attribute is the wrapped stream's (``fileno``, ``isatty``, ``encoding`` for progress bars)."""

    wraps_spawned_workers = True
    """The worker processes a command spawns (train's DDP ranks, generate's and regenerate's workers)
    write their stderr through it too (``workers.spawned.ChildPolicy.stderr_wrapper``)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(render(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
