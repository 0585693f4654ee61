"""Training data path benchmark: our Prefetcher vs per-sample ``torch.load`` of the same samples.

One run does it all:
1. builds a cache (``ShardWriter``, default codec) of ``--num-samples`` samples with realistic lengths
   (log-normal, median 512, clipped to 16..3072 tokens) and features of ``--feature-width`` (default
   5 × 576, SmolLM2-135M), and the same samples as one ``torch.save`` file each;
2. plans one epoch (``LengthMixingPlanner``, world size 1) and, in that plan's sample order, measures
   (a) a ``torch.load`` loop (one thread), (b) ``torch.load`` on a pool of ``--threads`` threads,
   (c) our ``Prefetcher`` (reads, decodes, packs, pins and copies to ``--device``), best of
   ``--repeats``; prints samples/s, GB/s (decoded bytes) and our ratio to (a) and (b);
3. with ``--simulated-step-ms`` or ``--step-hook``, runs the prefetcher under a training-like consumer
   and reports the data-wait fraction of step time (goal: < 2 %).

Features are random normals in bf16: the mantissa is as incompressible as real features, the exponent
a little more compressible (real SmolLM2 features store at ≈ 0.67–0.69 of raw:
docs/facts.md#compression). The page cache is warm (the files were just written) for every contender alike;
``--cold`` evicts each contender's files (``posix_fadvise(DONTNEED)``, only these files) before its pass, for
the regime of a cache larger than RAM.

GPU (the lead's run): ``--device cuda --feature-width 20480 --simulated-step-ms 400`` simulates a
drafter step at Qwen3-8B width: per microbatch the consumer touches the features on its stream, keeps
the GPU busy for step_ms / grad_accum with ``torch.cuda._sleep``, and synchronises at the end of each
step (as ``loss.item()`` would). ``--step-hook pkg.module:factory`` runs a real step instead:
``factory(feature_width=..., device=..., tokens_per_microbatch=...)`` returns a callable taking one
step's ``PackedMicrobatch`` list (``RankSteps.regroup``, as the loop takes them); it must synchronise at
the end of the step as a real loop does.

    .venv/bin/python bench/train_loader.py                      # CPU, ~1 GB of samples
    .venv/bin/python bench/train_loader.py --num-samples 64 --simulated-step-ms 50
"""

from __future__ import annotations

import argparse
import bisect
import importlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_offline.cache.codecs import codec_spec, storage_dtype
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter
from dflash_offline.train.loader import Prefetcher, in_place_feature_width
from dflash_offline.train.packing import HostBufferPool
from dflash_offline.train.planner import (
    LengthMixingPlanner,
    PackedMicrobatch,
    RankSteps,
    ScheduledMicrobatch,
    StepPlan,
    schedule_for_rank,
)
from dflash_offline.train.snapshot import IndexSnapshot, take_snapshot

EDGES = (256, 512, 1024, 2048, 4096)
_HOST_POOL = HostBufferPool(max_buffers=8)
StepFn = Callable[[list[PackedMicrobatch]], None]
"""One optimizer step over this rank's microbatches of the step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """One timed pass over the epoch's samples."""

    name: str
    seconds: float
    cpu_seconds: float
    """Process CPU time (all threads) spent: robust to other load on a shared machine."""
    num_samples: int
    num_bytes: int
    """Decoded bytes delivered (features + input_ids + loss_mask)."""

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_seconds / (self.num_bytes / 1e9)

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class WaitReport:
    """The prefetcher under a training-like consumer."""

    num_steps: int
    wall_s: float
    wait_s: float
    wait_fraction: float
    """Data wait ÷ wall time, all steps."""
    steady_wait_fraction: float
    """The same without the first step (which waits for the pipeline to fill)."""
    step_wait_p50_ms: float
    step_wait_max_ms: float


# ---- building the data --------------------------------------------------------------------------


