"""Where a ``dflash train`` step's wall time goes: the real command (prefetcher, reporter, compiled drafter),
with torch.profiler over ``--active`` optimizer steps after ``--skip`` (compilation and warm-up left out).

Prints the device kernel time a step against the wall time a step (the device's busy fraction: well below
1 means the host, not the GPU, sets the step rate), the kernel launches and compiled-graph calls a step,
and the largest kernels and host ops. Everything after ``--`` is ``dflash train``'s own arguments:

    python bench/train_profile.py --skip 140 --active 10 -- --cache CACHE --out RUN --max-steps 160 --gpus 0

Runs on the CPU too (no device kernels there: the host-op table alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dflash_offline.train.step as train_step  # noqa: E402
from bench import profiling  # noqa: E402

if __name__ == "__main__":
    step = train_step.OptimizerStep
    profiling.main(__doc__, step, "__call__", "train", skip=140, active=10, what="optimizer steps")
