"""The whole recipe on your own GPU machine within one fixed time budget, with hard per-stage deadlines:
regenerate bench → regenerate (the target's own answers) → generate caches → train variants concurrently
→ export → eval on MT-Bench, HumanEval and held-out ShareGPT (and, with ``--chat-eval-args``, a second eval
beside it: e.g. every turn of held-out ShareGPT and of the run's own validation records) → a report.
Each variant's report puts its best validation chain τ (``dflash train``'s held-out split walked
with eval's anchor rule over each turn's first ``--val-chain-tokens``; RUN/drafter is that step's export,
the drafter eval runs) beside eval's τ per question set and per turn (1, 2, 3+).
Everything it learns goes to ``--report``: ``summary.md``, ``summary.json`` and ``logs.txt`` (the tail of
every stage's log).

A stage that overruns its deadline gets SIGINT (our commands stop cleanly on it: regenerate merges its
parts, train checkpoints), then SIGKILL; the pipeline goes on with what exists. Train variants share
the GPU (a SmolLM2-width drafter does not fill an H100 or H200); their step count is calibrated: each starts
with the ``--max-steps`` that ``--expected-steps-per-s`` fits in the budget, after ``--calibrate-s`` the
measured step rate says how many fit, and a variant more than 10 % off is stopped and resumed with that
number (a resume applies a new ``--max-steps``; the cosine schedule is recomputed from it).

  python3 bench/quality_recipe.py --data sharegpt-prompts.jsonl.gz --work q --report q/report \\
      --budget-s 1320 --variants '{"A": "--lr 6e-4", "D": ""}'
CPU smoke (a few minutes): add ``--smoke`` (SmolLM2 on the CPU at tiny sizes: ``apply_smoke``).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass(kw_only=True)
class Stage:
    """One command of the pipeline, run as its own process group with a deadline."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ended: float = 0.0
    rc: int | None = None
    stopped: bool = False
    """Sent SIGINT at its deadline."""
    extra: dict[str, Any] = field(default_factory=dict)

    def start(self) -> Stage:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as f:
            f.write(("\n$ " + shlex.join(self.argv) + "\n").encode())
            f.flush()
            self.proc = subprocess.Popen(
                self.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        self.started = time.time()
        print(f"[{stamp()}] start {self.name}: {shlex.join(self.argv)}", flush=True)
        return self

    def poll(self) -> bool:
        assert self.proc is not None
        if self.rc is None and self.proc.poll() is not None:
            self.rc = self.proc.returncode
            self.ended = time.time()
            print(f"[{stamp()}] {self.name} ended rc {self.rc} after {self.seconds:.0f} s", flush=True)
        return self.rc is not None

    def interrupt(self) -> None:
        assert self.proc is not None
        if self.rc is None and not self.stopped:  # once: a second Ctrl-C means 'stop now' to some tools
            self.stopped = True
            print(f"[{stamp()}] {self.name}: deadline, SIGINT", flush=True)
            os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        assert self.proc is not None
        if self.rc is None:
            print(f"[{stamp()}] {self.name}: SIGKILL", flush=True)
            os.killpg(self.proc.pid, signal.SIGKILL)

    @property
    def seconds(self) -> float:
        return (self.ended or time.time()) - self.started


T0 = time.time()
POLL_S = 0.5
"""How often a waiting stage is looked at: its end or its deadline is seen within this."""


def stamp() -> str:
    return f"{time.time() - T0:7.1f}s"


def run_all(stages: list[Stage], deadline: float, grace: float = 45.0) -> None:
    """Start nothing; wait for every stage, SIGINT at ``deadline``, SIGKILL ``grace`` s later."""
    while not all(s.poll() for s in stages):
        now = time.time()
        if now > deadline:
            for s in stages:
                s.interrupt()
        if now > deadline + grace:
            for s in stages:
                s.kill()
        time.sleep(POLL_S)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def _last_step(run: Path) -> int:
    rows = read_metrics(run / "metrics.jsonl")
    return int(rows[-1]["step"]) if rows else 0


LOG_LINE_CHARS = 2000
"""A stage log line copied into the report is cut here: regenerate's throughput line, which carries the
engine's statistics, runs to ≈ 1,500 characters (300 cut its end off); a runaway line still cannot
swell logs.txt."""


def tail(path: Path, n: int = 25) -> str:
    if not path.is_file():
        return "(no log)"
    lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(line[:LOG_LINE_CHARS] for line in lines[-n:])


class Report:
    def __init__(self, root: Path, work: Path) -> None:
        self.root = root
        self.work = work
        self.data: dict[str, Any] = {"stages": {}, "notes": []}
        root.mkdir(parents=True, exist_ok=True)

    def stage(self, s: Stage, **extra: Any) -> None:
        self.data["stages"][s.name] = {
            "seconds": round(s.seconds, 1),
            "rc": s.rc,
            "stopped_at_deadline": s.stopped,
            **s.extra,
            **extra,
        }
        self.write()

    def note(self, text: str) -> None:
        print(f"[{stamp()}] note: {text}", flush=True)
        self.data["notes"].append(text)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.time() - T0, 1)
        (self.root / "summary.json").write_text(json.dumps(self.data, indent=1) + "\n")
        logs = sorted((self.work / "logs").glob("*.log"))
        (self.root / "logs.txt").write_text(
            "\n\n".join(f"===== {p.name}\n{tail(p, 40)}" for p in logs) + "\n"
        )
        (self.root / "summary.md").write_text(self.markdown())

    def markdown(self) -> str:
        out = ["# Quality recipe", "", "| stage | seconds | rc | note |", "|---|---|---|---|"]
        for name, s in self.data["stages"].items():
            note = "stopped at deadline" if s.get("stopped_at_deadline") else ""
            out.append(f"| {name} | {s['seconds']} | {s['rc']} | {note} |")
        for name, v in self.data.get("variants", {}).items():
            out += ["", f"## variant {name}: `{v.get('args', '')}`"]
            for row in v.get("curve", []):
                acc = " ".join(f"{a:.2f}" for a in row["acc"][:6])
                out.append(
                    f"- step {row['step']}: loss {row['loss']:.3f}, simulated τ {row['tau']:.2f}, "
                    f"acc[1..6] {acc}"
                )
            for row in v.get("validation", []):
                acc = " ".join(f"{a:.2f}" for a in row["acc"][:6])
                chain = "" if row.get("chain_tau") is None else f"chain τ {row['chain_tau']:.2f}, "
                if row.get("chain_tau_by_turn"):  # as eval's "by turn" line: turns 1 / 2 / 3+
                    turns = " / ".join("–" if t is None else f"{t:.2f}" for t in row["chain_tau_by_turn"])
                    chain += f"by turn {turns}, "
                secs = "" if row.get("seconds") is None else f" ({row['seconds']:.1f} s)"
                out.append(
                    f"- validation at step {row['step']}{secs}: loss {row['loss']:.3f}, {chain}"
                    f"simulated τ {row['tau']:.2f}, per-block τ {row['block_tau']:.2f}, acc[1..6] {acc}"
                )
            for seg in v.get("segments", []):  # --follow-window: what was trained, segment by segment
                tau = seg.get("chain_tau_at_end")
                out.append(
                    f"- segment {seg['index']}: from step {seg['first_step']}, {seg['num_samples']} samples "
                    f"({seg['samples_so_far']} so far){', final' if seg.get('last') else ''}; validation "
                    f"chain τ at its end {'–' if tau is None else f'{tau:.2f}'}"
                )
            timing = v.get("timing") or {}
            if timing.get("startup_seconds") or timing.get("validations"):
                startups = ", ".join(f"{t:.1f}" for t in timing["startup_seconds"]) or "n/a"
                step_s = timing.get("step_seconds_mean")
                out.append(
                    f"- train wall time: start-up {startups} s (each start, to its first step's end); "
                    f"{timing['validations']} validations, {timing['validation_seconds']:.1f} s in all"
                    + ("" if step_s is None else f"; logged step_seconds mean {step_s:.3f} s")
                )
            if "tau_compare" in v:
                c = v["tau_compare"]
                sets = ", ".join(f"{k} {t:.2f}" for k, t in c["eval_sets"].items() if t is not None)
                if c["validation_tau"] is not None and c["eval_mean"] is not None:
                    chain, tau = c.get("validation_chain_tau"), c["validation_tau"]
                    # Chain τ (eval's anchor rule, RUN/drafter's criterion) beside eval's τ; runs before it
                    # have the simulated τ alone.
                    val = (
                        f"validation {tau:.2f} (per block"
                        if chain is None
                        else f"validation chain {chain:.2f} (simulated {tau:.2f}, per block"
                    )
                    out.append(
                        f"- **τ: {val} {c['validation_block_tau']:.2f}, step {c['validation_step']}, "
                        f"RUN/drafter) vs eval {c['eval_mean']:.2f} ({sets})**"
                    )
                else:
                    out.append(f"- τ: validation {c['validation_tau']} vs eval {c['eval_mean']}")
                for name, buckets in c.get("by_turn", {}).items():
                    parts = ", ".join(
                        f"turn {b}: {r['tau']:.2f} ({r['turns']})"
                        for b, r in buckets.items()
                        if r["tau"] is not None
                    )
                    out.append(f"- {name} τ by turn (turns decoded): {parts}")
            for key in ("eval_table", "chat_eval_table"):
                if key in v:
                    out += ["", "```", v[key], "```"]
        if self.data.get("window"):
            title = "## the window (`dflash sql CACHE --query window`)"
            out += ["", title, "", "```", self.data["window"], "```"]
        out += ["", "## notes"] + [f"- {n}" for n in self.data["notes"]]
        return "\n".join(out) + "\n"


