"""``dflash train --follow`` beside ``dflash generate --window-limit`` against generate-then-train on the
same data, side by side in one run (docs/follow.md).

Both ways train every training sample ``--passes`` times with the same settings; the figure is the wall time
from the first command's start until every sample had its passes (training's end), and the ratio follow /
sequential. Sequential: ``dflash generate`` into a plain cache, then ``dflash train --epochs PASSES``. Follow:
both commands at once, generate bounded by ``--window-limit``, train retiring what it trained. Also printed:
the steps each way took (follow plans each segment on its own, so its last steps of a segment may be fuller or
emptier) and the wall time each way took to the step both reached, the start-up of each training run (each
segment's under ``--follow``: from its start to the end of its first step, the ``startup_seconds`` of its
metrics), how long each side waited for the other (the cache's ``waits``), and the peak of the window measured
by the manifest. With ``--eval-args``, each way's final drafter then runs ``dflash eval`` on the same held-out
prompts (say, ``"--bench mt-bench,humaneval --limit 20 --max-new-tokens 256"`` with ``--target default``;
bench/RESULTS.md has the run with held-out ShareGPT records too), and its τ is printed beside the other's: the
held-out quality each way reached with the same passes over the same data.

  python bench/follow.py                  # CPU: random:tiny, 240 generated chat records, 2 passes
  python bench/follow.py --target default --data bench/answers/answers-00.jsonl.gz --records 4096 \\
      --window-limit 2GB --gpus-generate 0 --gpus-train 0   # one GPU for both commands
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.cache.manifest import read_table  # noqa: E402
from dflash_offline.cache.window import window_usage  # noqa: E402
from dflash_offline.train.metrics import read_metrics  # noqa: E402
from tests.generate.helpers import make_chat_jsonl  # noqa: E402


def generate_cmd(args: argparse.Namespace, cache: Path, data: Path, *extra: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "dflash_offline", "generate", "--cache", str(cache), "--target", args.target,
        "--data", str(data), "--max-len", str(args.max_len), "--too-long", "truncate",
        "--tokens-per-batch", str(args.tokens_per_batch), "--no-progress", "--no-decontaminate",
    ]  # fmt: skip
    if args.data is not None:
        cmd += ["--limit", str(args.records)]  # the first --records records of the given data
    if args.target.startswith("random:tiny"):
        cmd += ["--layer-ids", "0,2", "--bucket-edges", "48,96,160,256"]
    cmd += ["--gpus", args.gpus_generate] if args.gpus_generate else ["--workers", str(args.workers)]
    return cmd + list(extra)


def train_cmd(args: argparse.Namespace, cache: Path, run: Path, *extra: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "dflash_offline", "train", "--cache", str(cache), "--out", str(run),
        "--val-fraction", str(args.val_fraction), "--val-every", "100000", "--no-progress",
        "--checkpoint-every", str(args.checkpoint_every), "--no-tensorboard",
    ]  # fmt: skip
    if args.target.startswith("random:tiny"):
        cmd += [
            "--num-layers",
            "1",
            "--block-size",
            "8",
            "--num-anchors",
            "32",
            "--tokens-per-microbatch",
            "600",
        ]
    cmd += ["--gpus", args.gpus_train] if args.gpus_train else ["--threads", "1"]
    return cmd + list(extra)


def run_cmd(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:5])} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def final_drafter(run: Path) -> Path:
    """A run's exported drafter at its end (its best-validation export, else its last); for a follow run,
    its last segment's."""
    segments = sorted((run / "segments").glob("[0-9]*"))
    for name in ("drafter", "drafter-last"):
        path = (segments[-1] if segments else run) / name
        if (path / "config.json").is_file():
            return path
    raise SystemExit(f"no exported drafter in {run}")


