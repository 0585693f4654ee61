"""Soak test of `dflash train` crash safety: many random kills of one run, then the same command.

For each world size (one process; two spawned CPU DDP workers) it trains an uninterrupted reference,
then starts the same command again and again, each time killing it at a random step and a random
moment inside the next one, with a random fault: SIGKILL of the whole process group, SIGKILL of the
coordinator alone (DDP only: its workers must not outlive it), or Ctrl-C (SIGINT: exit 130 with a
checkpoint). Finally it runs the command to the end and compares the loss sequence and the final
weights with the reference, bit for bit (--deterministic), and counts processes that outlived a kill.

    PYTHONPATH=. .venv/bin/python bench/soak_train.py --kills 20
    PYTHONPATH=. .venv/bin/python bench/soak_train.py --kills 6 --workers 1   # quicker
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
from pathlib import Path

import torch

from dflash_offline.generate.run import run_generate
from dflash_offline.train.checkpoint import list_checkpoints
from dflash_offline.train.metrics import read_metrics
from tests.generate.helpers import make_chat_jsonl, tiny_config
from tests.train.kill_helpers import last_step, run_and_kill, run_to_end, train_cmd


def _losses(run: Path) -> list[float]:
    return [float(m["loss"]) for m in read_metrics(run / "metrics.jsonl")]  # type: ignore[arg-type]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    _step, path = list_checkpoints(run)[-1]
    return torch.load(path / "state.pt", map_location="cpu", weights_only=False)["model"]


def soak(cache: Path, work: Path, *, workers: int, kills: int, steps: int, rng: random.Random) -> dict:
    reference = work / f"reference-w{workers}"
    run_to_end(train_cmd(cache, reference, steps=steps, workers=workers, checkpoint_every=4))
    run = work / f"soaked-w{workers}"
    cmd = train_cmd(cache, run, steps=steps, workers=workers, checkpoint_every=4)
    faults = ["group-sigkill", "sigint"] + (["coordinator-sigkill"] if workers > 1 else [])
    rows = []
    for i in range(kills):
        fault = rng.choice(faults)
        # Past the lines a killed run left beyond its checkpoint (the rerun drops them on start).
        done = max([s for s, _ in list_checkpoints(run)] + [last_step(run)], default=0)
        if done >= steps - 2:
            break
        point = min(steps - 2, done + rng.randint(1, 3))  # a few steps on: many kills fit in one run
        start = time.perf_counter()
        record = run_and_kill(
            cmd,
            run,
            kill_after_step=point,
            sig=signal.SIGINT if fault == "sigint" else signal.SIGKILL,
            whole_group=fault != "coordinator-sigkill",
            extra_delay=rng.uniform(0.0, 0.4),
        )
        rows.append(
            dict(
                kill=i + 1,
                fault=fault,
                after_step=record.at_step,
                checkpoint=record.checkpoint,
                returncode=record.returncode,
                survivors=record.survivors,
                seconds=round(time.perf_counter() - start, 1),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    run_to_end(cmd)
    same_losses = _losses(run) == _losses(reference)
    a, b = _weights(reference), _weights(run)
    same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps_logged = [int(m["step"]) for m in read_metrics(run / "metrics.jsonl")]  # type: ignore[call-overload]
    return dict(
        workers=workers,
        kills=len(rows),
        by_fault={f: sum(r["fault"] == f for r in rows) for f in faults},
        sigint_exit_130=all(r["returncode"] == 130 for r in rows if r["fault"] == "sigint"),
        survivors=sum(r["survivors"] for r in rows),
        steps_complete=steps_logged == list(range(1, steps + 1)),
        same_losses=same_losses,
        same_weights=same_weights,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=20, help="kills per world size")
    parser.add_argument("--workers", default="1,2", help="world sizes to soak, comma-separated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="dflash-soak-train-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cache = work / "cache"
        if not cache.exists():
            data = make_chat_jsonl(work / "chat.jsonl", 80, seed=5)
            run_generate(tiny_config(cache, data))
        results = [
            soak(cache, work, workers=int(w), kills=args.kills, steps=args.steps, rng=rng)
            for w in args.workers.split(",")
        ]
    for result in results:
        print(json.dumps(result))
    ok = all(r["same_losses"] and r["same_weights"] and r["steps_complete"] for r in results)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