def build(
    out: Path, *, num_samples: int, feature_width: int, codec: str, seed: int, encode_device: str = "cpu"
) -> int:
    """Write the cache under ``out/cache`` and one torch.save file per sample under ``out/torch``.
    ``encode_device``: where an fp8 codec's writer encodes (the features are handed over there)."""
    layers = 5 if feature_width % 5 == 0 else 1
    fingerprint = CacheFingerprint(
        target_id="bench:synthetic",
        weights_hash="0" * 16,
        num_target_layers=36,
        layer_ids=tuple(range(1, 1 + layers)),
        hidden_size=feature_width // layers,
        storage_dtype=storage_dtype(codec),
        codec=codec,
        tokenizer_hash="bench",
        chat_template_hash="bench",
        max_length=3072,
        too_long="skip",
        bucket_edges=EDGES,
        data_source="bench",
        compute_dtype="float32",
    )
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = np.clip(rng.lognormal(np.log(512), 0.8, num_samples), 16, 3072).astype(int)
    (out / "torch").mkdir(parents=True)
    total = 0
    with ShardWriter(out / "cache", fingerprint, worker=0) as writer:
        for i, num_tokens in enumerate(lengths.tolist()):
            features_TF = torch.randn(num_tokens, feature_width, generator=gen).to(torch.bfloat16)
            ids_T = rng.integers(0, 150_000, num_tokens).astype(np.int32)
            mask_T = (np.arange(num_tokens) > num_tokens // 3).astype(np.uint8)
            sample_id = f"bench:{i:06d}"
            writer.add(
                SampleToWrite(
                    sample_id=sample_id,
                    source_index=i,
                    input_ids_T=ids_T,
                    loss_mask_T=mask_T,
                    features_TF=features_TF.to(encode_device) if codec_spec(codec).fp8 else features_TF,
                    bucket_id=bisect.bisect_left(EDGES, num_tokens),
                )
            )
            torch.save(
                {
                    "input_ids": torch.from_numpy(ids_T),
                    "loss_mask": torch.from_numpy(mask_T),
                    "features": features_TF,
                },
                out / "torch" / f"{sample_id.replace(':', '_')}.pt",
            )
            total += num_tokens
    return total


# ---- contenders -----------------------------------------------------------------------------------


def evict(files: list[Path], cold: bool) -> None:
    """Drop these files (only these: the machine is shared) from the page cache for a cold read."""
    if not cold:
        return
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_one(path: Path) -> int:
    d = torch.load(path, weights_only=True)
    return int(d["features"].nbytes + d["input_ids"].nbytes + d["loss_mask"].nbytes)


def time_torch_load(paths: list[Path], threads: int) -> Throughput:
    start, cpu_start = time.perf_counter(), time.process_time()
    if threads == 1:
        num_bytes = sum(load_one(p) for p in paths)
    else:
        with ThreadPoolExecutor(threads) as pool:
            num_bytes = sum(pool.map(load_one, paths))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    name = "torch.load loop" if threads == 1 else f"torch.load × {threads} threads"
    return Throughput(
        name=name, seconds=seconds, cpu_seconds=cpu_seconds, num_samples=len(paths), num_bytes=num_bytes
    )


def make_prefetcher(
    reader: CacheReader, jobs: Iterable[ScheduledMicrobatch], args: argparse.Namespace
) -> Prefetcher:
    return Prefetcher(
        reader,
        jobs,
        device=torch.device(args.device),
        prefetch=args.prefetch,
        num_threads=args.threads,
        host_pool=_HOST_POOL,  # steady state: a training run keeps its buffers across epochs
    )


def time_prefetcher(
    reader: CacheReader, snap: IndexSnapshot, steps: list[StepPlan], args: argparse.Namespace
) -> Throughput:
    start, cpu_start = time.perf_counter(), time.process_time()
    jobs = schedule_for_rank(steps, rank=0, seed=args.seed, reader_rows_N=snap.reader_rows_N)
    with make_prefetcher(reader, jobs, args) as prefetcher:
        num_samples = num_bytes = 0
        for batch in prefetcher:
            num_samples += batch.num_documents
            num_bytes += batch.num_bytes
        if args.device == "cuda":
            torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return Throughput(
        name="Prefetcher",
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        num_samples=num_samples,
        num_bytes=num_bytes,
    )


# ---- training-like consumer ------------------------------------------------------------------------


def simulated_step(step_ms: float, device: torch.device) -> StepFn:
    """A stand-in for the drafter: busy for step_ms per optimizer step, split over its microbatches."""
    if device.type == "cuda":
        # Calibrate torch.cuda._sleep (clock cycles) against wall time once.
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(10_000_000)
        torch.cuda.synchronize()
        cycles_per_ms = 10_000_000 / ((time.perf_counter() - start) * 1e3)

    def run(batches: list[PackedMicrobatch]) -> None:
        per_microbatch_ms = step_ms / len(batches)
        for batch in batches:
            if device.type == "cuda":
                batch.inputs.features_TF.view(torch.int16).amax()  # reads the copy on the consumer's stream
                torch.cuda._sleep(int(per_microbatch_ms * cycles_per_ms))
            else:
                time.sleep(per_microbatch_ms / 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the loop's loss.item() / optimizer step

    return run


def load_hook(spec: str, args: argparse.Namespace) -> StepFn:
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    hook: StepFn = factory(
        feature_width=args.feature_width,
        device=torch.device(args.device),
        tokens_per_microbatch=args.tokens_per_microbatch,
    )
    return hook


def measure_wait(
    reader: CacheReader, snap: IndexSnapshot, steps: list[StepPlan], args: argparse.Namespace, step_fn: StepFn
) -> WaitReport:
    step_waits: dict[int, float] = {}
    start = time.perf_counter()
    first_step_end = None
    rank_steps = RankSteps(steps, rank=0, seed=args.seed, reader_rows_N=snap.reader_rows_N)
    with make_prefetcher(reader, rank_steps.jobs(), args) as prefetcher:
        for step, batches in rank_steps.regroup(prefetcher):
            step_waits[step.global_step] = sum(batch.data_wait_s for batch in batches)
            step_fn(batches)
            if first_step_end is None:
                first_step_end = time.perf_counter()
    end = time.perf_counter()
    wall = end - start
    waits = list(step_waits.values())
    assert first_step_end is not None
    steady_wall = end - first_step_end
    return WaitReport(
        num_steps=len(waits),
        wall_s=wall,
        wait_s=sum(waits),
        wait_fraction=sum(waits) / wall,
        steady_wait_fraction=sum(waits[1:]) / max(steady_wall, 1e-9),
        step_wait_p50_ms=statistics.median(waits) * 1e3,
        step_wait_max_ms=max(waits) * 1e3,
    )


# ---- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="work directory (default: a temporary one, removed after)")
    parser.add_argument("--num-samples", type=int, default=200)
    parser.add_argument("--feature-width", type=int, default=5 * 576)
    parser.add_argument(
        "--codec",
        default="blosc-zstd-1-shuffle",
        help="feature codec, e.g. none, fp8 (decoded on a CUDA device)",
    )
    parser.add_argument("--tokens-per-microbatch", type=int, default=8192)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="prefetch threads (and torch.load pool)")
    parser.add_argument("--reader-threads", type=int, default=4, help="CacheReader's own read pool")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cold", action="store_true", help="evict the files from the page cache before each pass"
    )
    parser.add_argument("--simulated-step-ms", type=float, default=0.0)
    parser.add_argument("--step-hook", help="pkg.module:factory returning a per-step callable")
    parser.add_argument("--epochs", type=int, default=1, help="epochs for the data-wait measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check-checksums",
        action="store_true",
        help="re-checksum every sample read (what dflash train does)",
    )
    args = parser.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="dflash-bench-loader-"))
    try:
        if not (out / "cache").exists():
            t0 = time.perf_counter()
            tokens = build(
                out,
                num_samples=args.num_samples,
                feature_width=args.feature_width,
                codec=args.codec,
                seed=args.seed,
                encode_device=args.device,
            )
            print(
                f"built {args.num_samples} samples, {tokens} tokens, width {args.feature_width} "
                f"in {time.perf_counter() - t0:.1f} s"
            )
        reader = CacheReader.open(
            out / "cache", num_threads=args.reader_threads, check_checksums=args.check_checksums
        )
        snap = take_snapshot(reader)
        planner = LengthMixingPlanner(
            snap,
            seed=args.seed,
            tokens_per_microbatch=args.tokens_per_microbatch,
            grad_accum=args.grad_accum,
            world_size=1,
        )
        steps = list(planner.iterate(1))
        in_place = in_place_feature_width(reader) is not None
        print(f"reader decodes into the packed buffer (features_out): {'yes' if in_place else 'no'}")
        if reader.storage.lossy is not None:
            on_device = torch.device(args.device).type == "cuda"
            print(
                f"codec {args.codec}: {reader.storage.row_bytes} stored bytes a token for "
                f"{2 * args.feature_width} of bf16; decoded "
                + ("on the GPU after the copy" if on_device else "by the reader (CPU)")
            )
        order = [sid for s in steps for mb in s.microbatches for sid in mb.sample_ids]
        paths = [out / "torch" / f"{sid.replace(':', '_')}.pt" for sid in order]
        raw_bytes = sum(p.stat().st_size for p in paths)
        stored = sum(f.stat().st_size for f in (out / "cache" / "shards").rglob("*") if f.is_file())
        print(
            f"{len(order)} samples, {len(steps)} steps of {args.grad_accum} microbatches ≤ "
            f"{args.tokens_per_microbatch} tokens; cache stores {stored / raw_bytes:.2f} × the torch files"
        )

        cache_files = [f for f in (out / "cache").rglob("*") if f.is_file()]

        def run_all() -> list[Throughput]:
            evict(paths, args.cold)
            results = [time_torch_load(paths, 1)]
            if args.threads > 1:
                evict(paths, args.cold)
                results.append(time_torch_load(paths, args.threads))
            evict(cache_files, args.cold)
            return [*results, time_prefetcher(reader, snap, steps, args)]

        run_all()  # warm-up: page cache, allocator, buffer pool, thread start-up
        contenders: dict[str, list[Throughput]] = {}
        for _ in range(args.repeats):  # interleaved, so that machine noise hits every contender
            for result in run_all():
                contenders.setdefault(result.name, []).append(result)
        best = {name: max(runs, key=lambda r: r.gb_per_s) for name, runs in contenders.items()}
        print(f"\n{'contender':<24}{'samples/s':>12}{'GB/s':>8}{'CPU s/GB':>10}   all runs GB/s")
        for name, result in best.items():
            runs = " ".join(f"{r.gb_per_s:.2f}" for r in contenders[name])
            cpu = min(r.cpu_s_per_gb for r in contenders[name])
            print(f"{name:<24}{result.samples_per_s:>12.0f}{result.gb_per_s:>8.2f}{cpu:>10.2f}   {runs}")
        ours = best["Prefetcher"].gb_per_s
        loop = best["torch.load loop"].gb_per_s
        pool = max(r.gb_per_s for r in best.values() if r.name.startswith("torch.load"))
        print(f"\nPrefetcher / torch.load loop = {ours / loop:.2f}×; / best torch.load = {ours / pool:.2f}×")
        report: dict[str, object] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "throughput": {
                name: [asdict(r) | {"gb_per_s": r.gb_per_s, "cpu_s_per_gb": r.cpu_s_per_gb} for r in runs]
                for name, runs in contenders.items()
            },
            "ratio_vs_torch_load_loop": ours / loop,
            "ratio_vs_best_torch_load": ours / pool,
            "in_place_reads": in_place,
        }

        if args.simulated_step_ms > 0 or args.step_hook:
            step_fn = (
                load_hook(args.step_hook, args)
                if args.step_hook
                else simulated_step(args.simulated_step_ms, torch.device(args.device))
            )
            wait_steps = list(planner.iterate(args.epochs))
            wait = measure_wait(reader, snap, wait_steps, args, step_fn)
            print(
                f"\nunder a {'hooked' if args.step_hook else f'{args.simulated_step_ms:g} ms'} step: "
                f"{wait.num_steps} steps in {wait.wall_s:.1f} s, data wait {wait.wait_fraction:.2%} of step "
                f"time ({wait.steady_wait_fraction:.2%} after the first step); per-step wait p50 "
                f"{wait.step_wait_p50_ms:.2f} ms, max {wait.step_wait_max_ms:.1f} ms"
            )
            report["wait"] = asdict(wait)
        reader.close()
        if args.out is not None:
            (out / "train_loader.json").write_text(json.dumps(report, indent=2))
            print(f"\nreport: {out / 'train_loader.json'}")
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