def held_out_tau(args: argparse.Namespace, run: Path, out: Path) -> dict[str, float | None]:
    """τ of ``run``'s final drafter on ``--eval-args``' held-out prompts: each set's, and their mean."""
    cmd = [
        sys.executable, "-m", "dflash_offline", "eval", "--target", args.target,
        "--drafter", str(final_drafter(run)), "--json", str(out), "--no-progress",
        *shlex.split(args.eval_args),
    ]  # fmt: skip
    run_cmd(cmd)
    report = json.loads(out.read_text())
    taus: dict[str, float | None] = {s["name"]: s["tau"] for s in report["sets"]}
    return {**taus, "mean": report["mean"]["tau"]}


def logged_steps(run: Path) -> int:
    """The optimizer steps a run has logged so far: its ``metrics.jsonl``'s last step, or under ``--follow``
    the sum over its segments (each numbers its steps from 1). A line still being written is skipped."""
    total = 0
    for path in [run / "metrics.jsonl", *sorted((run / "segments").glob("*/metrics.jsonl"))]:
        last = 0
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    last = max(last, int(json.loads(line)["step"]))
        total += last
    return total


class StepClock:
    """When a run reached each step: polls its logged steps (``--log-every`` is 1 here, the default) every
    0.25 s from the way's start, so that both ways can be timed to the same step."""

    def __init__(self, run: Path, start: float) -> None:
        self.run, self.start = run, start
        self.seen: list[tuple[int, float]] = []  # (steps logged, seconds since start), steps rising
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            stopping = self._done.wait(0.25)
            steps = logged_steps(self.run)
            if steps > (self.seen[-1][0] if self.seen else 0):
                self.seen.append((steps, time.perf_counter() - self.start))
            if stopping:
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def seconds_to(self, step: int) -> float:
        """Seconds from the start until ``step`` was logged (to the poll's 0.25 s)."""
        return next(seconds for steps, seconds in self.seen if steps >= step)


def sequential(args: argparse.Namespace, data: Path, folder: Path) -> tuple[dict[str, float], StepClock]:
    cache, out = folder / "cache", folder / "run"
    start = time.perf_counter()
    clock = StepClock(out, start)
    run_cmd(generate_cmd(args, cache, data))
    generated = time.perf_counter() - start
    run_cmd(train_cmd(args, cache, out, "--epochs", str(args.passes)))
    wall = time.perf_counter() - start
    clock.stop()
    metrics = read_metrics(out / "metrics.jsonl")
    steps = int(metrics[-1]["step"])  # type: ignore[call-overload]
    return {
        "wall_s": wall,
        "generate_s": generated,
        "steps": steps,
        "startup_s": startup_seconds(metrics),
    }, clock


def startup_seconds(metrics: list[dict[str, object]]) -> float:
    """A run's start-up to the end of its first step (``startup_seconds`` of the first line an invocation
    writes; these runs are never resumed, so there is one)."""
    return sum(float(m["startup_seconds"]) for m in metrics if "startup_seconds" in m)  # type: ignore[arg-type]


