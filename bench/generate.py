"""End-to-end ``dflash generate`` throughput against its two ceilings, measured side by side in one run.

  forward ceiling: the same truncated target on the same batches, forward only (no copy, no disk);
  disk ceiling:    sequential write + fsync bandwidth of the cache's file system, divided by the
                   stored bytes per token of the run;
  end to end:      ``dflash generate`` into a fresh cache (spawned worker, writer thread, commits).
Goal: end-to-end ≥ 0.9 × min(forward rate, disk bandwidth ÷ stored bytes per token).

It also reports the peak RSS of the whole process tree (coordinator + workers) for two data set sizes
4× apart: host memory must not grow with the data set.

  python bench/generate.py                                   # CPU, random:tiny
  python bench/generate.py --target random:qwen3-8b --device cuda --records 3000 --tokens-per-batch 16384
  python bench/generate.py ... --codec fp8                   # the fp8 rows, encoded in the capture step
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.data.sources import iter_records  # noqa: E402
from dflash_offline.data.template import tokenize_conversation  # noqa: E402
from dflash_offline.generate.capture_step import pad_job  # noqa: E402
from dflash_offline.generate.config import GenerateConfig  # noqa: E402
from dflash_offline.generate.events import WorkerStarted  # noqa: E402
from dflash_offline.generate.plan import PlanConfig, plan_jobs  # noqa: E402
from dflash_offline.generate.run import run_generate  # noqa: E402
from dflash_offline.placement import Placement  # noqa: E402
from dflash_offline.target_model.capture import FeatureCapture  # noqa: E402
from dflash_offline.target_model.layers import default_layer_ids  # noqa: E402
from dflash_offline.target_model.loader import load_target, load_tokenizer, resolve_target, target_info  # noqa: E402


def forward_rate(args: argparse.Namespace, layer_ids: tuple[int, ...]) -> tuple[float, int]:
    """Tokens/s of the truncated target alone on the run's own batches (real tokens, not padding)."""
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.target)
    records = iter_records(args.data, limit=args.records)
    jobs = [
        e.job
        for e in plan_jobs(
            records,
            lambda c: tokenize_conversation(tokenizer, c, max_length=args.max_len, too_long="truncate"),
            PlanConfig(
                bucket_edges=tuple(args.bucket_edges),
                tokens_per_batch=args.tokens_per_batch,
                max_batch_size=256,
                window_records=8192,
                seed=0,
            ),
        )
        if e.job is not None
    ]
    target = load_target(args.target, device=device, max_layer=max(layer_ids))
    capture = FeatureCapture(target, layer_ids)
    pad_id = tokenizer.pad_token_id or 0

    def run(selected: list) -> int:  # type: ignore[type-arg]
        tokens = 0
        with torch.inference_mode():
            for job in selected:
                padded = pad_job(job, pad_id=pad_id)
                capture(padded.input_ids_BS.to(device), padded.attention_mask_BS.to(device))
                tokens += job.num_tokens
        if device.type == "cuda":
            torch.cuda.synchronize()
        return tokens

    run(jobs[:2])  # warm-up: kernels, allocator
    start = time.perf_counter()
    tokens = run(jobs)
    seconds = time.perf_counter() - start
    return tokens / seconds, tokens


def disk_bandwidth(folder: Path, nbytes: int) -> float:
    """Sequential write of ``nbytes`` in 8 MiB blocks, fsync included (bytes/s)."""
    block = os.urandom(8 << 20)
    path = folder / "disk-probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return size / seconds


