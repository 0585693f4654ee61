"""Options shared by several commands, as reusable decorators (one spelling, one help text)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def cache_option(*, required: bool = True, help: str = "The cache directory.") -> Callable[[F], F]:
    return click.option(
        "--cache",
        "cache_dir",
        type=click.Path(path_type=Path, file_okay=False),
        required=required,
        help=help,
    )


def seed_option(f: F) -> F:
    return click.option(
        "--seed", type=int, default=0, show_default=True, help="Seed of every random choice."
    )(f)


def target_option(f: F) -> F:
    return click.option(
        "--target",
        default="default",
        show_default=True,
        help="default (embedded SmolLM2-135M-Instruct), a Hugging Face model directory, a .gguf file, "
        "or random:<preset> (random:tiny, random:smollm2-135m, random:qwen3-8b).",
    )(f)


def data_option(f: F) -> F:
    """--data and --data-format: the chat data set, in any accepted container and schema."""
    from dflash_offline.data.schemas import DATA_FORMATS

    f = click.option(
        "--data-format",
        type=click.Choice(DATA_FORMATS),
        default="auto",
        show_default=True,
        help="Record schema: sharegpt (conversations of from/value), messages (role/content), "
        "prompt-response, alpaca (instruction/input/output); auto picks per record.",
    )(f)
    return click.option(
        "--data",
        default=None,
        help="Chat data: JSON or JSONL, optionally .gz/.zst; a Parquet file or directory; a Hugging Face "
        "datasets save_to_disk directory. Default: the embedded ShareGPT V3 file.",
    )(f)


def placement_options(f: F) -> F:
    """--gpus / --workers / --threads: where the worker processes run."""
    f = click.option(
        "--threads",
        type=int,
        default=0,
        show_default=True,
        help="torch threads per CPU worker (0: the machine's cores divided among the workers).",
    )(f)
    f = click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Worker processes on the CPU (used when --gpus is not given).",
    )(f)
    f = click.option(
        "--gpus",
        default=None,
        help="GPUs to use, one worker process each: all, 0,1,2 or 0-7. Default: the CPU.",
    )(f)
    return f


def progress_option(f: F) -> F:
    return click.option(
        "--progress/--no-progress", default=True, show_default=True, help="Show a progress bar."
    )(f)
