"""``dflash eval``: acceptance length τ and speedup of an exported drafter on standard question sets or
held-out prompts, with a tie-aware check that the output is the target's greedy output."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from dflash_offline.cli.flags import render
from dflash_offline.cli.interrupts import ctrl_c_exits_130
from dflash_offline.cli.options import config_options, progress_option
from dflash_offline.eval.config import DEFAULT_TIE_ULPS, EvalConfig
from dflash_offline.interrupt import EXIT_INTERRUPTED

EXIT_MISMATCH = 3
"""Exit status when a speculative output differs from target-only greedy beyond a near-tie."""
__all__ = ["DEFAULT_TIE_ULPS", "EXIT_MISMATCH", "eval_cmd"]


@click.command("eval")
@config_options(EvalConfig)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the full report.",
)
@click.option(
    "--tensorboard",
    "tensorboard_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Also write the τ table as TensorBoard scalars to DIR (pip install 'dflash-offline[tensorboard]').",
)
@progress_option
@ctrl_c_exits_130("interrupted before any turn was decoded: no report written; rerun the same command")
def eval_cmd(config: EvalConfig, json_path: Path | None, tensorboard_dir: Path | None) -> None:
    """Speculative decoding with the target and the drafter (greedy, batch 1): per question set τ, its
    histogram, decode tok/s of target-only and speculative decoding (prefill excluded) and the speedup,
    plus their mean; and a tie-aware check that the output is the target's own greedy output."""
    from dflash_offline.eval.exactness import describe
    from dflash_offline.eval.report import check_report_path, format_table, write_eval_report
    from dflash_offline.eval.run import run_eval
    from dflash_offline.tensorboard import require_tensorboard
    from dflash_offline.writable import check_writable_dir, check_writable_file

    # Everything that could refuse the outputs is checked before the (long) decoding, not after it.
    if json_path is not None:
        check_writable_file(json_path, option="--json")
        check_report_path(json_path, option="--json")
    if tensorboard_dir is not None:
        require_tensorboard()
        check_writable_dir(tensorboard_dir, option="--tensorboard")
    report = run_eval(config)
    # The report's notes name options by their config fields; this command's reader knows them as flags.
    report = dataclasses.replace(
        report, held_out=render(report.held_out), warnings=[render(w) for w in report.warnings]
    )
    click.echo(format_table(report))
    if json_path is not None:
        report.write_json(json_path)
        click.echo(f"report written to {json_path}")
    if tensorboard_dir is not None:
        click.echo(f"tensorboard scalars written to {write_eval_report(tensorboard_dir, report)}")
    mismatches = [r for r in report.prompts if r.divergence is not None and r.divergence.kind == "mismatch"]
    if mismatches:
        for r in mismatches:
            assert r.divergence is not None
            click.echo(
                f"error: {r.bench} {r.question_id or r.record_id or r.sample_id} turn {r.turn}: "
                f"{describe(r.divergence)}",
                err=True,
            )
        click.echo(
            f"error: {len(mismatches)} speculative outputs differ from target-only greedy beyond a rounding "
            "near-tie: a bug in the speculative loop (or raise --tie-ulps if the rounding spread is larger)",
            err=True,
        )
        raise SystemExit(EXIT_MISMATCH)
    if report.interrupted:
        click.echo(
            f"interrupted: the report covers the {len(report.prompts)} turns decoded before Ctrl-C", err=True
        )
        raise SystemExit(EXIT_INTERRUPTED)
