"""``make demo``: the whole loop on the embedded assets, on a CPU, in about ten minutes.

SmolLM2-135M-Instruct answers a slice of ShareGPT (so the drafter learns the target's own
responses), ``dflash generate`` caches its hidden states, ``dflash train`` trains a small DFlash
drafter for a few minutes, and ``dflash eval`` measures the acceptance length τ of the trained and of
the untrained drafter on held-out ShareGPT prompts. Every stage is the real CLI command, printed
before it runs, so the demo doubles as a recipe.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_offline.cli.flags import arguments
from dflash_offline.eval.config import EvalConfig
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.regenerate.config import RegenerateConfig
from dflash_offline.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoSizes:
    """The knobs that set the demo's duration (defaults: about 10 minutes on 2 idle CPU cores).

    Regeneration costs most per training token (bench/RESULTS.md, "Demo budget"), so the data is what
    shrank to fit the budget; the steps, which make the trained-vs-untrained gain, did not."""

    records: int = 48
    """ShareGPT conversations the target answers (the training data)."""
    max_new_tokens: int = 48
    train_steps: int = 160
    grad_accum: int = 1
    """Microbatches of 2,048 tokens a step: one covers most of the small data set."""
    eval_prompts: int = 6
    eval_new_tokens: int = 48


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTime:
    name: str
    seconds: float
    cpu_seconds: float
    """User + system CPU time of the stage's process tree (the budget on a shared machine)."""
    command: str


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(name: str, args: list[str], times: list[StageTime]) -> None:
    command = [sys.executable, "-m", "dflash_offline", *args]
    shown = "dflash " + shlex.join(args)
    print(f"\n=== {name}: {shown}", flush=True)
    start, cpu_start = time.perf_counter(), _children_cpu_seconds()
    result = subprocess.run(command)
    seconds, cpu_seconds = time.perf_counter() - start, _children_cpu_seconds() - cpu_start
    times.append(StageTime(name=name, seconds=seconds, cpu_seconds=cpu_seconds, command=shown))
    if result.returncode != 0:
        raise SystemExit(
            f"demo stage {name!r} failed (exit {result.returncode}); rerun `make demo` to resume"
        )
    print(f"=== {name}: {seconds:.0f} s, {cpu_seconds:.0f} CPU-s", flush=True)


def compared_drafters(out: Path) -> dict[str, Path]:
    """The two drafters the demo compares, both exports of its one training run: ``dflash eval`` holds out
    a drafter's training samples by its run (the validation split stays usable), so two drafters of the
    same run are evaluated on the same held-out prompts. An export copied elsewhere (``dflash export
    --out``) no longer knows its run and holds out the whole cache: fewer, other prompts."""
    run = out / "run"
    return {"untrained": run / "drafter-initial", "trained": run / "drafter"}


def prompts_of(report: dict[str, Any]) -> list[tuple[object, ...]]:
    """The turns an eval report decoded, in order: (set, sample id, turn)."""
    prompts = report.get("prompts")
    if not isinstance(prompts, list):
        raise KeyError(f"eval report has no prompts: keys {sorted(report)}")
    return [(p.get("bench"), p.get("sample_id"), p.get("turn")) for p in prompts]


