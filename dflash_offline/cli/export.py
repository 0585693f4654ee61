"""``dflash export``: write a run's drafter in z-lab's DFlash layout."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="bfloat16", show_default=True)
@click.option("--step", type=int, default=None, help="Checkpoint step to export (default: the newest).")
@click.option(
    "--eval-report",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="A dflash eval --json report whose held-out τ table goes into the model card "
    "(default: RUN_DIR/eval.json when it exists).",
)
def export(run_dir: Path, out_dir: Path, dtype: str, step: int | None, eval_report: Path | None) -> None:
    """Export the drafter of RUN_DIR (its newest checkpoint) as config.json + model.safetensors, the
    layout vLLM, SGLang and llama.cpp load, with a model card (README.md) holding the serve commands."""
    from dflash_offline.train.checkpoint import export_run
    from dflash_offline.train.follow import checkpointed_run

    # A follow run (RUN/follow.json): its last segment's checkpoints, where --step counts that segment's.
    path = export_run(checkpointed_run(run_dir), out_dir, dtype=dtype, step=step, eval_report=eval_report)
    click.echo(f"exported to {path}")