def curve(rows: list[dict[str, Any]], points: list[int]) -> list[dict[str, Any]]:
    """Mean over a window of 20 steps ending at each point (and at the last step)."""
    out = []
    last = rows[-1]["step"] if rows else 0
    for p in [*points, last]:
        window = [r for r in rows if p - 20 < r["step"] <= p]
        if not window or (out and out[-1]["step"] >= p):
            continue
        k = len(window[0]["acc_by_position"])
        out.append(
            {
                "step": p,
                "loss": sum(r["loss"] for r in window) / len(window),
                "tau": sum(r["simulated_tau"] for r in window) / len(window),
                "acc": [sum(r["acc_by_position"][i] for r in window) / len(window) for i in range(k)],
                "tokens_per_s": sum(r["tokens_per_s"] for r in window) / len(window),
                "data_wait_fraction": sum(r["data_wait_fraction"] for r in window) / len(window),
            }
        )
    return out


def validation_curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines where ``dflash train`` evaluated its validation split."""
    return [
        {
            "step": r["step"],
            "loss": r["val_loss"],
            "tau": r["val_simulated_tau"],
            "block_tau": r["val_block_tau"],
            "chain_tau": r.get("val_chain_tau"),  # absent from runs before chain τ
            "chain_tau_by_turn": r.get("val_chain_tau_by_turn"),  # turns 1, 2, 3+ (absent before them)
            "acc": r["val_acc_by_position"],
            "seconds": r.get("val_seconds"),  # absent from runs before the wall-time accounting
        }
        for r in rows
        if "val_simulated_tau" in r
    ]


def train_timing(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a run's wall time went, as far as metrics.jsonl says: each invocation's start-up (its first
    line carries ``startup_seconds``; a resume logs one again) and the validation passes' seconds."""
    val_seconds = [r["val_seconds"] for r in rows if "val_seconds" in r]
    return {
        "startup_seconds": [r["startup_seconds"] for r in rows if "startup_seconds" in r],
        "validations": len(val_seconds),
        "validation_seconds": sum(val_seconds),
        "step_seconds_mean": sum(r["step_seconds"] for r in rows) / len(rows) if rows else None,
    }


def best_chain_tau(validation: list[dict[str, Any]]) -> float | None:
    """The best validation chain τ of a run (what its RUN/drafter export was chosen by)."""
    taus = [r["chain_tau"] for r in validation if r.get("chain_tau") is not None]
    return max(taus) if taus else None