def run_demo(out: Path, sizes: DemoSizes) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data" / "regenerated.jsonl"
    cache, run = out / "cache", out / "run"
    times: list[StageTime] = []
    common_eval = [
        *arguments(EvalConfig, target="default", exclude_cache=cache, limit=sizes.eval_prompts,
                  max_new_tokens=sizes.eval_new_tokens, max_prompt_tokens=512),
        "--no-progress",
    ]  # fmt: skip
    _run(
        "regenerate",
        ["regenerate", *arguments(RegenerateConfig, target="default", limit=sizes.records,
                                 max_new_tokens=sizes.max_new_tokens, max_prompt_tokens=512, batch_size=16,
                                 out=data)],
        times,
    )  # fmt: skip
    _run(
        "generate",
        ["generate", *arguments(GenerateConfig, cache_dir=cache, target="default", data=data, max_length=1024,
                               too_long="truncate", bucket_edges="128,256,512,1024", tokens_per_batch=4096)],
        times,
    )  # fmt: skip
    # A small drafter (1 layer, blocks of 8) so that a few CPU minutes of training show; the default
    # is 5 layers and blocks of 16 (docs/drafter.md#defaults).
    _run(
        "train",
        ["train", *arguments(TrainConfig, cache_dir=cache, out_dir=run, num_layers=1, block_size=8,
                            num_anchors=128, tokens_per_microbatch=2048, grad_accum=sizes.grad_accum,
                            lr="3e-3", max_steps=sizes.train_steps, epochs=1000, checkpoint_every=40,
                            export_initial=True)],
        times,
    )  # fmt: skip
    # export, eval's --json and --progress are options of the commands themselves (no config field).
    _run("export", ["export", str(run), "--out", str(out / "drafter"), "--dtype", "float32"], times)
    reports = {}
    for label, drafter in compared_drafters(out).items():
        report = out / f"eval-{label}.json"
        eval_args = ["eval", *arguments(EvalConfig, drafter_dir=drafter), *common_eval, "--json", str(report)]
        _run(f"eval ({label})", eval_args, times)
        reports[label] = json.loads(report.read_text())
    if prompts_of(reports["untrained"]) != prompts_of(reports["trained"]):
        raise SystemExit(
            "demo: the two evals decoded different prompts, so their τ cannot be compared: "
            f"{prompts_of(reports['untrained'])} against {prompts_of(reports['trained'])}"
        )
    _run("plot (run)", ["plot", str(run)], times)
    _run("plot (cache)", ["plot", str(cache)], times)
    summary = {
        "tau_untrained": _overall_tau(reports["untrained"]),
        "tau_trained": _overall_tau(reports["trained"]),
        "eval_prompts": len(prompts_of(reports["trained"])),
        "stages": [asdict(t) for t in times],
        "total_seconds": sum(t.seconds for t in times),
        "total_cpu_seconds": sum(t.cpu_seconds for t in times),
        "artifacts": {
            "training data (target's own answers)": str(data),
            "cache": str(cache),
            "training run (metrics.jsonl, checkpoints, plots/)": str(run),
            "trained drafter (the one evaluated)": str(compared_drafters(out)["trained"]),
            "exported drafter (z-lab DFlash layout, float32)": str(out / "drafter"),
            "eval reports": [str(out / "eval-untrained.json"), str(out / "eval-trained.json")],
            "cache plots": str(cache) + "-plots",
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _overall_tau(report: dict[str, object]) -> float:
    summary = report.get("summary")
    if isinstance(summary, dict) and summary.get("tau") is not None:
        return float(summary["tau"])
    raise KeyError(f"eval report has no summary tau: keys {sorted(report)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    defaults = DemoSizes()
    parser.add_argument("--records", type=int, default=defaults.records)
    parser.add_argument("--train-steps", type=int, default=defaults.train_steps)
    args = parser.parse_args()
    summary = run_demo(args.out, DemoSizes(records=args.records, train_steps=args.train_steps))
    print("\n=== dflash-offline demo: done")
    for stage in summary["stages"]:  # type: ignore[attr-defined]
        print(
            f"  {stage['name']:<16} {stage['seconds']:6.0f} s {stage['cpu_seconds']:6.0f} CPU-s   "
            f"{stage['command']}"
        )
    print(f"  {'total':<16} {summary['total_seconds']:6.0f} s {summary['total_cpu_seconds']:6.0f} CPU-s")
    print(
        f"\n  acceptance length τ on the same {summary['eval_prompts']} held-out prompts: untrained drafter "
        f"{summary['tau_untrained']:.3f}, "
        f"trained drafter {summary['tau_trained']:.3f}"
    )
    for what, where in summary["artifacts"].items():  # type: ignore[attr-defined]
        print(f"  {what}: {where}")


if __name__ == "__main__":
    main()
