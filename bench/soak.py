"""Soak test of ``dflash generate`` under SIGKILL: many random kill points, each followed by the same
command, then a check against an uninterrupted run.

Kill modes, in turn: the whole process group, the coordinator only (its workers must die with it),
one worker (the coordinator must stop by itself). Each kill lands a random 0..--max-delay seconds
after the run's first worker opened its shard group (start-up, forwards, writes and commits alike).
After every kill no process of that run may survive (--orphan-timeout). At the end one run finishes
the cache, and it must equal the reference: 0 lost, 0 duplicated, bit-equal features, verify clean.

    PYTHONPATH=. python bench/soak.py --kills 50
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.cache.manifest import read_table  # noqa: E402
from dflash_offline.cache.reader import CacheReader  # noqa: E402
from dflash_offline.cache.verify import verify_cache  # noqa: E402
from tests.cache._samples import bits  # noqa: E402
from tests.generate.helpers import make_chat_jsonl  # noqa: E402
from tests.process_helpers import group_members, workers_of  # noqa: E402

MODES = ("group", "coordinator", "worker")


def generate_cmd(cache: Path, data: Path, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "dflash_offline", "generate", "--cache", str(cache), "--target", "random:tiny",
        "--data", str(data), "--layer-ids", "0,2", "--max-len", "256", "--too-long", "truncate",
        "--bucket-edges", "48,96,160,256", "--tokens-per-batch", "512", "--window", "30", "--threads", "1",
        "--flush-seconds", "0.5", "--no-progress", "--workers", str(workers),
    ]  # fmt: skip


def features_by_id(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    with CacheReader.open(root) as reader:
        samples = reader.read([str(s) for s in reader.samples.sample_id])
        return {
            s.sample_id: (bits(s.features_TF), s.input_ids_T.numpy(), s.loss_mask_T.numpy()) for s in samples
        }


def one_kill(
    cmd: list[str], cache: Path, mode: str, rng: np.random.Generator, args: argparse.Namespace
) -> str:
    """Start a run, kill it as ``mode`` says; returns what happened (``killed``, ``finished``)."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = cache / "manifest" / "shards"
    known = set(shards.glob("*.parquet")) if shards.is_dir() else set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if shards.is_dir() and set(shards.glob("*.parquet")) - known:
            break
        time.sleep(0.05)
    time.sleep(float(rng.uniform(0.0, args.max_delay)))
    if proc.poll() is not None:
        return "finished"
    workers = workers_of(proc.pid)
    if mode == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    elif mode == "coordinator":
        os.kill(proc.pid, signal.SIGKILL)
    else:
        if not workers:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(int(rng.choice(workers)), signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=args.orphan_timeout)
    end = time.monotonic() + args.orphan_timeout
    while time.monotonic() < end and group_members(proc.pid):
        time.sleep(0.1)
    survivors = group_members(proc.pid)
    if survivors:
        os.killpg(proc.pid, signal.SIGKILL)
        return f"orphans:{len(survivors)}"
    return "killed"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-delay", type=float, default=3.0)
    parser.add_argument("--orphan-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    work = Path(args.dir or tempfile.mkdtemp(prefix="dflash-soak-"))
    shutil.rmtree(work / "killed", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    data = make_chat_jsonl(work / "chat.jsonl", args.records, seed=7)
    started = time.monotonic()
    reference = work / "reference"
    if not (reference / "cache.json").exists():
        subprocess.run(generate_cmd(reference, data, 1), check=True, capture_output=True, timeout=900)
    cache = work / "killed"
    cmd = generate_cmd(cache, data, args.workers)
    want = features_by_id(reference)
    counts = {mode: 0 for mode in MODES}
    totals = {"lost": 0, "duplicated": 0, "differ": 0, "damaged": 0, "rounds": 0}
    orphans = finished_early = 0
    kills = 0

    def check() -> None:
        """Finish the cache with the same command, compare it with the reference, start over."""
        final = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert final.returncode == 0, final.stdout + final.stderr
        ids = read_table(cache, "samples", ["sample_id"])["sample_id"].to_pylist()
        got = features_by_id(cache)
        totals["lost"] += len(set(want) - set(got))
        totals["duplicated"] += len(ids) - len(set(ids))
        totals["differ"] += sum(
            1
            for k in set(want) & set(got)
            if not all(np.array_equal(a, b) for a, b in zip(want[k], got[k], strict=True))
        )
        totals["damaged"] += 0 if verify_cache(cache, progress=False).ok else 1
        totals["rounds"] += 1
        shutil.rmtree(cache)

    while kills < args.kills:
        mode = MODES[kills % len(MODES)]
        outcome = one_kill(cmd, cache, mode, rng, args)
        if outcome == "finished":
            finished_early += 1
            check()
            continue
        kills += 1
        counts[mode] += 1
        if outcome.startswith("orphans"):
            orphans += int(outcome.split(":")[1])
        has_cache = (cache / "cache.json").exists()
        committed = read_table(cache, "samples", ["sample_id"]).num_rows if has_cache else 0
        print(f"kill {kills:3d} ({mode:11s}): {outcome}, {committed} rows committed", flush=True)
        if committed >= len(want):
            check()  # nothing left to interrupt: check this cache and start a new one
    if cache.exists():
        check()
    lost, duplicated, differ = totals["lost"], totals["duplicated"], totals["differ"]
    wall = time.monotonic() - started
    print()
    print("| kills (group / coordinator / worker) | runs finished before the kill | lost | duplicated | "
          "features differing | orphan processes | caches checked, verify | wall time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {kills} ({counts['group']} / {counts['coordinator']} / {counts['worker']}) | {finished_early} | "
        f"{lost} | {duplicated} | {differ} | {orphans} | {totals['rounds']}, {totals['damaged']} damaged | "
        f"{wall:.0f} s |"
    )
    if lost or duplicated or differ or orphans or totals["damaged"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
