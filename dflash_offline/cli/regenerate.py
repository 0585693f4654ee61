"""``dflash regenerate``: the target answers each conversation's user turns (chat JSONL for generate)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cli.options import data_option, progress_option, seed_option, target_option


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
    default=16,
    show_default=True,
    help="Conversations answered together.",
)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Compute dtype (default: float32 on CPU, bfloat16 on GPU).",
)
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
    batch_size: int,
    device: str | None,
    dtype: str | None,
    progress: bool,
) -> None:
    """Replace the assistant turns of chat data with the target's own answers (greedy by default)."""
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
        device=device,
        dtype=dtype,
        progress=progress,
    )
    s = run_regenerate(config)
    click.echo(
        f"regenerate: {s.written} conversations written ({s.answers} answers, {s.truncated_answers} cut at "
        f"--max-new-tokens), {s.failed} failed, {s.skipped} already done -> {out}"
    )
    if s.repaired_bytes:
        click.echo(f"regenerate: cut a partial last line ({s.repaired_bytes} bytes) left by an earlier run")
    if s.failed:
        click.echo(f"regenerate: failures listed in {config.failures_path}", err=True)
