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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dflash_offline.train.step as train_step  # noqa: E402
from bench.profiling import default_json, profile_command  # noqa: E402


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
    profile_command(
        train_step.OptimizerStep,
        "__call__",
        ["train", *train_args],
        skip=args.skip,
        active=args.active,
        rows=args.rows,
        out=args.json or default_json("train_profile.json"),
    )


if __name__ == "__main__":
    main()