def follow(args: argparse.Namespace, data: Path, folder: Path) -> tuple[dict[str, float], StepClock]:
    cache, out = folder / "cache", folder / "run"
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if (cache / "cache.json").exists():
                peak[0] = max(peak[0], window_usage(cache).stored_bytes)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    clock = StepClock(out, start)
    window = ("--window-limit", args.window_limit, "--val-fraction", str(args.val_fraction))
    generate = subprocess.Popen(
        generate_cmd(args, cache, data, *window), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    train = subprocess.Popen(
        train_cmd(args, cache, out, "--follow", "--passes", str(args.passes)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    outputs = [p.communicate()[0].decode() for p in (generate, train)]
    wall = time.perf_counter() - start
    done.set()
    clock.stop()
    for process, output in zip((generate, train), outputs, strict=True):
        if process.returncode != 0:
            raise SystemExit(output[-3000:])
    waits = read_table(cache, "waits").to_pydict()
    waited = {side: 0.0 for side in ("generate", "train")}
    for side, seconds in zip(waits["side"], waits["seconds"], strict=True):
        waited[side] += seconds
    segments = [read_metrics(m) for m in sorted((out / "segments").glob("*/metrics.jsonl"))]
    steps = sum(int(m[-1]["step"]) for m in segments)  # type: ignore[call-overload]
    startups = [startup_seconds(m) for m in segments]
    return {
        "wall_s": wall,
        "steps": steps,
        "segments": len(segments),
        "startup_s": sum(startups),
        "first_startup_s": startups[0],
        "later_startup_s": sum(startups[1:]) / max(1, len(startups) - 1),
        "generate_waited_s": waited["generate"],
        "train_waited_s": waited["train"],
        "peak_window_bytes": peak[0],
    }, clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="random:tiny")
    parser.add_argument("--data", type=Path, default=None, help="chat data (default: generated records)")
    parser.add_argument("--records", type=int, default=240, help="records generated, or read from --data")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--tokens-per-batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--gpus-generate", default="")
    parser.add_argument("--gpus-train", default="")
    parser.add_argument("--window-limit", default="1MB")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument(
        "--eval-args",
        default="",
        help="dflash eval's flags for both final drafters (held-out τ side by side; default: no eval)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-follow-bench-") as tmp:
        folder = Path(tmp)
        data = args.data or make_chat_jsonl(folder / "chat.jsonl", args.records, seed=0)
        seq, seq_clock = sequential(args, data, folder / "sequential")
        fol, fol_clock = follow(args, data, folder / "follow")
        taus = (
            {
                way: held_out_tau(args, folder / way / "run", folder / f"eval-{way}.json")
                for way in ("sequential", "follow")
            }
            if args.eval_args
            else {}
        )
    ratio = fol["wall_s"] / seq["wall_s"]
    print(f"{'':28}{'generate, then train':>22}{'train --follow':>18}{'ratio':>8}")
    print(f"{'wall time to every pass (s)':28}{seq['wall_s']:22.1f}{fol['wall_s']:18.1f}{ratio:8.3f}")
    step_ratio = fol["steps"] / seq["steps"]
    print(f"{'optimizer steps':28}{seq['steps']:22.0f}{fol['steps']:18.0f}{step_ratio:8.3f}")
    # Follow's segments each end on a partial step, so it takes more steps for the same passes: the time
    # to the step both reached compares the two at the same number of optimizer updates.
    same = int(min(seq["steps"], fol["steps"]))
    seq_to, fol_to = seq_clock.seconds_to(same), fol_clock.seconds_to(same)
    label = f"wall time to step {same} (s)"
    print(f"{label:28}{seq_to:22.1f}{fol_to:18.1f}{fol_to / seq_to:8.3f}")
    startup_ratio = fol["startup_s"] / seq["startup_s"]
    print(f"{'training start-up (s)':28}{seq['startup_s']:22.1f}{fol['startup_s']:18.1f}{startup_ratio:8.3f}")
    print(
        f"--follow trained {fol['segments']:.0f} segments: start-up to the end of the first step "
        f"{fol['first_startup_s']:.2f} s in the first, {fol['later_startup_s']:.2f} s a segment after it"
    )
    print(
        f"generate alone took {seq['generate_s']:.1f} s; under --follow generate waited "
        f"{fol['generate_waited_s']:.1f} s for room, training {fol['train_waited_s']:.1f} s for stores; the "
        f"window peaked at {fol['peak_window_bytes'] / 1e6:.3f} MB (--window-limit {args.window_limit})"
    )
    for name, seq_tau in taus.get("sequential", {}).items():
        fol_tau = taus["follow"][name]
        ratio_text = f"{fol_tau / seq_tau:8.3f}" if fol_tau is not None and seq_tau else f"{'–':>8}"
        print(f"{'held-out τ, ' + name:28}{_fmt(seq_tau):>22}{_fmt(fol_tau):>18}{ratio_text}")


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
