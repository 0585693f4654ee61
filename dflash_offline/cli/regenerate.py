"""``dflash regenerate``: the target answers each conversation's user turns (chat JSONL for generate)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cli.options import (
    data_option,
    placement_options,
    progress_option,
    seed_option,
    target_option,
)


@click.command()
@target_option
@data_option
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="Chat JSONL to write; rerunning the same command resumes it. Failures go to <out>.failures.jsonl "
    "(records listed there are skipped on rerun: delete their lines to retry them).",
)
@click.option(
    "--skip", type=click.IntRange(min=0), default=0, show_default=True, help="Records to skip first."
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Records to read after --skip.")
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="Per answer."
)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="A longer prompt ends its conversation there (fails it when it is the first turn).",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="0: greedy; > 0: sampling at this temperature (with --seed).",
)
@seed_option
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Continuous batching: requests per forward step; static: rows per generate call. "
    "Default: 256 on a GPU, 16 on the CPU.",
)
@click.option(
    "--engine",
    type=click.Choice(["auto", "cb", "static"]),
    default="auto",
    show_default=True,
    help="cb: transformers' continuous batching (paged attention); static: generate batches sorted by "
    "prompt length; auto: cb on a GPU when the installed transformers has it, else static.",
)
@click.option(
    "--kv-tokens",
    type=click.IntRange(min=1),
    default=262144,
    show_default=True,
    help="KV-cache budget in tokens per worker (cb: the paged cache; static: rows x (longest prompt + "
    "new tokens) per batch). Lower it when the KV cache does not fit in memory.",
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="cb: query tokens per forward step (decode tokens plus prefill chunks).",
)
@click.option(
    "--cuda-graphs",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="cb: CUDA graphs (auto: transformers decides; on with flash attention).",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=None,
    help="Conversations in flight per worker (default: 2 x --batch-size for cb, 4 x for static).",
)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Compute dtype (default: float32 on CPU, bfloat16 on GPU).",
)
@placement_options
@progress_option
def regenerate(
    target: str,
    data: str | None,
    data_format: str,
    out: Path,
    skip: int,
    limit: int | None,
    max_new_tokens: int,
    max_prompt_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int | None,
    engine: str,
    kv_tokens: int,
    max_batch_tokens: int,
    cuda_graphs: str,
    window: int | None,
    device: str | None,
    dtype: str | None,
    gpus: str | None,
    workers: int,
    threads: int,
    progress: bool,
) -> None:
    """Replace the assistant turns of chat data with the target's own answers (greedy by default)."""
    from dflash_offline.placement import Placement, parse_gpus
    from dflash_offline.regenerate.config import RegenerateConfig
    from dflash_offline.regenerate.run import run_regenerate

    config = RegenerateConfig(
        out=out,
        target=target,
        data=data,
        data_format=data_format,  # type: ignore[arg-type]
        skip=skip,
        limit=limit,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
        engine=engine,  # type: ignore[arg-type]
        kv_tokens=kv_tokens,
        max_batch_tokens=max_batch_tokens,
        cuda_graphs=cuda_graphs,  # type: ignore[arg-type]
        window=window,
        device=device,
        dtype=dtype,
        placement=Placement(gpus=parse_gpus(gpus), num_cpu_workers=workers, threads_per_worker=threads),
        progress=progress,
    )
    try:
        summary = run_regenerate(config)
    except KeyboardInterrupt:
        click.echo("interrupted: finished conversations are kept; rerun the same command to resume", err=True)
        raise SystemExit(130) from None
    if summary is None:  # a torchrun rank other than 0
        return
    s = summary
    click.echo(
        f"regenerate: {s.written} conversations written ({s.answers} answers, {s.truncated_answers} cut at "
        f"--max-new-tokens), {s.failed} failed, {s.skipped} already done -> {out}"
    )
    click.echo(
        f"regenerate: throughput: {s.written} conversations, {s.answers} answers, {s.new_tokens} new tokens, "
        f"{s.new_tokens_per_second:,.0f} new tok/s over {s.generation_seconds:.1f} s of generation "
        f"({s.seconds:.1f} s in all; engine {s.engine}, {s.workers} worker(s))"
    )
    if s.repaired_bytes:
        click.echo(f"regenerate: cut a partial last line ({s.repaired_bytes} bytes) left by an earlier run")
    if s.failed:
        click.echo(f"regenerate: failures listed in {config.failures_path}", err=True)
