"""``dflash regenerate``: the target answers each conversation's user turns (chat JSONL for generate)."""

from __future__ import annotations

import click

from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import config_options
from dflash_offline.regenerate.config import RegenerateConfig


@click.command()
@config_options(RegenerateConfig)
@ctrl_c_exits_130("interrupted: finished conversations are kept; rerun the same command to resume")
def regenerate(config: RegenerateConfig) -> None:
    """Replace the assistant turns of chat data with the target's own answers (greedy by default)."""
    from dflash_offline.regenerate.run import run_regenerate

    summary = run_regenerate(config)
    if summary is None:  # a torchrun rank other than 0
        return
    s = summary
    click.echo(
        f"regenerate: {s.written} conversations written ({s.answers} answers, {s.truncated_answers} cut at "
        f"--max-new-tokens), {s.failed} failed, {s.skipped} already done -> {config.out}"
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
