"""Start-up cost of ``dflash train`` on a large index: seconds from process start to the first
optimizer step, on 100k and 1M samples, side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/startup.py [--sizes 100000,1000000] [--profile 1000000]
        [--baseline main --repeats 5]

A small real cache is written once by ``dflash generate`` (random:tiny target, a few hundred short
conversations); each index is then a copy of it whose manifest holds N rows, written through the cache
library's manifest writer, that point at those real shard bytes again and again under distinct
sample ids (the reader accepts overlapping rows; only ``dflash verify`` would object). ``dflash train``
runs as a subprocess with a 1-layer drafter; the first optimizer step is the moment its first
``metrics.jsonl`` line appears (polled every 5 ms). Also timed: the same start-up of an interpreter
that only imports the CLI (the floor no index size changes). ``--profile N`` prints a cProfile of
an in-process run on the N-sample index (the top entries by cumulative time). ``--baseline REF``
also times the package as of git commit REF (``git archive`` into the work folder) on the same
indexes, the two alternated run by run (a shared machine's load hits both alike); figures are then
medians of ``--repeats`` (best of them without a baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.manifest import read_parts, write_part
from dflash_offline.generate.config import GenerateConfig
from dflash_offline.generate.run import run_generate
from dflash_offline.placement import Placement

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
]
TRAIN_ARGS = [
    "--num-layers", "1", "--block-size", "8", "--num-anchors", "32", "--tokens-per-microbatch", "2048",
    "--grad-accum", "1", "--max-steps", "1", "--checkpoint-every", "1000", "--loader-threads", "2",
]  # fmt: skip


def write_chat(path: Path, num_records: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(num_records):
            messages = [
                {"role": "user", "content": " ".join(rng.choice(WORDS, int(rng.integers(2, 12))))},
                {"role": "assistant", "content": " ".join(rng.choice(WORDS, int(rng.integers(4, 40))))},
            ]
            f.write(json.dumps({"id": f"rec-{i}", "messages": messages}) + "\n")


def base_cache(workdir: Path, num_records: int) -> Path:
    data = workdir / "chat.jsonl"
    write_chat(data, num_records)
    root = workdir / "base"
    run_generate(
        GenerateConfig(
            cache_dir=root,
            target="random:tiny",
            data=data,
            layer_ids=(0, 2),
            max_length=256,
            too_long="truncate",
            bucket_edges=(32, 64, 128, 256),
            tokens_per_batch=4096,
            progress=False,
            placement=Placement(num_cpu_workers=1, threads_per_worker=1),
        )
    )
    return root


def expanded_cache(base: Path, num_samples: int, workdir: Path) -> Path:
    """A copy of ``base`` whose manifest has ``num_samples`` rows cycling over its real samples."""
    root = workdir / f"index-{num_samples}"
    shutil.copytree(base, root, ignore=shutil.ignore_patterns("index.duckdb"))
    layout = CacheLayout.at(root)
    parts = layout.parts("samples")
    rows = read_parts("samples", parts)
    for part in parts:
        part.unlink()
    take = np.arange(num_samples) % rows.num_rows
    big = rows.take(pa.array(take))
    ids = pa.array([f"bench:{i:08d}" for i in range(num_samples)], pa.string())
    big = big.set_column(big.schema.get_field_index("sample_id"), "sample_id", ids)
    big = big.set_column(
        big.schema.get_field_index("source_index"), "source_index", pa.array(np.arange(num_samples))
    )
    write_part(layout.part_path("samples", "bench", 0), big, fsync=False)
    return root


def time_to_first_step(cache: Path, out: Path, code: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    metrics = out / "metrics.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_offline",
            "train",
            "--cache",
            str(cache),
            "--out",
            str(out),
            *TRAIN_ARGS,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        while not (metrics.exists() and metrics.stat().st_size > 0):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"dflash train exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
                )  # type: ignore[union-attr]
            if time.perf_counter() - start > 600:
                raise RuntimeError("no first step within 600 s")
            time.sleep(0.005)
        return time.perf_counter() - start
    finally:
        proc.wait(timeout=600)


def import_floor(code: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import dflash_offline.cli, dflash_offline.train.trainer"],
        check=True,
        timeout=300,
        env=env,
    )
    return time.perf_counter() - start


def baseline_tree(ref: str, workdir: Path) -> Path:
    """The package as of commit ``ref``, unpacked under ``workdir``."""
    folder = workdir / "baseline-code"
    folder.mkdir()
    archive = subprocess.run(
        ["git", "archive", ref, "dflash_offline"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def report(name: str, results: dict[int, float], floor: float) -> None:
    print(f"{name}: interpreter + imports alone {floor:.2f} s")
    print(f"{'samples':>10s} {'first step (s)':>15s} {'minus imports':>14s} {'per 1M over the first':>24s}")
    first = min(results)
    for n, t in results.items():
        ratio = (
            ""
            if n == first
            else f"{(t - floor) / (results[first] - floor):.2f}× for {n / first:.0f}× samples"
        )
        print(f"{n:10d} {t:15.2f} {t - floor:14.2f} {ratio:>24s}")


def profile(cache: Path, out: Path) -> None:
    import cProfile
    import pstats

    from click.testing import CliRunner

    from dflash_offline.cli import main as cli_main

    profiler = cProfile.Profile()
    profiler.enable()
    result = CliRunner().invoke(cli_main, ["train", "--cache", str(cache), "--out", str(out), *TRAIN_ARGS])
    profiler.disable()
    assert result.exit_code == 0, result.output
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[100_000, 1_000_000]
    )
    parser.add_argument("--base-records", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", type=int, default=None, help="cProfile an in-process run on this size")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--baseline", default=None, help="also time this git commit's package, alternated")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dflash-startup-", dir=args.workdir))
    try:
        base = base_cache(workdir, args.base_records)
        caches = {
            n: expanded_cache(base, n, workdir) for n in sorted(set(args.sizes) | ({args.profile} - {None}))
        }
        codes = {"this tree": Path.cwd()}
        if args.baseline:
            codes = {f"baseline ({args.baseline})": baseline_tree(args.baseline, workdir), **codes}
        pick = statistics.median if args.baseline else min
        floors: dict[str, list[float]] = {name: [] for name in codes}
        times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.sizes} for name in codes}
        for r in range(args.repeats):
            for name, code in codes.items():  # alternated: the machine's load hits every variant alike
                floors[name].append(import_floor(code))
                for n in args.sizes:
                    out = workdir / f"run-{n}-{r}"
                    times[name][n].append(time_to_first_step(caches[n], out, code))
                    shutil.rmtree(out, ignore_errors=True)
        print(f"dflash train start-up, {os.cpu_count()} CPUs, {pick.__name__} of {args.repeats} runs each")
        for name in codes:
            report(name, {n: pick(ts) for n, ts in times[name].items()}, pick(floors[name]))
        if args.baseline:
            (base, *_), this = codes, "this tree"
            for n in args.sizes:
                ratio = pick(times[this][n]) / pick(times[base][n])
                print(f"{n:10d} samples: this tree / baseline = {ratio:.2f}")
            for name in codes:
                for n in args.sizes:
                    print(f"  {name}, {n}: runs (s) {' '.join(f'{t:.2f}' for t in times[name][n])}")
        if args.profile:
            profile(caches[args.profile], workdir / "run-profile")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
