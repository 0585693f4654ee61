"""``dflash generate`` with and without the planner's read-ahead, side by side in one run.

The planner tokenizes the data set a window of records at a time. Without read-ahead the next window is
tokenized only once this one's last job is in the job channel, and the workers wait through it (on an
H100 with SmolLM2: 65 s of a 213 s run, ≈ 10 s a window of 8,192 records). With it
(``GenerateConfig.plan_read_ahead``, the default) a thread tokenizes the next window while the workers
capture this one. Each round runs both settings into fresh caches, in alternating order; the summary
gives the medians and the ratio of end-to-end rates, and checks that both caches hold the same samples.

  python bench/plan_read_ahead.py     # CPU (bench/RESULTS.md): random:tiny, 6,042 code answers, 5 windows
  python bench/plan_read_ahead.py --target default --device cuda --data bench/answers/answers-00.jsonl.gz \
      --records 12288 --window 4096 --tokens-per-batch 16384 --layer-ids '' --rounds 1   # H100 (RESULTS)

A round's first run also pays the machine's cold start (on the H100 36 s more wall than a warm run of the
same setting): compare warm runs (``--rounds 2`` alternates the order).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.cache.manifest import committed_sample_ids  # noqa: E402
from dflash_offline.generate.config import GenerateConfig  # noqa: E402
from dflash_offline.generate.run import run_generate  # noqa: E402
from dflash_offline.placement import Placement  # noqa: E402

DEFAULT_DATA = ROOT / "bench" / "answers" / "code-answers-2.jsonl.gz"


def one_run(args: argparse.Namespace, cache: Path, *, read_ahead: bool) -> dict[str, float]:
    config = GenerateConfig(
        cache_dir=cache,
        target=args.target,
        data=str(args.data),
        limit=args.records,
        max_length=args.max_len,
        too_long="truncate",
        layer_ids=tuple(int(x) for x in args.layer_ids.split(",")) if args.layer_ids else None,
        tokens_per_batch=args.tokens_per_batch,
        window_records=args.window,
        progress=False,
        build_index=False,
        plan_read_ahead=read_ahead,
        placement=Placement(gpus=(0,)) if args.device == "cuda" else Placement(num_cpu_workers=1),
    )
    start = time.perf_counter()
    summary = run_generate(config)
    wall = time.perf_counter() - start
    (worker,) = summary.workers
    return {
        "wall_s": wall,
        "tokens": summary.tokens_committed,
        "tok_s": summary.tokens_committed / wall,
        "job_wait_s": worker.timings.job_wait_seconds,
        "forward_s": worker.timings.forward_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="random:tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="chat JSONL(.gz): regenerated answers"
    )
    parser.add_argument("--records", type=int, default=6042)
    parser.add_argument("--window", type=int, default=1500, help="records a planning window (--window)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--tokens-per-batch", type=int, default=2048, help="small: few tokens queued")
    parser.add_argument("--layer-ids", default="0,2", help="captured layers (random:tiny has 4)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    samples: dict[bool, set[str]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-plan-ahead-", dir=args.workdir))
    try:
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for read_ahead in order:
                cache = workdir / f"cache-{int(read_ahead)}-{round_index}"
                result = one_run(args, cache, read_ahead=read_ahead)
                runs[read_ahead].append(result)
                samples.setdefault(read_ahead, committed_sample_ids(cache))
                r = result
                print(
                    f"round {round_index} read-ahead {'on ' if read_ahead else 'off'}: {r['tokens']:,.0f} "
                    f"tokens in {r['wall_s']:.1f} s ({r['tok_s']:,.0f} tok/s), worker waited for jobs "
                    f"{r['job_wait_s']:.1f} s, forward {r['forward_s']:.1f} s",
                    flush=True,
                )
                shutil.rmtree(cache)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(read_ahead: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[read_ahead])

    where = f"{args.target} on {args.device}, {args.records} records, windows of {args.window}"
    print(f"\nplanner read-ahead: {where}")
    print(f"{'':22}{'off':>10}{'on':>10}{'on/off':>10}")
    for key, label in (
        ("tok_s", "end to end tok/s"),
        ("wall_s", "wall s"),
        ("job_wait_s", "waited for jobs s"),
    ):
        off, on = median(False, key), median(True, key)
        print(f"{label:22}{off:>10,.1f}{on:>10,.1f}{on / off if off else float('nan'):>10.2f}")
    same = samples[False] == samples[True]
    print(f"same committed samples: {same} ({len(samples[True]):,})")
    if not same:
        raise SystemExit("the two settings committed different samples")


if __name__ == "__main__":
    main()