def tau_by_turn(prompts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per set: τ (Σ (accepted + 1) ÷ cycles, as eval pools it) over its turns 1, 2 and 3+, with counts."""
    out: dict[str, dict[str, Any]] = {}
    for p in prompts:
        bucket = "1" if p.get("turn", 1) == 1 else "2" if p.get("turn") == 2 else "3+"
        hist = p.get("accepted_histogram") or []
        row = out.setdefault(p.get("bench", "data"), {}).setdefault(
            bucket, {"cycles": 0, "sum": 0, "turns": 0}
        )
        row["cycles"] += sum(hist)
        row["sum"] += sum((k + 1) * n for k, n in enumerate(hist))
        row["turns"] += 1
    return {
        name: {
            b: {"tau": r["sum"] / r["cycles"] if r["cycles"] else None, "turns": r["turns"]}
            for b, r in sorted(buckets.items())
        }
        for name, buckets in out.items()
    }


def tau_compare(v: dict[str, Any]) -> dict[str, Any]:
    """The best validation τ (the drafter eval ran: RUN/drafter, chosen by chain τ; by simulated τ in runs
    before it) beside eval's τ per set (both evals)."""
    val = v.get("validation") or []
    chained = [r for r in val if r.get("chain_tau") is not None]
    best = (
        max(chained, key=lambda r: r["chain_tau"])
        if chained
        else max(val, key=lambda r: r["tau"], default=None)
    )
    ev = v.get("eval") or {}
    sets = {s.get("name") or f"set{i}": s.get("tau") for i, s in enumerate(ev.get("sets") or [])}
    chat = v.get("chat_eval") or {}
    chat_sets = {f"{s.get('name')} (all turns)": s.get("tau") for s in chat.get("sets") or []}
    return {
        "validation_tau": None if best is None else best["tau"],
        "validation_chain_tau": None if best is None else best.get("chain_tau"),
        "validation_block_tau": None if best is None else best["block_tau"],
        "validation_step": None if best is None else best["step"],
        "eval_sets": {**sets, **chat_sets},
        "eval_mean": (ev.get("mean") or {}).get("tau"),
        "by_turn": {**(ev.get("by_turn") or {}), **(chat.get("by_turn") or {})},
    }


def _regenerate_bench(args: argparse.Namespace, bench_json: Path, logs: Path, report: Report) -> None:
    s = Stage(
        name="regenerate_bench",
        argv=[
            PY,
            "bench/regenerate.py",
            "--target",
            args.target,
            "--data",
            args.data,
            *shlex.split(args.regen_bench),
            "--json",
            str(bench_json),
        ],
        log=logs / "1_regen_bench.log",
    ).start()
    run_all([s], time.time() + args.regen_bench_s, grace=15)
    report.stage(s)


def _fastest_engine(bench_json: Path, report: Report) -> list[str]:
    """The decode engine's fastest batch size in the bench (its references are no regenerate engines)."""
    if not bench_json.is_file():
        return []
    result = json.loads(bench_json.read_text())
    report.data["regenerate_bench"] = result
    ok = [r for r in result.get("engines", []) if "error" not in r and r["engine"] == "slots"]
    if not ok:
        return []
    best = max(ok, key=lambda r: r["new_tokens_per_second"])
    engine_args = ["--batch-size", str(best["batch_size"])]
    report.note(f"regenerate uses the bench's fastest: {' '.join(engine_args)}")
    return engine_args


def _step_rates(trains: dict[str, Stage], work: Path, calibrate_s: float) -> dict[str, float]:
    """Steps per second of each running variant, validations apart: from its first logged step, over 30 s;
    a variant with no logged step within ``calibrate_s`` gets none."""
    give_up = time.time() + calibrate_s
    first: dict[str, tuple[float, int]] = {}
    while time.time() < give_up and len(first) < len(trains):
        for name in trains:
            step = _last_step(work / f"run-{name}")
            if name not in first and step >= 1:
                first[name] = (time.time(), step)
        time.sleep(POLL_S)
    if first:  # no variant logged a step within calibrate_s: there is no rate to measure
        time.sleep(30)
    rates = {}
    for name, (t1, s1) in first.items():
        rows = read_metrics(work / f"run-{name}" / "metrics.jsonl")
        s2 = int(rows[-1]["step"]) if rows else 0
        # Validations inside the window are left out: steps_that_fit plans them on their own.
        val_s = sum(r.get("val_seconds", 0.0) for r in rows if s1 < r["step"] <= s2)
        if s2 > s1 and not trains[name].poll():
            rates[name] = (s2 - s1) / max(1.0, time.time() - t1 - val_s)
    return rates


def apply_smoke(args: argparse.Namespace) -> None:
    """``--smoke``: the same stages on the CPU at sizes two cores finish in minutes (a 1-layer drafter on
    microbatches of 1,024 tokens with 8 anchors, answers of 8 tokens, 4 decoded in eval, a few records
    and questions, no regenerate bench): these flags come last in each stage's flags, so they win over the
    same flags given."""
    args.device_args = ""
    args.regen_bench_s = 0
    args.regen_limit = min(args.regen_limit, 8)
    args.code_limit = min(args.code_limit, 2)
    args.regen_args = f"{args.regen_args} --max-new-tokens 8 --max-prompt-tokens 512"
    args.train_args = (
        f"{args.train_args} --num-layers 1 --tokens-per-microbatch 1024 --grad-accum 1 --num-anchors 8 "
        "--val-every 20"
    )
    args.eval_args = f"{args.eval_args} --limit 1 --max-new-tokens 4"
    if args.chat_eval_args:
        args.chat_eval_args = f"{args.chat_eval_args} --limit 1 --max-new-tokens 4"


def train_deadline(now: float, end: float, train_s: float, eval_s: float, reserve_s: float) -> float:
    """When training is stopped: ``train_s`` from ``now`` at least, and on to the budget's ``end`` less the
    eval's ``eval_s`` and ``reserve_s``. Regenerate and generate stop at their deadlines or sooner (one
    H200 run's regenerate used 56 of its 150 s and its generate 152 of 200: they ran out of data), and what
    they leave unused would otherwise idle at the end of the budget."""
    return max(now + train_s, end - eval_s - reserve_s)


def steps_that_fit(rate: float, seconds: float, val_every: int, val_s: float) -> int:
    """Steps that ``seconds`` hold at ``rate`` steps/s of training alone, with a validation of ``val_s`` every
    ``val_every`` steps (one run on 2026-12-04 validated every 100 steps for 6–9 s at 2.5 steps/s: ≈ 25 % of
    its time, which the 30 s calibration window rarely sees)."""
    per_step = 1.0 / rate + (val_s / val_every if val_every > 0 else 0.0)
    return int(max(0.0, seconds) / per_step)


def replanned_max_steps(
    first: int, fits: dict[str, int], *, equal_steps: bool, uncalibrated: Iterable[str] = ()
) -> dict[str, int]:
    """The variants to stop and resume after calibration, with their new ``--max-steps``; the others keep
    ``first``. ``fits``: the steps each calibrated variant can reach by the deadline. Alone, a variant is
    replanned only when ``first`` is more than 10 % off what fits it (a restart costs start-up and compile
    again; a little long, the deadline's SIGINT ends it checkpointed). With ``equal_steps`` every variant
    makes the same number, what the slowest reaches: when that is below ``first``, all of them are
    replanned to it, the ``uncalibrated`` ones (no step rate measured) too, since left at ``first`` they
    would train more steps than the others; when it is more than 10 % above ``first``, all of them are
    replanned up to it, unless one is uncalibrated (it might not reach a longer plan by the deadline), since
    otherwise every variant ends early and the budget's training seconds go unused; within 10 % above,
    they keep ``first``."""
    waiting = list(uncalibrated)
    if equal_steps:
        common = min(fits.values(), default=first)
        longer = common > 1.1 * first and not waiting
        return dict.fromkeys([*fits, *waiting], common) if common < first or longer else {}
    return {name: steps for name, steps in fits.items() if abs(steps - first) > 0.1 * first}


def unequal_steps(steps: dict[str, int]) -> str | None:
    """Why variants meant to train equal steps are not comparable (each one's last logged step), or None.
    A variant the deadline's SIGINT stopped early, or one that failed, ends short of the others."""
    if len(set(steps.values())) <= 1:
        return None
    listed = ", ".join(f"{name} {step}" for name, step in steps.items())
    return f"--equal-steps not met: the variants' last steps differ ({listed}); their τ are not comparable"


def seed_list(text: str) -> list[int]:
    """``--sampled-seeds``: comma-separated distinct integers (each seed writes its own answer file)."""
    try:
        seeds = [int(seed) for seed in text.split(",") if seed.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"a seed is repeated in {text!r}")
    return seeds


def earlier_sampled(
    paths: list[Path], seeds: list[int], temperature: float, *, extend: bool
) -> dict[int, Path]:
    """``--sampled-from``: each earlier sampled answer file by the seed its records were sampled with (its
    first record's ``regenerated_by``). Raises ValueError, in one line, for a file that cannot be read, whose
    seed is not in ``seeds`` or is another file's, whose temperature is not ``temperature``, or, when its
    regenerate will ``extend`` it (``--sampled-s`` above 0), that another sampling algorithm drew
    (regenerate would refuse to resume it, but only once the stages before it had run)."""
    if extend and paths:
        from dflash_offline.decode.sampling import SAMPLER
        from dflash_offline.regenerate.recorded import EARLIER_SAMPLER
    by_seed: dict[int, Path] = {}
    for path in paths:
        try:
            first = next(jsonl_lines(path), None)
            recorded = json.loads(first)["regenerated_by"] if first is not None else None
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--sampled-from {path}: not a regenerated chat JSONL(.gz) ({e})") from None
        if recorded is None:
            raise ValueError(f"--sampled-from {path}: the file holds no answer")
        if not isinstance(recorded, dict):
            raise ValueError(f"--sampled-from {path}: its first record's regenerated_by is not an object")
        seed, temp = recorded.get("seed"), recorded.get("temperature")
        if seed not in seeds:
            raise ValueError(f"--sampled-from {path}: sampled with seed {seed}, which --sampled-seeds lacks")
        if seed in by_seed:
            raise ValueError(f"--sampled-from {path}: seed {seed} is also {by_seed[seed]}'s")
        if temp != temperature:
            raise ValueError(
                f"--sampled-from {path}: sampled at temperature {temp}, "
                f"not --sampled-temperature {temperature}"
            )
        if extend and (drawn_by := recorded.get("sampler", EARLIER_SAMPLER)) != SAMPLER:
            raise ValueError(
                f"--sampled-from {path}: drawn by the {drawn_by} sampler, which regenerate does not extend "
                f"(it samples by {SAMPLER}): pass --sampled-s 0 to train on it as it is"
            )
        by_seed[seed] = path
    return by_seed


def start_from_earlier(earlier: dict[int, Path], work: Path) -> dict[int, int]:
    """Each seed's answer file in ``work`` begins as its earlier file (decompressed), so that its regenerate
    resumes it and answers only the conversations it lacks. A seed whose file in ``work`` exists already (a
    rerun of the recipe) keeps it. Returns the conversations copied, by seed."""
    copied = {}
    for seed, path in earlier.items():
        out = work / f"sampled-{seed}.jsonl"
        if out.exists():
            continue
        tmp = out.with_name(out.name + ".copying")
        with open(tmp, "wb") as dst:
            copied[seed] = sum(dst.write(line) > 0 for line in jsonl_lines(path))
        os.replace(tmp, out)
    return copied


def flag_value(args: str, flag: str, default: int) -> int:
    """The integer value of ``flag`` in a flag string (``--val-every 100``), or ``default``."""
    tokens = shlex.split(args)
    return int(tokens[tokens.index(flag) + 1]) if flag in tokens[:-1] else default


def jsonl_lines(path: Path) -> Iterator[bytes]:
    """The non-blank lines of a chat JSONL file (plain or gzipped), each ending in a newline."""
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as src:
        for line in src:
            if line.strip():
                yield line if line.endswith(b"\n") else line + b"\n"


CODE_LINE = b'{"id": "code-'
"""How a code problem's answer starts (bench/quality_prompts.py's ids, as regenerate writes them)."""


def concatenate_answers(parts: list[Path], out: Path) -> int:
    """Writes the lines of the chat JSONL files (plain or gzipped) into ``out`` interleaved, so that every
    prefix holds each file's chat and each file's code answers in proportion to their sizes, each in its own
    order: generate stopped at its deadline then keeps some of each (one after the other, a cache cut at
    its deadline lost the code answers that came last; a regenerate's answers hold its code problems
    after the chat). Returns the number of lines taken from all but the first."""
    # Two streams a part, its chat then its code: streams[2:] are the parts after the first.
    streams = [
        [line for line in jsonl_lines(part) if line.startswith(CODE_LINE) == code]
        for part in parts
        for code in (False, True)
    ]
    lines = [stream for stream in streams if stream]
    # Line j of a file of n lines sits at (j + 0.5) / n of the way through it; merged by that position.
    order = sorted(((j + 0.5) / len(part), i, j) for i, part in enumerate(lines) for j in range(len(part)))
    with open(out, "wb") as dst:
        dst.writelines(lines[i][j] for _, i, j in order)
    return sum(len(stream) for stream in streams[2:])


def combine_prompts(data: Path, skip: int, limit: int, code: Path, code_limit: int, out: Path) -> int:
    """The prompt file regenerate reads when code problems join the chat data: records ``skip`` to
    ``skip + limit`` of ``data`` (what ``--skip``/``--limit`` would take: one record a line, as
    bench/quality_prompts.py writes them), then the first ``code_limit`` of ``code``. Returns the code
    records taken."""
    with open(out, "wb") as dst:
        dst.writelines(itertools.islice(jsonl_lines(data), skip, skip + limit))
        taken = list(itertools.islice(jsonl_lines(code), code_limit))
        dst.writelines(taken)
    return len(taken)


def chain_tokens_of(eval_args: str) -> list[str]:
    """Train's ``--val-chain-tokens`` = this eval's ``--max-new-tokens``, so that the validation chain τ
    covers what eval decodes (none when the eval leaves it at its default; a variant's flags may still
    set it: the last occurrence wins)."""
    argv = shlex.split(eval_args)
    if "--max-new-tokens" not in argv:
        return []
    return ["--val-chain-tokens", argv[argv.index("--max-new-tokens") + 1]]


def benches_of(eval_args: str) -> str | None:
    """The ``--bench`` value of a dflash eval's flags, or None."""
    argv = shlex.split(eval_args)
    return argv[argv.index("--bench") + 1] if "--bench" in argv[:-1] else None


def reads_data(eval_args: str) -> bool:
    """Whether a dflash eval with these flags reads --data (its sharegpt set, or no --bench at all)."""
    value = benches_of(eval_args)
    if value is None:
        return True
    sets = value.split(",")
    return "sharegpt" in sets or "all" in sets


def question_sets_missing(eval_args: list[str]) -> str | None:
    """Why an eval of these flags would fail for a missing question-set package, asked of the interpreter
    the stages run on before any of them starts (eval itself checks only when it starts, at the end of the
    budget: after the training), or None."""
    for value in filter(None, map(benches_of, eval_args)):
        check = subprocess.run(
            [
                PY,
                "-c",
                "import sys; from dflash_offline.eval.benches import parse_bench, require_question_sets; "
                "require_question_sets(parse_bench(sys.argv[1]))",
                value,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if check.returncode != 0:
            return f"--bench {value}: {check.stderr.strip().splitlines()[-1]}"
    return None


def dflash(*args: str) -> list[str]:
    return [PY, "-m", "dflash_offline", *args]


def sampled_answers(
    args: argparse.Namespace, data: Path, logs: Path, report: Report, dev: list[str]
) -> list[Path]:
    """``--sampled-seeds``: one regenerate of every conversation of ``data`` for each seed, sampled at
    ``--sampled-temperature``, all at once until ``--sampled-s`` (SIGINT keeps what is done; a stopped one's
    parts are merged after). Returns the answer files that hold a conversation."""
    argvs = {
        seed: dflash(
            "regenerate",
            "--target",
            args.target,
            "--data",
            str(data),
            *shlex.split(args.regen_args),
            "--temperature",
            str(args.sampled_temperature),
            "--seed",
            str(seed),
            *dev,
            "--no-progress",
            "--out",
            str(args.work / f"sampled-{seed}.jsonl"),
        )
        for seed in args.sampled_seeds
    }
    earlier = earlier_sampled(
        args.sampled_from, args.sampled_seeds, args.sampled_temperature, extend=args.sampled_s > 0
    )
    for seed, n in start_from_earlier(earlier, args.work).items():
        report.note(f"sampled_{seed}: starts from {earlier[seed]} ({n} conversations)")
    if args.sampled_s <= 0:  # the sampled answers in --work (and --sampled-from) as they are
        outs = [args.work / f"sampled-{seed}.jsonl" for seed in args.sampled_seeds]
        kept = [out for out in outs if out.is_file() and out.stat().st_size > 0]
        report.note(
            f"sampled regenerate skipped (--sampled-s 0): {', '.join(p.name for p in kept) or 'none'}"
        )
        return kept
    stages = {
        seed: Stage(name=f"sampled_{seed}", argv=argv, log=logs / f"2_sampled_{seed}.log").start()
        for seed, argv in argvs.items()
    }
    run_all(list(stages.values()), time.time() + args.sampled_s, grace=40)
    kept = []
    for seed, stage in stages.items():
        out = args.work / f"sampled-{seed}.jsonl"
        if not out.is_file():  # stopped at its deadline: the same command merges its parts, answering no more
            subprocess.run([*argvs[seed], "--limit", "0"], cwd=ROOT, check=False, capture_output=True)
        n = out.read_bytes().count(b"\n") if out.is_file() else 0  # not splitlines: U+2028
        report.stage(stage, conversations=n, throughput=tail(stage.log, 3))
        if n:
            kept.append(out)
    return kept


FOLLOW_REFUSED = ("--val-samples", "--max-steps", "--early-stop", "--epochs")
"""Train flags that ``dflash train --follow`` refuses (each segment is ``--passes`` epochs; its validation
is what generate routed into its validation stores, whole conversations by conversation root, so
``--val-group`` is not consulted): refused before any stage starts, not after generate."""


def follow_problem(args: argparse.Namespace) -> str | None:
    """Why ``--follow-window`` cannot run with these settings, or None."""
    codecs = [c for c in args.codecs.split(",") if c]
    variants = json.loads(args.variants)
    if len(codecs) != 1 or len(variants) != 1:
        return "--follow-window streams one cache into one training run: give one --codecs and one variant"
    if args.original_cache or args.equal_steps:
        return "--follow-window goes with neither --original-cache nor --equal-steps"
    flags, _, cache_name = next(iter(variants.values())).partition("@")
    if cache_name.strip() not in ("", codecs[0]):
        return f"--follow-window: the variant's cache @{cache_name.strip()} is not --codecs {codecs[0]}"
    flags = shlex.split(args.train_args) + shlex.split(flags)
    refused = [f for f in FOLLOW_REFUSED if f in flags]
    if refused:
        return f"--follow-window: dflash train --follow refuses {', '.join(refused)}; leave it out"
    return None


def follow_generate_args(args: argparse.Namespace) -> list[str]:
    """Generate's flags in the follow mode: the window's bound and the validation share it routes."""
    if not args.follow_window:
        return []
    return ["--window-limit", args.follow_window, "--val-fraction", str(args.follow_val_fraction)]


def follow_segments(run: Path) -> list[dict[str, Any]]:
    """A follow run's segments as RUN/follow.json records them, each with its metrics rows renumbered to the
    run's global steps (a segment counts its own) and the samples trained in it and the ones before."""
    path = run / "follow.json"
    state = json.loads(path.read_text()) if path.is_file() else {"segments": []}
    out: list[dict[str, Any]] = []
    so_far = 0
    for seg in state["segments"]:
        rows = read_metrics(run / "segments" / f"{seg['index']:04d}" / "metrics.jsonl")
        for row in rows:
            row["step"] += seg["first_step"]
        so_far += seg["num_samples"]
        chains = [r["chain_tau"] for r in validation_curve(rows) if r.get("chain_tau") is not None]
        out.append(
            {
                **seg,
                "samples_so_far": so_far,
                "chain_tau_at_end": chains[-1] if chains else None,
                "rows": rows,
            }
        )
    return out


def follow_drafter(run: Path) -> Path | None:
    """The drafter a follow run exported at its end: its last segment's best-validation export, else the
    last one; None when it was stopped before its end."""
    segments = sorted((run / "segments").glob("[0-9]*"))
    for name in ("drafter", "drafter-last"):
        if segments and (segments[-1] / name / "config.json").is_file():
            return segments[-1] / name
    return None


def follow_variant(
    args: argparse.Namespace,
    caches: dict[str, Path],
    gens: list[Stage],
    work: Path,
    logs: Path,
    report: Report,
    end: float,
) -> list[str]:
    """Stages 3 and 4 at once: ``dflash train --follow`` of the one variant beside generate's windowed
    cache, until both end or training's deadline; its drafter (the run's final export, else its newest
    training state exported) in the report."""
    (name, spec), cache = next(iter(json.loads(args.variants).items())), next(iter(caches.values()))
    run = work / f"run-{name}"
    train = Stage(
        name=f"train_{name}",
        argv=dflash(
            "train", "--cache", str(cache), "--out", str(run), "--target", args.target, "--follow",
            "--passes", str(args.passes), "--val-fraction", str(args.follow_val_fraction),
            *chain_tokens_of(args.eval_args), *shlex.split(args.train_args),
            *shlex.split(spec.partition("@")[0]), *shlex.split(args.device_args), "--no-progress",
        ),
        log=logs / f"4_train_{name}.log",
    ).start()  # fmt: skip
    train_end = train_deadline(time.time(), end, args.train_s, args.eval_s, args.reserve_s)
    # Training ends once generate's run has finished; a generate that failed never finishes it, and
    # training would wait for its stores until the deadline.
    while not train.poll() and time.time() < train_end:
        if all(g.poll() for g in gens) and any(g.rc != 0 for g in gens):
            report.note("generate failed: training stopped (its newest state is exported)")
            train.interrupt()
            break
        time.sleep(POLL_S)
    run_all([*gens, train], train_end, grace=60)
    for stage in [*gens, train]:
        report.stage(stage, log_tail=tail(stage.log, 4))
    segments = follow_segments(run)
    rows = [row for seg in segments for row in seg.pop("rows")]
    drafter = follow_drafter(run)
    if drafter is None:  # stopped at the deadline: the newest checkpoint of its last segment
        drafter = work / f"drafter-{name}"
        with open(train.log, "ab") as log:
            subprocess.run(
                dflash("export", str(run), "--out", str(drafter)),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
            )
    report.data["variants"] = {
        name: {
            "args": spec,
            "curve": curve(rows, [int(p) for p in args.curve_points.split(",")]),
            "validation": validation_curve(rows),
            "timing": train_timing(rows),
            "steps": rows[-1]["step"] if rows else 0,
            "segments": segments,
            "drafter": str(drafter),
        }
    }
    window = subprocess.run(
        dflash("sql", str(cache), "--query", "window"), cwd=ROOT, capture_output=True, text=True, check=False
    )
    report.data["window"] = window.stdout.strip() or window.stderr.strip()
    report.write()
    return [name]


def _train_variants(
    args: argparse.Namespace, caches: dict[str, Path], work: Path, logs: Path, report: Report, end: float
) -> list[str]:
    """Stage 4, each variant trained on its finished cache side by side, calibrated to the budget; the
    variants trained, each with its drafter in the report."""
    dev = shlex.split(args.device_args)
    # 4. train the variants concurrently, calibrated to the budget.
    variants: dict[str, str] = json.loads(args.variants)
    report.data["variants"] = {}
    trains: dict[str, Stage] = {}
    train_end = train_deadline(time.time(), end, args.train_s, args.eval_s, args.reserve_s)
    if train_end - time.time() > args.train_s + 1:
        report.note(
            f"train: {train_end - time.time():.0f} s, {train_end - time.time() - args.train_s:.0f} s more "
            "than --train-s (left unused by the stages before)"
        )
    # Planned from step 1 for about the budget (start-up ≈ 60 s): a placeholder of 100,000 steps left the
    # learning rate in a warm-up of 4,000 steps until the restart (1.5e-5 at step 100 on 2026-12-04).
    val_every = flag_value(args.train_args, "--val-every", 0)
    first_max_steps = max(
        20,
        steps_that_fit(
            args.expected_steps_per_s, train_end - time.time() - 60, val_every, args.expected_val_s
        ),
    )

    def train_stage(name: str, spec: str, max_steps: int) -> Stage:
        flags, _, cache_name = spec.partition("@")
        cache = caches.get(cache_name.strip() or "default")
        run = work / f"run-{name}"
        return Stage(
            name=f"train_{name}",
            argv=dflash(
                "train",
                "--cache",
                str(cache),
                "--out",
                str(run),
                "--target",
                args.target,
                *chain_tokens_of(args.eval_args),
                *shlex.split(args.train_args),
                *shlex.split(flags),
                "--max-steps",
                str(max_steps),
                "--epochs",
                "1000",
                "--checkpoint-every",
                "100000",
                *dev,
                "--no-progress",
            ),
            log=logs / f"4_train_{name}.log",
        )

    for name, spec in variants.items():
        cache_name = spec.partition("@")[2].strip() or "default"
        if cache_name not in caches or not (caches[cache_name] / "cache.json").is_file():
            report.note(f"variant {name}: cache {cache_name!r} missing, skipped")
            continue
        report.data["variants"][name] = {"args": spec}
        trains[name] = train_stage(name, spec, first_max_steps).start()
    # The step rate in wall time over 30 s once every variant has logged a step (start-up excluded: on
    # the H200 a SmolLM2 run logged its first line only after ≈ 40 s, and a fixed wait measured nothing).
    # A variant whose planned length is within 10 % of what the rate allows runs on as started (its
    # deadline's SIGINT ends it, checkpointed, if it is a little long); another is stopped and resumed with
    # the --max-steps that fills the budget: the restart costs start-up and compile again.
    rates = _step_rates(trains, work, args.calibrate_s)
    fits: dict[str, int] = {}
    for name in trains:
        if name not in rates:
            report.note(
                f"variant {name}: no step rate after {args.calibrate_s:.0f} s; it keeps --max-steps "
                f"{first_max_steps} unless a note below replans it"
            )
            continue
        fits[name] = _last_step(work / f"run-{name}") + steps_that_fit(
            rates[name], train_end - time.time() - 10, val_every, args.expected_val_s
        )
        report.data["variants"][name].update(steps_per_s_calibrated=round(rates[name], 3))
    replan = replanned_max_steps(
        first_max_steps, fits, equal_steps=args.equal_steps, uncalibrated=[n for n in trains if n not in fits]
    )
    for name in trains:
        if name in replan:
            trains[name].interrupt()
            continue
        if name not in fits:
            continue
        report.data["variants"][name].update(max_steps=first_max_steps)
        report.note(
            f"variant {name}: {rates[name]:.2f} steps/s measured; {fits[name]} steps fit, "
            f"--max-steps {first_max_steps} kept (no restart)"
        )
    run_all([trains[n] for n in replan], time.time() + 60, grace=20)
    # The restart costs start-up again (≈ 20–40 s); the step rate was measured with all variants running.
    remaining = max(0.0, train_end - time.time() - 45)
    resumed_at = {name: _last_step(work / f"run-{name}") for name in replan}
    totals = {
        name: resumed_at[name]
        + max(10, steps_that_fit(rates[name], remaining, val_every, args.expected_val_s))
        for name in replan
        if name in rates
    }
    if args.equal_steps and totals:  # what the slowest reaches, for every variant, uncalibrated ones too
        totals = dict.fromkeys(replan, min(totals.values()))
    for name, total in totals.items():
        report.data["variants"][name].update(max_steps=total)
        rate = f"{rates[name]:.2f} steps/s measured" if name in rates else "no step rate measured"
        report.note(f"variant {name}: {rate}, resumed at step {resumed_at[name]} → --max-steps {total}")
        old = trains[name]
        trains[name] = train_stage(name, variants[name], total)
        trains[name].started = old.started
        trains[name].start()
        trains[name].started = old.started
    run_all(list(trains.values()), train_end, grace=60)
    points = [int(p) for p in args.curve_points.split(",")]
    for name, st in trains.items():
        rows = read_metrics(work / f"run-{name}" / "metrics.jsonl")
        v = report.data["variants"][name]
        v["curve"] = curve(rows, points)
        v["validation"] = validation_curve(rows)
        v["timing"] = train_timing(rows)
        v["steps"] = rows[-1]["step"] if rows else 0
        report.stage(st)
        drafter = work / f"run-{name}" / "drafter"
        if not (drafter / "config.json").is_file():
            # dflash export never writes into a run: the newest checkpoint goes beside it.
            drafter = work / f"drafter-{name}"
            with open(logs / f"4_train_{name}.log", "ab") as log:
                subprocess.run(
                    dflash("export", str(work / f"run-{name}"), "--out", str(drafter)),
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    check=False,
                )

    if args.equal_steps:
        problem = unequal_steps({name: report.data["variants"][name]["steps"] for name in trains})
        report.data["equal_steps_met"] = problem is None
        if problem:
            report.note(problem)
    for name in trains:
        drafter = work / f"run-{name}" / "drafter"
        if not (drafter / "config.json").is_file():
            drafter = work / f"drafter-{name}"  # exported from the newest checkpoint (above)
        report.data["variants"][name]["drafter"] = str(drafter)
    return list(trains)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="ShareGPT JSONL(.gz) of first turns")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=1320.0, help="whole pipeline, start to summary")
    ap.add_argument("--target", default="default")
    ap.add_argument("--device-args", default="--gpus 0", help="placement flags of our commands")
    ap.add_argument(
        "--regen-bench",
        default="--limit 512 --max-new-tokens 256 --batch-size 256 "
        "--cb-batch-sizes 256 --max-prompt-tokens 1024 --limit-seconds 45",
    )
    ap.add_argument("--regen-bench-s", type=float, default=200)
    ap.add_argument("--regen-args", default="--max-new-tokens 512 --max-prompt-tokens 1024")
    ap.add_argument("--regen-limit", type=int, default=11000)
    ap.add_argument(
        "--regen-skip",
        type=int,
        default=0,
        help="records of --data that regenerate skips (answered by an earlier run with other settings, "
        "passed as --extra-answers); the held-out eval prompts start after them and the new answers",
    )
    ap.add_argument(
        "--extra-answers",
        nargs="*",
        type=Path,
        default=[],
        help="chat JSONL(.gz) of an earlier run's regenerated conversations (other settings: not resumed): "
        "cached and trained on beside this run's answers",
    )
    ap.add_argument(
        "--code-data",
        type=Path,
        default=None,
        help="code problems as chat JSONL(.gz) (bench/quality_prompts.py's code-prompts.jsonl.gz): the first "
        "--code-limit of them are regenerated after --data's records, in the same regenerate",
    )
    ap.add_argument("--code-limit", type=int, default=0, help="code problems taken from --code-data")
    ap.add_argument(
        "--regen-s",
        type=float,
        default=300,
        help="regenerate's seconds; 0: the answers already in --work as they are",
    )
    ap.add_argument(
        "--sampled-seeds",
        type=seed_list,
        default=[],
        help="comma-separated seeds: for each, one sampled regenerate of every training conversation "
        "(the greedy answers and --extra-answers: their prompts, --regen-args, --sampled-temperature), side "
        "by side on the GPU until --sampled-s; the sampled answers are cached and trained on beside the "
        "greedy ones (more data from the same prompts; they keep each record's id, so --val-group root-id "
        "and --follow-window keep a conversation's answers on one side of the validation split)",
    )
    ap.add_argument(
        "--sampled-temperature", type=float, default=0.8, help="the sampled answers' temperature (> 0)"
    )
    ap.add_argument(
        "--sampled-s",
        type=float,
        default=300,
        help="the sampled regenerates' seconds; 0: the sampled answers in --work and --sampled-from as "
        "they are",
    )
    ap.add_argument(
        "--sampled-from",
        nargs="*",
        type=Path,
        default=[],
        help="earlier sampled answers of the same training conversations (bench/answers/sampled-answers-*), "
        "at most one per seed of --sampled-seeds: each seed's regenerate resumes its file and answers only "
        "the conversations it lacks, so that sampled answers accumulate across runs",
    )
    ap.add_argument("--gen-args", default="--max-len 2048 --too-long truncate")
    ap.add_argument("--gen-s", type=float, default=150)
    ap.add_argument("--codecs", default="default,fp8", help="caches of the regenerated answers")
    ap.add_argument("--original-cache", action="store_true", help="also a cache of the data set's answers")
    ap.add_argument(
        "--variants",
        required=True,
        help='JSON {name: "train flags [@cache]"}; cache: default (regenerated, default codec), '
        "fp8, original",
    )
    ap.add_argument(
        "--train-args",
        default="--val-every 100 --log-every 10",
        help="flags of every variant's dflash train (validation every N steps; metrics read back every N)",
    )
    ap.add_argument(
        "--train-s",
        type=float,
        default=480,
        help="training's seconds at least; it runs on to the budget's end less --eval-s and --reserve-s, so "
        "the seconds regenerate and generate leave unused go to training (train_deadline)",
    )
    ap.add_argument(
        "--reserve-s",
        type=float,
        default=90,
        help="seconds kept between training's deadline and the eval's (a late variant's stop grace, the "
        "export, the summary)",
    )
    ap.add_argument(
        "--calibrate-s", type=float, default=90, help="longest wait for every variant's first logged step"
    )
    ap.add_argument(
        "--equal-steps",
        action="store_true",
        help="every variant trains the same number of steps (what the slowest reaches by the deadline): "
        "for comparisons at equal steps, such as one cache codec against another",
    )
    ap.add_argument(
        "--expected-steps-per-s",
        type=float,
        default=5.0,
        help="each variant's step rate expected before calibration (5.25 and 5.31 measured for two compiled "
        "SmolLM2-width variants side by side on one H100, bench/RESULTS.md's data-size curve): its first "
        "--max-steps, so that the warm-up and the cosine are planned for a run of about the right length "
        "from step 1",
    )
    ap.add_argument(
        "--expected-val-s",
        type=float,
        default=10.0,
        help="seconds of one validation of 200 records, on average (the H200: 5–9 s, the first 36 s)",
    )
    ap.add_argument("--curve-points", default="250,500,1000,1500,2000,3000,4000,6000,8000")
    ap.add_argument("--eval-args", default="--bench all --limit 8 --max-new-tokens 128")
    ap.add_argument(
        "--chat-eval-args",
        default="",
        help="a second dflash eval per variant, run beside the first (its --data/--skip/--exclude-cache are "
        'the same), e.g. "--bench sharegpt,validation --turns all --limit 8": its own table and τ by turn',
    )
    ap.add_argument("--eval-s", type=float, default=260)
    ap.add_argument(
        "--eval-variants",
        choices=["all", "best"],
        default="all",
        help="evaluate every variant, or only the one of best validation chain τ (concurrent evals at "
        "batch 1 share the GPU: each runs at a fraction of its speed alone)",
    )
    ap.add_argument(
        "--follow-window",
        default="",
        metavar="SIZE",
        help="stream the answers through a bounded cache: generate with --window-limit SIZE and the one "
        "variant's dflash train --follow at once, until both end or training's deadline (one codec, one "
        "variant; docs/follow.md)",
    )
    ap.add_argument("--passes", type=int, default=2, help="--follow-window: train --follow's --passes")
    ap.add_argument(
        "--follow-val-fraction",
        type=float,
        default=0.01,
        help="--follow-window: the validation share generate routes, whole conversations (by conversation "
        "root), into stores never retired, and train validates on",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU: the same pipeline, tiny sizes")
    args = ap.parse_args()
    if args.smoke:
        apply_smoke(args)
    if args.sampled_seeds and args.sampled_temperature <= 0:
        sys.exit(
            "quality_recipe: --sampled-temperature must be > 0 (0 answers greedily: the same answers again)"
        )
    if args.sampled_from and not args.sampled_seeds:
        sys.exit("quality_recipe: --sampled-from needs --sampled-seeds (the seeds it resumes)")
    try:
        earlier_sampled(
            args.sampled_from, args.sampled_seeds, args.sampled_temperature, extend=args.sampled_s > 0
        )
    except ValueError as e:
        sys.exit(f"quality_recipe: {e}")
    problem = follow_problem(args) if args.follow_window else None
    if problem:
        sys.exit(f"quality_recipe: {problem}")
    missing = question_sets_missing([args.eval_args, args.chat_eval_args])
    if missing:
        sys.exit(f"quality_recipe: {missing}")

    work, logs = args.work, args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = Report(args.report, work)
    end = T0 + args.budget_s
    dev = shlex.split(args.device_args)
    answers = work / "answers.jsonl"

    # 1. regenerate bench: the decode engine beside its references on the same prompts (skipped with
    # --regen-bench-s 0, and when regenerate does not run: it only picks regenerate's engine).
    regenerates = args.regen_s > 0 or not answers.is_file()
    bench_json = work / "regen_bench.json"
    engine_args: list[str] = []
    if args.regen_bench_s > 0 and regenerates:
        _regenerate_bench(args, bench_json, logs, report)
        engine_args = _fastest_engine(bench_json, report)

    # 2. regenerate: the target's own answers, until its deadline (SIGINT keeps what is done).
    regen_data, regen_skip, regen_limit = Path(args.data), args.regen_skip, args.regen_limit
    if args.code_data is not None and args.code_limit > 0:
        # One regenerate over both (one start-up): the chat records it would read, then the code problems.
        # Named as --data (less .gz): a record's sample id hashes its source's name, so the chat records
        # keep theirs and regenerate resumes the answers kept from runs that read --data itself.
        regen_data = work / "prompts" / Path(args.data).name.removesuffix(".gz")
        regen_data.parent.mkdir(parents=True, exist_ok=True)
        n_code = combine_prompts(
            Path(args.data), args.regen_skip, args.regen_limit, args.code_data, args.code_limit, regen_data
        )
        regen_skip, regen_limit = 0, args.regen_limit + n_code
        report.note(
            f"regenerate reads records {args.regen_skip}–{args.regen_skip + args.regen_limit} of "
            f"{args.data} and {n_code} code problems of {args.code_data}"
        )
    if regenerates:
        s = Stage(
            name="regenerate",
            argv=dflash(
                "regenerate",
                "--target",
                args.target,
                "--data",
                str(regen_data),
                "--skip",
                str(regen_skip),
                "--limit",
                str(regen_limit),
                *shlex.split(args.regen_args),
                *engine_args,
                *dev,
                "--no-progress",
                "--out",
                str(answers),
            ),
            log=logs / "2_regenerate.log",
        ).start()
        run_all([s], time.time() + args.regen_s, grace=40)
        if not answers.is_file():
            # A killed run leaves parts: a rerun merges them (and answers nothing more with --limit 0).
            subprocess.run(
                dflash(
                    "regenerate",
                    "--target",
                    args.target,
                    "--data",
                    str(regen_data),
                    "--limit",
                    "0",
                    "--out",
                    str(answers),
                    "--no-progress",
                    *dev,
                ),
                cwd=ROOT,
                check=False,
            )
        n_answers = answers.read_bytes().count(b"\n") if answers.is_file() else 0  # not splitlines: U+2028
        report.stage(s, conversations=n_answers, throughput=tail(s.log, 3))
    else:
        # --regen-s 0 with answers in --work: train on them as they are (no start-up of the target to resume
        # them: 56 s on one H200 for nothing left to answer).
        n_answers = answers.read_bytes().count(b"\n")
        report.note(f"regenerate skipped (--regen-s 0): {n_answers} conversations as they are")
    if n_answers == 0:
        report.note("no regenerated answers: stopping")
        return

    # 3. caches, concurrently: this run's answers and any earlier run's (--extra-answers).
    train_data = work / "train-data.jsonl"
    n_extra = concatenate_answers([answers, *args.extra_answers], train_data)
    if args.extra_answers:
        report.note(f"training data: {n_answers} conversations of this run + {n_extra} of --extra-answers")
    sampled = sampled_answers(args, train_data, logs, report, dev) if args.sampled_seeds else []
    if sampled:
        greedy = work / "greedy-data.jsonl"
        os.replace(train_data, greedy)
        n_sampled = concatenate_answers([greedy, *sampled], train_data)
        report.note(
            f"training data: + {n_sampled} sampled conversations ({', '.join(p.name for p in sampled)})"
        )
    caches: dict[str, Path] = {}
    gens = []
    for codec in [c for c in args.codecs.split(",") if c]:
        cache = work / f"cache-{codec}"
        caches[codec] = cache
        codec_args = ([] if codec == "default" else ["--codec", codec]) + follow_generate_args(args)
        gens.append(
            Stage(
                name=f"generate_{codec}",
                argv=dflash(
                    "generate",
                    "--cache",
                    str(cache),
                    "--target",
                    args.target,
                    "--data",
                    str(train_data),
                    *shlex.split(args.gen_args),
                    *codec_args,
                    *dev,
                    "--no-progress",
                ),
                log=logs / f"3_generate_{codec}.log",
            ).start()
        )
    if args.original_cache:
        cache = work / "cache-original"
        caches["original"] = cache
        gens.append(
            Stage(
                name="generate_original",
                argv=dflash(
                    "generate",
                    "--cache",
                    str(cache),
                    "--target",
                    args.target,
                    "--data",
                    args.data,
                    "--limit",
                    str(n_answers),
                    *shlex.split(args.gen_args),
                    *dev,
                    "--no-progress",
                ),
                log=logs / "3_generate_original.log",
            ).start()
        )
    if args.follow_window:
        trained = follow_variant(args, caches, gens, work, logs, report, end)
    else:
        run_all(gens, time.time() + args.gen_s, grace=30)
        for g in gens:
            report.stage(g, log_tail=tail(g.log, 4))
        trained = _train_variants(args, caches, work, logs, report, end)

    # 5. eval every variant concurrently (batch 1 is latency-bound; the speeds are measured side by side).
    evals = []
    # Held-out prompts start after the records regenerate read (at least): --exclude-cache then drops any
    # the cache holds all the same.
    # With code problems in the answers, count the chat records by what regenerate read of them.
    chat_read = args.regen_limit if regen_data != Path(args.data) else n_answers
    held_out = ["--data", args.data, "--skip", str(args.regen_skip + chat_read)]
    kinds = [("eval", args.eval_args)] + ([("chat_eval", args.chat_eval_args)] if args.chat_eval_args else [])
    to_eval = trained
    if args.eval_variants == "best" and len(to_eval) > 1:
        best_chain = {n: best_chain_tau(report.data["variants"][n].get("validation") or []) for n in to_eval}
        scored = {n: t for n, t in best_chain.items() if t is not None}
        if scored:
            to_eval = [max(scored, key=lambda n: scored[n])]
            report.note(f"best validation chain τ: {best_chain}; evaluating {to_eval[0]} alone")
    for name in to_eval:
        drafter = Path(report.data["variants"][name]["drafter"])
        if not (drafter / "config.json").is_file():
            report.note(f"variant {name}: no exported drafter")
            continue
        for kind, eval_args in kinds:
            st = Stage(
                name=f"{kind}_{name}",
                argv=dflash(
                    "eval",
                    "--target",
                    args.target,
                    "--drafter",
                    str(drafter),
                    *shlex.split(eval_args),
                    *(held_out if reads_data(eval_args) else []),
                    "--exclude-cache",
                    str(caches["default"] if "default" in caches else caches[next(iter(caches))]),
                    "--json",
                    str(work / f"{kind}-{name}.json"),
                    "--no-progress",
                    *(["--device", "cuda"] if not args.smoke else []),
                ),
                log=logs / f"5_{kind}_{name}.log",
            )
            st.extra.update(variant=name, kind=kind)
            evals.append(st.start())
    run_all(evals, min(end - 60, time.time() + args.eval_s), grace=20)
    for st in evals:
        name, kind = st.extra["variant"], st.extra["kind"]
        path = work / f"{kind}-{name}.json"
        v = report.data["variants"][name]
        if path.is_file():
            rep = json.loads(path.read_text())
            v[kind] = {k: rep.get(k) for k in ("sets", "mean", "exactness", "summary", "warnings")}
            v[kind]["by_turn"] = tau_by_turn(rep.get("prompts") or [])
        v["tau_compare"] = tau_compare(v)
        v[f"{kind}_table"] = "\n".join(
            line for line in tail(st.log, 60).splitlines() if "%|" not in line and "it/s]" not in line
        )
        report.stage(st)

    report.note(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