def _tree_rss(pid: int) -> int:
    """Sum of VmRSS (bytes) of ``pid`` and all its descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        stack.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def peak_rss_of_generate(args: argparse.Namespace, records: int, cache: Path) -> tuple[int, float]:
    """Run the CLI in a subprocess and sample its process tree's RSS every 0.2 s."""
    cmd = [
        sys.executable, "-m", "dflash_offline", "generate", "--cache", str(cache), "--target", args.target,
        "--limit", str(records), "--max-len", str(args.max_len), "--too-long", "truncate",
        "--tokens-per-batch", str(args.tokens_per_batch), "--no-progress",
        "--bucket-edges", ",".join(str(e) for e in args.bucket_edges),
    ]  # fmt: skip
    if args.data is not None:
        cmd += ["--data", str(args.data)]
    if args.layer_ids:
        cmd += ["--layer-ids", args.layer_ids]
    if args.codec:
        cmd += ["--codec", args.codec]
    cmd += ["--gpus", "0"] if args.device == "cuda" else ["--workers", "1"]
    start = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    stderr_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr_chunks.append(process.stderr.read()))  # type: ignore[union-attr]
    reader.start()
    while process.poll() is None:
        peak = max(peak, _tree_rss(process.pid))
        time.sleep(0.2)
    reader.join()
    if process.returncode != 0:
        raise RuntimeError(b"".join(stderr_chunks).decode()[-3000:])
    return peak, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="random:tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--data", type=Path, default=None, help="default: the embedded ShareGPT file")
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    parser.add_argument("--bucket-edges", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--layer-ids", default=None, help="e.g. 0,2 for random:tiny (4 layers)")
    parser.add_argument("--codec", default=None, help="feature codec (default: the cache library's)")
    parser.add_argument("--disk-bytes", type=int, default=1 << 30)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rss", action="store_true", help="also measure peak RSS for N and 4N records")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    info = target_info(resolve_target(args.target))
    if args.layer_ids:
        layer_ids = tuple(int(x) for x in args.layer_ids.split(","))
    elif info.num_layers < 8:
        layer_ids = (0, info.num_layers // 2)
        args.layer_ids = ",".join(str(i) for i in layer_ids)
    else:
        layer_ids = default_layer_ids(info.num_layers, 5)
    workdir = Path(tempfile.mkdtemp(prefix="bench-generate-", dir=args.workdir))
    results: dict[str, float] = {}
    try:
        fwd, _tokens = forward_rate(args, layer_ids)
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the forward-only model is gone; its memory goes back
        results["forward_tok_s"] = fwd
        results["disk_bytes_s"] = disk_bandwidth(workdir, args.disk_bytes)
        config = GenerateConfig(
            cache_dir=workdir / "cache",
            target=args.target,
            data=args.data,
            limit=args.records,
            max_length=args.max_len,
            too_long="truncate",
            layer_ids=layer_ids,
            bucket_edges=tuple(args.bucket_edges),
            tokens_per_batch=args.tokens_per_batch,
            codec=args.codec,
            progress=False,
            build_index=False,
            placement=Placement(gpus=(0,)) if args.device == "cuda" else Placement(num_cpu_workers=1),
        )
        # Time from the first committed job to the end: the worker's model load is a one-off cost
        # that a long run amortises (reported separately).
        worker_ready: list[float] = []
        started = time.perf_counter()
        summary = run_generate(
            config,
            on_event=lambda e: (
                worker_ready.append(time.perf_counter()) if isinstance(e, WorkerStarted) else None
            ),
        )
        wall = time.perf_counter() - started
        steady = wall - (worker_ready[0] - started if worker_ready else 0.0)
        results["e2e_tok_s"] = summary.tokens_committed / steady
        for w in summary.workers:
            t = w.timings
            print(
                f"worker {w.worker} ({w.device}): forward loop {t.forward_seconds:.1f} s, blocked on writer "
                f"{t.writer_wait_seconds:.1f} s, writer busy {t.write_seconds:.1f} s, waited for jobs "
                f"{t.job_wait_seconds:.1f} s, of {steady:.1f} s"
            )
        results["e2e_tok_s_incl_startup"] = summary.tokens_committed / wall
        results["stored_bytes_per_token"] = summary.stored_bytes / max(summary.tokens_committed, 1)
        results["raw_bytes_per_token"] = 2 * len(layer_ids) * info.hidden_size
        disk_tok_s = results["disk_bytes_s"] / results["stored_bytes_per_token"]
        results["disk_ceiling_tok_s"] = disk_tok_s
        ceiling = min(fwd, disk_tok_s)
        results["ratio_vs_forward"] = results["e2e_tok_s"] / fwd
        results["ratio_vs_disk"] = results["e2e_tok_s"] / disk_tok_s
        results["ratio_vs_ceiling"] = results["e2e_tok_s"] / ceiling
        results["tokens"] = summary.tokens_committed
        results["startup_s"] = wall - steady
        if args.rss:
            small = max(1, args.records // 4)
            rss_small, _ = peak_rss_of_generate(args, small, workdir / "rss-small")
            rss_large, _ = peak_rss_of_generate(args, 4 * small, workdir / "rss-large")
            results["peak_rss_small_GB"] = rss_small / 1e9
            results["peak_rss_large_GB"] = rss_large / 1e9
            results["rss_growth_ratio"] = rss_large / rss_small
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    r = results
    print(f"\ndflash generate bench: target {args.target} on {args.device}, {r['tokens']:.0f} tokens")
    print(f"  forward only        {r['forward_tok_s']:>12,.0f} tok/s")
    stored, raw = r["stored_bytes_per_token"], r["raw_bytes_per_token"]
    print(
        f"  disk write+fsync    {r['disk_bytes_s'] / 1e9:>12.2f} GB/s -> {r['disk_ceiling_tok_s']:,.0f} tok/s"
        f" at {stored:,.0f} stored B/token ({stored / raw:.2f} of raw)"
    )
    print(
        f"  end to end          {r['e2e_tok_s']:>12,.0f} tok/s "
        f"({r['e2e_tok_s_incl_startup']:,.0f} incl. {r['startup_s']:.1f} s start-up)"
    )
    print(f"  ratio vs forward    {r['ratio_vs_forward']:>12.2f}")
    print(f"  ratio vs disk       {r['ratio_vs_disk']:>12.2f}")
    print(f"  ratio vs min(both)  {r['ratio_vs_ceiling']:>12.2f}   (goal >= 0.9)")
    if "rss_growth_ratio" in r:
        print(
            f"  peak RSS N / 4N     {r['peak_rss_small_GB']:.2f} / {r['peak_rss_large_GB']:.2f} GB "
            f"(x{r['rss_growth_ratio']:.2f} for 4x the data)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
