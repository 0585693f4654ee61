"""``dflash generate``: capture target hidden states into the cache (resumable)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cache.commit_policy import DEFAULT_FLUSH_BYTES, DEFAULT_FLUSH_SECONDS
from dflash_offline.cli.options import (
    cache_option,
    data_option,
    placement_options,
    progress_option,
    seed_option,
    target_option,
)


@click.command()
@cache_option(help="Cache directory to create or resume (rerunning the same command resumes).")
@target_option
@data_option
@click.option(
    "--skip", type=click.IntRange(min=0), default=0, show_default=True, help="Records to skip first."
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Records to read after --skip.")
@click.option("--max-len", "max_length", type=click.IntRange(min=2), default=3072, show_default=True)
@click.option(
    "--too-long",
    type=click.Choice(["truncate", "skip"]),
    default="skip",
    show_default=True,
    help="What to do with conversations longer than --max-len tokens.",
)
@click.option(
    "--layer-ids",
    default=None,
    help="Captured target layers, ascending and unique, e.g. 1,9,17,25,33 (default: DFlash rule).",
)
@click.option(
    "--num-features",
    type=click.IntRange(min=1),
    default=None,
    help="Features for the DFlash layer rule (default 5); not with --layer-ids.",
)
@click.option("--bucket-edges", default="256,512,1024,2048,3072", show_default=True)
@click.option(
    "--tokens-per-batch",
    type=click.IntRange(min=1),
    default=16384,
    show_default=True,
    help="Padded tokens per forward (rows × longest row).",
)
@click.option("--max-batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--window",
    "window_records",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="Records planned (bucketed, packed, shuffled) together.",
)
@seed_option
@click.option("--codec", default=None, help="Feature codec (default: the cache library's measured default).")
@click.option(
    "--fsync/--no-fsync", default=False, show_default=True, help="fsync shards before committing rows."
)
@click.option(
    "--flush-seconds",
    type=click.FloatRange(min=0),
    default=DEFAULT_FLUSH_SECONDS,
    show_default=True,
    help="Each worker commits its samples at least this often (what a kill can lose).",
)
@click.option(
    "--flush-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_FLUSH_BYTES,
    show_default=True,
    help="...or once this many raw bytes of samples wait uncommitted.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Compute dtype (default: float32 on CPU, bfloat16 on GPU).",
)
@placement_options
@progress_option
def generate(
    cache_dir: Path,
    target: str,
    data: str | None,
    data_format: str,
    skip: int,
    limit: int | None,
    max_length: int,
    too_long: str,
    layer_ids: str | None,
    num_features: int,
    bucket_edges: str,
    tokens_per_batch: int,
    max_batch_size: int,
    window_records: int,
    seed: int,
    codec: str | None,
    fsync: bool,
    flush_seconds: float,
    flush_bytes: int,
    dtype: str | None,
    gpus: str | None,
    workers: int,
    threads: int,
    progress: bool,
) -> None:
    """Run the target over a chat data set and store the hidden states of a few layers."""
    from dflash_offline.generate.config import GenerateConfig
    from dflash_offline.generate.launch import format_summary, generate_from_config
    from dflash_offline.generate.plan import parse_bucket_edges
    from dflash_offline.placement import Placement, parse_gpus
    from dflash_offline.target.layers import split_layer_ids

    config = GenerateConfig(
        cache_dir=cache_dir,
        target=target,
        data=None if data is None else Path(data),
        data_format=data_format,  # type: ignore[arg-type]
        skip=skip,
        limit=limit,
        max_length=max_length,
        too_long=too_long,  # type: ignore[arg-type]
        layer_ids=None if layer_ids is None else split_layer_ids(layer_ids),
        num_features=num_features,
        bucket_edges=parse_bucket_edges(bucket_edges),
        tokens_per_batch=tokens_per_batch,
        max_batch_size=max_batch_size,
        window_records=window_records,
        seed=seed,
        codec=codec,
        fsync=fsync,
        flush_seconds=flush_seconds,
        flush_bytes=flush_bytes,
        dtype=dtype,
        placement=Placement(gpus=parse_gpus(gpus), num_cpu_workers=workers, threads_per_worker=threads),
        progress=progress,
    )
    try:
        summary = generate_from_config(config)
    except KeyboardInterrupt:
        click.echo("interrupted: committed samples are kept; rerun the same command to resume", err=True)
        raise SystemExit(130) from None
    if summary is not None:
        click.echo(format_summary(summary, cache_dir=str(config.cache_dir)))
