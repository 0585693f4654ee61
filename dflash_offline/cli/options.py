"""A command's click options, derived from its config dataclass (``config_options``: each field's
``Cli`` in ``config_fields.py`` gives flag and help, the field gives default and type), and CACHE as a
positional argument or ``--cache`` (``cache_input``)."""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dflash_offline.cli.flags import render, spelling
from dflash_offline.config_fields import (
    GPUS,
    PROGRESS,
    THREADS,
    WORKERS,
    Cli,
    cli_spec,
    from_options,
    option_fields,
)

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


def placement_options(f: F) -> F:
    """--gpus / --workers / --threads: where the worker processes run (a ``Placement``)."""
    from dflash_offline.placement import Placement

    default = Placement()
    f = _click_option("threads", int, THREADS, default.threads_per_worker)(f)
    f = _click_option("workers", int, WORKERS, default.num_cpu_workers)(f)
    return _click_option("gpus", str | None, GPUS, None)(f)


def progress_option(f: F) -> F:
    return _click_option("progress", bool, PROGRESS, True)(f)


def _help(spec: Cli) -> str | None:
    """The option's help, other options named in it by their flags."""
    return None if spec.help is None else render(spec.help)


def _click_option(name: str, hint: Any, spec: Cli, default: Any) -> Callable[[F], F]:
    """The click option of one config field, its type derived from the field's annotation."""
    flag = spelling(name, spec)
    kwargs: dict[str, Any] = {"help": _help(spec)}
    plain_flag = False
    if spec.parse is not None:
        kwargs["default"] = None if spec.format is None else spec.format(default)
        if spec.choices is not None:
            kwargs["type"] = click.Choice(list(spec.choices))
    elif spec.negate:
        plain_flag = True
        kwargs["is_flag"] = True
    else:
        base = _strip_none(hint)
        if base is bool:
            if spec.secondary is None:
                plain_flag = True
                kwargs["is_flag"] = True
                if default:
                    raise TypeError(f"{name}: a plain flag defaults to False (use negate or secondary)")
            else:
                flag = f"{flag}/{spec.secondary}"
                kwargs["default"] = default
        else:
            kwargs["default"] = default
            kwargs["type"] = _click_type(base, spec)
    if spec.required:
        kwargs["required"] = True
        del kwargs["default"]
    show = spec.show_default
    if show is None and not plain_flag and kwargs.get("default") is not None:
        show = True
    if show is not None:
        kwargs["show_default"] = show
    return click.option(flag, name, **kwargs)


def _strip_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and len(args) == 1:
        return args[0]
    return hint


def _click_type(base: Any, spec: Cli) -> Any:
    if typing.get_origin(base) is typing.Literal:
        return click.Choice(list(typing.get_args(base)))
    if spec.choices is not None:
        return click.Choice(list(spec.choices))
    if base is Path:
        return click.Path(
            path_type=Path,
            file_okay=spec.path != "dir",
            dir_okay=spec.path != "file",
            exists=spec.exists,
        )
    if base in (int, float):
        # Bounds are checked when the config is built (config_fields.check_fields): one message, in
        # one style, for the command line and for code.
        return base
    if base is str:
        return None
    raise TypeError(f"no click type for a config field of type {base!r}")


def config_options(
    cls: type[Any], *, order: tuple[str, ...] | None = None, **fixed: Any
) -> Callable[[Callable[..., R]], Callable[..., None]]:
    """Click options for every option of the config dataclass ``cls`` that has a ``Cli`` (its fields and
    its sections', ``config_fields.option_fields``), in field order or in ``order`` (option names: each one
    once); the command then receives ``config`` built from them and ``fixed`` (``config_fields.from_options``:
    each in its section) and its own other options. A ``--cache`` field is also accepted as the positional
    CACHE (``cache_input``)."""
    options = option_fields(cls)
    specs = [(o, spec) for o in options if (spec := cli_spec(o.field)) is not None]
    if order is not None:
        if sorted(order) != sorted(o.name for o, _ in specs):
            raise TypeError(f"the order of {cls.__name__}'s options names each option once: {order}")
        specs.sort(key=lambda option: order.index(option[0].name))
    option_names = {o.name for o in options}

    def decorate(command: Callable[..., R]) -> Callable[..., None]:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            values: dict[str, Any] = {}
            for o, spec in specs:
                if spec.kind == "placement":
                    values[o.name] = _placement(kwargs)
                    continue
                value = kwargs.pop(o.name)
                if spec.parse is not None:
                    if value is None:  # not given: the field's own default
                        continue
                    value = spec.parse(value)
                elif spec.negate:
                    value = not value
                values[o.name] = value
            # The command's own options named like a field (one placed among its other options).
            values.update({name: kwargs.pop(name) for name in list(kwargs) if name in option_names})
            command(*args, config=from_options(cls, {**values, **fixed}), **kwargs)

        decorators: list[Callable[[Any], Any]] = []
        for o, spec in specs:
            if spec.kind == "placement":
                decorators.append(placement_options)
            elif spec.flag == "--cache":
                decorators.append(cache_input(o.name, help=_help(spec), file_okay=spec.path != "dir"))
            else:
                hint = typing.get_type_hints(o.owner)[o.name]
                decorators.append(_click_option(o.name, hint, spec, o.field.default))
        for decorator in reversed(decorators):
            wrapper = decorator(wrapper)
        return wrapper

    return decorate


def _placement(kwargs: dict[str, Any]) -> Any:
    from dflash_offline.placement import Placement, parse_gpus

    return Placement(
        gpus=parse_gpus(kwargs.pop("gpus")),
        num_cpu_workers=kwargs.pop("workers"),
        threads_per_worker=kwargs.pop("threads"),
    )


def cache_input(
    name: str = "cache_dir", *, help: str | None, file_okay: bool = True, shift: str | None = None
) -> Callable[[F], F]:
    """The cache directory as the positional CACHE or as ``--cache`` (either spelling; both only when
    they agree): ``dflash status C`` and ``dflash status --cache C`` are the same command. ``shift``:
    the next positional argument, which a lone positional fills when ``--cache`` names the cache
    (``dflash sql --cache C "SELECT 1"``)."""
    path_type = click.Path(path_type=Path, file_okay=file_okay)

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            positional, option = kwargs.pop("cache_arg"), kwargs.pop("cache_opt")
            if shift is not None and option is not None and positional is not None and kwargs[shift] is None:
                kwargs[shift], positional = positional, None
            kwargs[name] = resolve_cache(positional, option)
            return f(*args, **kwargs)

        wrapper = click.option("--cache", "cache_opt", type=path_type, default=None, help=help)(wrapper)
        # With shift, the positional may be the statement: taken as text, unchanged (a Path would
        # normalise "a//b"); the cache is made a Path in resolve_cache.
        arg_type = click.STRING if shift is not None else path_type
        decorated = click.argument("cache_arg", metavar="[CACHE]", required=False, type=arg_type)(wrapper)
        return decorated  # type: ignore[return-value]

    return decorate


def resolve_cache(positional: Path | None, option: Path | None) -> Path:
    """The one cache a command was given, as CACHE or ``--cache``; a usage error for neither or two."""
    if positional is None and option is None:
        raise click.UsageError("give the cache directory: CACHE or --cache CACHE")
    if positional is not None and option is not None and Path(positional) != Path(option):
        raise click.UsageError(
            f"CACHE {positional} and --cache {option} name different caches: give the cache once"
        )
    return option if option is not None else Path(positional)  # type: ignore[arg-type]
