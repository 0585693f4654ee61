"""Where a ``dflash train`` step's wall time goes: the real command (prefetcher, reporter, compiled drafter),
with torch.profiler over ``--active`` optimizer steps after ``--skip`` (compilation and warm-up left out).

Prints the device kernel time a step against the wall time a step (the device's busy fraction: well below
1 means the host, not the GPU, sets the step rate), the kernel launches and compiled-graph calls a step,
and the largest kernels and host ops. Everything after ``--`` is ``dflash train``'s own arguments:

    python bench/train_profile.py --skip 140 --active 10 -- --cache CACHE --out RUN --max-steps 160 --gpus 0

Runs on the CPU too (no device kernels there: the host-op table alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dflash_offline.train.step as train_step  # noqa: E402

COMPILED = ("CompiledFunction", "CompiledFunctionBackward")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def summarize(prof: Any, active: int, wall_s: list[float]) -> dict[str, Any]:
    """The profile's figures a step (``wall_s``: the wall seconds of the profiled steps)."""
    events = prof.key_averages()
    # The kernels' own events only, as the table's "Self CUDA time total" counts them: an operator's row
    # also carries the self time of the kernels it launched, so a sum over every row counts them twice
    # (the first H200 profile with this sum gave a device busy 1.93 times the wall time).
    device_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    calls = {e.key: e.count for e in events}
    wall = sum(wall_s) / len(wall_s) if wall_s else None
    device_s = device_us / 1e6 / active if torch.cuda.is_available() else None
    return {
        "steps": active,
        "wall_s_per_step": wall,
        "device_kernel_s_per_step": device_s,
        "device_busy_fraction": device_s / wall if device_s is not None and wall else None,
        "launches_per_step": sum(calls.get(k, 0) for k in LAUNCHES) / active,
        "compiled_calls_per_step": sum(calls.get(k, 0) for k in COMPILED) / active,
        "dynamo_guard_us_per_step": next(
            (e.self_cpu_time_total / active for e in events if e.key == "TorchDynamo Cache Lookup"), 0.0
        ),
        "aten_ops_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / active,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", type=int, default=140, help="optimizer steps before the profile")
    ap.add_argument("--active", type=int, default=10, help="optimizer steps profiled")
    ap.add_argument("--rows", type=int, default=20, help="rows of each table")
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/train_profile.json")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then dflash train's arguments")
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train_args:
        ap.error("give dflash train's arguments after --")
    out = args.json or (Path(os.environ["OUT"]) / "train_profile.json" if os.environ.get("OUT") else None)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    step_ends: list[float] = []

    def report(prof: Any) -> None:
        # Called when the active steps end, inside the training loop: the CLI may exit the process at its
        # end without returning here.
        walls = [b - a for a, b in zip(step_ends[-args.active - 1 :], step_ends[-args.active :])]
        figures = summarize(prof, args.active, walls)
        events = prof.key_averages()
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=55))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=55))
        print(json.dumps(figures, indent=1), flush=True)
        if out is not None:
            out.write_text(json.dumps(figures, indent=1) + "\n")

    prof = profile(
        activities=activities,
        schedule=schedule(wait=args.skip, warmup=1, active=args.active, repeat=1),
        on_trace_ready=report,
    )
    original = train_step.OptimizerStep.__call__

    def profiled_step(self: Any, *a: Any, **k: Any) -> Any:
        outcome = original(self, *a, **k)
        # No sync: the host runs ahead as in a run, and is timed so. Appended before prof.step(), which
        # calls report() after the last profiled step: its end must be counted already.
        step_ends.append(time.perf_counter())
        prof.step()
        return outcome

    train_step.OptimizerStep.__call__ = profiled_step  # type: ignore[method-assign]
    from dflash_offline.cli import main as cli

    prof.start()
    try:
        cli.main(["train", *train_args], standalone_mode=False)
    finally:
        prof.stop()


if __name__ == "__main__":
    main()
