"""Where a ``dflash regenerate`` decode step's wall time goes: the real command (one worker, in this
process: the decode engine, its prefill forwards and CUDA graphs, the writer), with torch.profiler over
``--active`` engine steps after ``--skip`` (start-up, graph captures and the ramp left out).

A step is one ``DecodeEngine.step``: at most one prefill forward, then one decode step of every decoding
slot. Prints the device kernel time a step against the wall time a step (the device's busy fraction),
the kernel launches a step, and the largest kernels and host ops: on one H200 a regenerate step of the
real SmolLM2 target took 25–31 ms at ≈ 730–860 decoding slots of 1,024, where `bench/decode.py` had
measured 6.4 ms for the engine's decode step alone at 1,024 rows of short prompts. Everything after
``--`` is ``dflash regenerate``'s own arguments (one worker: ``--gpus 0`` or the CPU):

    python bench/regenerate_profile.py --skip 300 --active 20 -- --target default --data PROMPTS \\
      --limit 3000 --max-new-tokens 256 --max-prompt-tokens 1536 --batch-size 1024 --max-batch-tokens 8192 \\
      --gpus 0 --no-progress --out /tmp/profile-answers.jsonl

Runs on the CPU too (no device kernels there: the host-op table alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import profiling  # noqa: E402
from dflash_offline.decode.engine import DecodeEngine  # noqa: E402

if __name__ == "__main__":
    profiling.main(__doc__, DecodeEngine, "step", "regenerate", skip=300, active=20, what="engine steps")
