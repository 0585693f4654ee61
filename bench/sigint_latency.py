"""Seconds from SIGINT to exit of ``dflash generate`` and ``dflash regenerate``, side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/sigint_latency.py [--target random:tiny] [--records 400]
        [--repeats 3] [--gpus 0] [--batch-size 2] [--max-new-tokens 64] [--max-prompt-tokens 512]
        [--layer-ids 0,2] [--commands generate,regenerate]

Each command starts the way a script starts a background job (``cmd &`` in a non-interactive shell:
SIGINT inherited as ignored), writes some output (generate: its first committed manifest part;
regenerate: its first finished conversations), then gets one SIGINT, to its own pid, as
``kill -INT $pid`` would send it. Printed per run: the exit status (130 is a clean stop), the seconds
from the signal to the exit, and how much of the work was done (a stop that waited for the end of
the run would show all of it). The data is chat JSONL of random words (``--records``, two turns
each); ``--gpus`` passes through to both commands (default: the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
]


def write_data(path: Path, records: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(records):
            messages = []
            for _ in range(2):
                messages.append(
                    {"role": "user", "content": " ".join(rng.choice(WORDS, int(rng.integers(8, 60))))}
                )
                messages.append(
                    {"role": "assistant", "content": " ".join(rng.choice(WORDS, int(rng.integers(20, 200))))}
                )
            f.write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")
    return path


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def measure(cmd: list[str], started: Callable[[], bool], done_count: Callable[[], int]) -> dict[str, float]:
    """Start ``cmd`` with SIGINT ignored, SIGINT it once ``started()``, time the exit."""
    process = subprocess.Popen(
        cmd, preexec_fn=_ignore_sigint, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    while process.poll() is None and not started():
        time.sleep(0.01)
    if process.poll() is not None:
        raise SystemExit(
            f"{cmd[3]} ended before it could be interrupted; raise --records\n"
            + process.stdout.read().decode()[-2000:]
        )  # type: ignore[union-attr]
    at_signal = done_count()
    sent = time.perf_counter()
    os.kill(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    seconds = time.perf_counter() - sent
    return {
        "exit": float(process.returncode),
        "seconds": seconds,
        "at_signal": at_signal,
        "kept": done_count(),
    }


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _committed(cache: Path) -> int:
    import pyarrow.parquet as pq

    parts = list((cache / "manifest" / "samples").glob("*.parquet"))
    return sum(pq.read_metadata(p).num_rows for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="random:tiny")
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", default=None)
    parser.add_argument("--batch-size", type=int, default=2, help="regenerate's --batch-size")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--layer-ids", default="0,2", help="generate's --layer-ids (random:tiny has 4 layers)"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--commands", default="generate,regenerate", help="which of the two to measure")
    args = parser.parse_args()
    commands = args.commands.split(",")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sigint-latency-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work / "chat.jsonl", args.records)
    where = ["--gpus", args.gpus] if args.gpus else ["--threads", "1"]
    dflash = [sys.executable, "-m", "dflash_offline"]
    rows: dict[str, list[dict[str, float]]] = {"generate": [], "regenerate": []}
    for run in range(args.repeats):  # alternated: a shared machine's load hits both alike
        cache = work / f"cache{run}"
        if "generate" in commands:
            rows["generate"].append(measure(
                [*dflash, "generate", "--cache", str(cache), "--target", args.target, "--data", str(data),
                 "--layer-ids", args.layer_ids, "--flush-seconds", "0.2", "--no-progress", *where],
                started=lambda c=cache: _committed(c) > 0,
                done_count=lambda c=cache: _committed(c),
            ))  # fmt: skip
        out = work / f"answers{run}.jsonl"
        if "regenerate" in commands:
            rows["regenerate"].append(measure(
                [*dflash, "regenerate", "--out", str(out), "--target", args.target, "--data", str(data),
                 "--batch-size", str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens),
                 "--max-prompt-tokens", str(args.max_prompt_tokens), "--no-progress", *where],
                started=lambda o=out: _lines(o) >= 1,
                done_count=lambda o=out: _lines(o),
            ))  # fmt: skip
    print(f"target {args.target}, {args.records} records, {'--gpus ' + args.gpus if args.gpus else 'CPU'}")
    print("| command | exit status | SIGINT → exit (s), each run | median | done at SIGINT → kept |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        if not runs:
            continue
        statuses = ",".join(str(int(r["exit"])) for r in runs)
        each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        median = statistics.median(r["seconds"] for r in runs)
        kept = ", ".join(f"{int(r['at_signal'])} → {int(r['kept'])}" for r in runs)
        unit = "samples" if name == "generate" else "conversations"
        print(f"| {name} | {statuses} | {each} | {median:.2f} | {kept} {unit} of {args.records} |")


if __name__ == "__main__":
    main()
