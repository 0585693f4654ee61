"""``dflash regenerate``: the target answers each conversation's user turns (chat JSONL for generate)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from dflash_offline.cli.flags import flag
from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import config_options
from dflash_offline.errors import DflashError
from dflash_offline.regenerate.config import RegenerateConfig

if TYPE_CHECKING:
    from dflash_offline.regenerate.run import RegenerateSummary


@click.command()
@config_options(RegenerateConfig)
@ctrl_c_exits_130("interrupted: every finished answer is kept; rerun the same command to resume")
def regenerate(config: RegenerateConfig) -> None:
    """Replace the assistant turns of chat data with the target's own answers (greedy by default)."""
    from dflash_offline.regenerate.run import RegenerateStopped, run_regenerate

    try:
        summary = run_regenerate(config)
    except RegenerateStopped as stopped:  # the first Ctrl-C: what was written and kept, then exit 130
        _report(stopped.summary, config)
        raise
    if summary is not None:  # None: a torchrun rank other than 0
        _report(summary, config)
        if summary.failed and not summary.written:
            # Nothing came of the run: a server that answers nothing usable, a data set none of whose
            # records fits; a script must not take it for a success.
            raise DflashError(
                f"every one of the {summary.failed} records this run tried failed (their reasons: "
                f"{config.failures_path}); fix the cause, then rerun with "
                f"{flag(RegenerateConfig, 'retry_failed')} to answer them again"
            )


def _report(s: RegenerateSummary, config: RegenerateConfig) -> None:
    max_new_tokens = flag(RegenerateConfig, "max_new_tokens")
    click.echo(
        f"regenerate: {s.written} conversations written ({s.answers} answers, {s.truncated_answers} cut at "
        f"{max_new_tokens}), {s.failed} failed, {s.skipped} already done -> {config.out}"
    )
    if s.resumed:
        click.echo(
            f"regenerate: continued {s.resumed} conversations from the {s.resumed_answers} answers that an "
            f"earlier run kept in {config.partial_path}"
        )
    if s.kept:
        click.echo(
            f"regenerate: kept {s.kept} conversations in progress ({s.kept_answers} turns) for the rerun "
            f"-> {config.partial_path}"
        )
    # The engine's steps say why the tok/s is what it is: idle slots, prefill, or host time between steps.
    engine = f"; engine: {s.engine_stats.describe()}" if s.engine_stats is not None else ""
    # The start-up (everything before the first worker was ready) beside the workers' own share of it:
    # the rest is this process's (imports, reading what is done) and, with several, spawning the workers.
    startup = f"{s.seconds - s.generation_seconds:.1f} s of start-up"
    if s.load_seconds > 0:
        startup += f", {s.load_seconds:.1f} s of it loading the target and building the engine"
    click.echo(
        f"regenerate: throughput: {s.written} conversations, {s.answers} answers, {s.new_tokens} new tokens, "
        f"{s.new_tokens_per_second:,.0f} new tok/s over {s.generation_seconds:.1f} s of generation "
        f"({s.seconds:.1f} s in all: {startup}; engine {s.engine}, {s.workers} worker(s)){engine}"
    )
    if s.repaired_bytes:
        click.echo(f"regenerate: cut a partial last line ({s.repaired_bytes} bytes) left by an earlier run")
    if s.failed:
        click.echo(
            f"regenerate: failures listed in {config.failures_path} (a rerun skips them; "
            f"{flag(RegenerateConfig, 'retry_failed')} answers them again)",
            err=True,
        )
