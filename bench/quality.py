"""The quality benchmark (issue 10): regenerate → generate (bf16, fp8) → train variants concurrently
→ export → eval on MT-Bench, HumanEval, ShareGPT, on one H200 within a total time budget.

    PYTHONPATH=/tmp/site:$PWD python3 bench/quality.py --data .device/sharegpt-40k.jsonl.gz --out $OUT
    python3 bench/quality.py --smoke --out /tmp/q     # the same pipeline on the CPU, tiny sizes

Every stage is the real CLI under `timeout`, its log kept; a stage that fails or times out is
reported and the rest goes on with what exists (partial answers, the newest checkpoint). Training
variants run as concurrent processes on the one GPU (the SmolLM2-width drafter does not fill it);
the main variant's eval runs alone (its speed figures are clean), the others' concurrently (τ only).
$OUT gets: summary.json, summary.md, logs.tar.gz, metrics-<variant>.jsonl (≤ 8 files).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Variant name → (cache codec, extra train flags). "main" is the proposed recipe; the others isolate
# one change each. fp8 runs only when `dflash generate --codec fp8` exists.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "main": ("bf16", ["--feature-scale", "dim", "--final-norm-init", "0.1"]),
    "fp8": ("fp8", ["--feature-scale", "dim", "--final-norm-init", "0.1"]),
    "landed": ("bf16", []),
    "norm-only": ("bf16", ["--final-norm-init", "0.1"]),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    regen_records: int
    regen_new_tokens: int
    regen_s: int
    generate_s: int
    max_len: int
    train_steps: int
    train_s: int
    tokens_per_microbatch: int
    eval_limit: int
    eval_new_tokens: int
    eval_s: int
    budget_s: int


GPU = Sizes(
    regen_records=20000, regen_new_tokens=512, regen_s=280, generate_s=170, max_len=2048,
    train_steps=3000, train_s=450, tokens_per_microbatch=8192,
    eval_limit=8, eval_new_tokens=128, eval_s=240, budget_s=1380,
)  # fmt: skip
SMOKE = Sizes(
    regen_records=12, regen_new_tokens=16, regen_s=300, generate_s=300, max_len=256,
    train_steps=6, train_s=400, tokens_per_microbatch=1024,
    eval_limit=1, eval_new_tokens=8, eval_s=400, budget_s=1800,
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class Stage:
    name: str
    command: str
    seconds: float = 0.0
    rc: int | None = None
    timed_out: bool = False
    log: str = ""


@dataclass(kw_only=True, slots=True)
class Bench:
    out: Path
    work: Path
    start: float = field(default_factory=time.perf_counter)
    stages: list[Stage] = field(default_factory=list)
    budget_s: int = 0

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def launch(self, name: str, args: list[str], timeout_s: float) -> tuple[Stage, subprocess.Popen[bytes]]:
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        t = max(5, int(min(timeout_s, self.left() - 10)))
        cmd = ["timeout", "-s", "INT", "-k", "30", str(t), sys.executable, "-m", "dflash_offline", *args]
        stage = Stage(name=name, command="dflash " + " ".join(args), log=str(log))
        print(
            f"[{time.perf_counter() - self.start:6.0f} s] start {name} (timeout {t} s): {stage.command}",
            flush=True,
        )
        proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        setattr(proc, "_t0", time.perf_counter())
        return stage, proc

    def wait(self, stage: Stage, proc: subprocess.Popen[bytes]) -> Stage:
        stage.rc = proc.wait()
        stage.seconds = time.perf_counter() - getattr(proc, "_t0")
        stage.timed_out = stage.rc in (124, 130, 137, -2)
        self.stages.append(stage)
        tail = Path(stage.log).read_text(errors="replace").strip().splitlines()[-1:] or [""]
        print(
            f"[{time.perf_counter() - self.start:6.0f} s] {stage.name}: rc {stage.rc}, {stage.seconds:.0f} s | {tail[0][:160]}",
            flush=True,
        )
        return stage

    def run(self, name: str, args: list[str], timeout_s: float) -> Stage:
        return self.wait(*self.launch(name, args, timeout_s))

    def parallel(self, jobs: list[tuple[str, list[str]]], timeout_s: float) -> list[Stage]:
        started = [self.launch(n, a, timeout_s) for n, a in jobs]
        return [self.wait(s, p) for s, p in started]


def _has_codec(name: str) -> bool:
    from dflash_offline.cache.codecs import CODECS

    return name in CODECS


def _count_lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def _acc_at(metrics: Path, steps: list[int], window: int = 10) -> dict[str, object]:
    """Mean position-k accuracy and simulated τ over the `window` steps ending at each step."""
    if not metrics.exists():
        return {}
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    out: dict[str, object] = {"steps_done": rows[-1]["step"] if rows else 0,
                              "first_loss": rows[0]["loss"] if rows else None,
                              "tokens_per_s": (sum(r["tokens"] for r in rows[5:]) / max(1e-9, sum(r["step_seconds"] for r in rows[5:]))) if len(rows) > 5 else None}  # fmt: skip
    for s in [*steps, rows[-1]["step"] if rows else 0]:
        near = [r for r in rows if s - window < r["step"] <= s]
        if not near or s == 0:
            continue
        acc = [
            sum(r["acc_by_position"][k] for r in near) / len(near)
            for k in range(len(near[0]["acc_by_position"]))
        ]
        out[f"step_{s}"] = {"acc": [round(a, 3) for a in acc[:8]],
                            "tau_sim": round(sum(r["simulated_tau"] for r in near) / len(near), 3),
                            "loss": round(sum(r["loss"] for r in near) / len(near), 3)}  # fmt: skip
    return out


def _eval_table(report: Path) -> list[dict[str, object]]:
    if not report.exists():
        return []
    data = json.loads(report.read_text())
    rows = []
    for s in [*(data.get("sets") or []), {"name": "pooled", **(data.get("summary") or {})}]:
        rows.append({k: s.get(k) for k in ("name", "tau", "target_tokens_per_s", "spec_tokens_per_s", "speedup", "num_prompts", "new_tokens", "identical_prompts", "mismatches")})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, help="ShareGPT/chat JSONL (or .jsonl.gz) of first turns")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/quality-out")))
    p.add_argument("--work", type=Path, default=Path("/tmp/dflash-quality"))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: proves every stage and flag")
    p.add_argument("--target", default="default")
    p.add_argument("--budget-s", type=int, default=None, help="total wall-clock budget (GPU: 1380)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    args = p.parse_args()
    sz = SMOKE if args.smoke else GPU
    bench = Bench(out=args.out, work=args.work, budget_s=args.budget_s or sz.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    w = args.work
    place = [] if args.smoke else ["--gpus", "0"]
    device = ["--device", "cpu"] if args.smoke else ["--device", "cuda"]
    prog = ["--no-progress"]

    # Data: the first turns (gunzipped if needed).
    data = w / "prompts.jsonl"
    if args.data is None:
        sys.exit("--data is required (a ShareGPT/chat JSONL, optionally .gz)")
    opener = gzip.open if str(args.data).endswith(".gz") else open
    with opener(args.data, "rt") as src, open(data, "w") as dst:  # type: ignore[operator]
        shutil.copyfileobj(src, dst)

    # 1. regenerate: the target's own answers, capped by time (resumable: a stopped run keeps its answers).
    answers = w / "answers.jsonl"
    bench.run("regenerate", ["regenerate", "--target", args.target, "--data", str(data), "--out", str(answers),
                             "--limit", str(sz.regen_records), "--max-new-tokens", str(sz.regen_new_tokens),
                             "--max-prompt-tokens", "1024", *place, *prog], sz.regen_s)  # fmt: skip
    n_answers = _count_lines(answers)
    print(f"answers: {n_answers}", flush=True)
    if n_answers == 0:
        sys.exit("regenerate produced no answers: see logs/regenerate.log")

    # 2. generate: bf16 cache, and fp8 from the same answers when the codec exists (concurrently).
    codecs = ["bf16"] + (["fp8"] if _has_codec("fp8") else [])
    gen_common = ["--target", args.target, "--data", str(answers), "--max-len", str(sz.max_len),
                  "--too-long", "truncate", *place, *prog]  # fmt: skip
    jobs = []
    for c in codecs:
        extra = ["--codec", "fp8"] if c == "fp8" else []
        jobs.append((f"generate-{c}", ["generate", "--cache", str(w / f"cache-{c}"), *gen_common, *extra]))
    bench.parallel(jobs, sz.generate_s)

    # 3. train the variants concurrently (time-capped; a stopped run is exported from its newest checkpoint).
    chosen = [v for v in args.variants.split(",") if v in VARIANTS and VARIANTS[v][0] in codecs]
    reserve = (sz.eval_s * 2 + 60) if not args.smoke else 60
    train_s = min(sz.train_s, bench.left() - reserve)
    ckpt = max(1, min(250, sz.train_steps // 3))
    jobs = []
    for v in chosen:
        codec, extra = VARIANTS[v]
        jobs.append((f"train-{v}", ["train", "--cache", str(w / f"cache-{codec}"), "--out", str(w / f"run-{v}"),
                                    "--max-steps", str(sz.train_steps), "--epochs", "1000", "--grad-accum", "2",
                                    "--tokens-per-microbatch", str(sz.tokens_per_microbatch),
                                    "--checkpoint-every", str(ckpt), "--keep-checkpoints", "1", "--loader-threads", "3",
                                    *(["--num-layers", "1", "--block-size", "8", "--num-anchors", "64"] if args.smoke else []),
                                    *(["--export-initial"] if v == "main" else []),
                                    *extra, *place, *prog]))  # fmt: skip
    bench.parallel(jobs, train_s)

    # 4. export each run's newest checkpoint (also when training was stopped by its timeout).
    bench.parallel(
        [(f"export-{v}", ["export", str(w / f"run-{v}"), "--out", str(w / f"drafter-{v}")]) for v in chosen],
        120,
    )

    # 5. eval: main alone (clean speed), then the others concurrently (τ).
    ev = ["--target", args.target, "--bench", "all", "--limit", str(sz.eval_limit), "--max-new-tokens",
          str(sz.eval_new_tokens), "--exclude-cache", str(w / "cache-bf16"), *device, *prog]  # fmt: skip
    ready = [v for v in chosen if (w / f"drafter-{v}" / "model.safetensors").exists()]
    if "main" in ready:
        bench.run("eval-main", ["eval", "--drafter", str(w / "drafter-main"), *ev, "--json", str(w / "eval-main.json")], sz.eval_s)  # fmt: skip
    others = [v for v in ready if v != "main"]
    if (w / "run-main" / "drafter-initial").exists():
        others.append("initial")
    bench.parallel([(f"eval-{v}", ["eval", "--drafter", str(w / ("run-main/drafter-initial" if v == "initial" else f"drafter-{v}")),
                                   *ev, "--json", str(w / f"eval-{v}.json")]) for v in others], min(sz.eval_s, max(30, bench.left() - 30)))  # fmt: skip

    # Summary.
    steps = [250, 500, 1000, 1500, 2000, 3000] if not args.smoke else [2, 4, 6]
    summary = {
        "smoke": args.smoke,
        "sizes": asdict(sz),
        "answers": n_answers,
        "codecs": codecs,
        "variants": {
            v: {
                "codec": VARIANTS[v][0],
                "train_flags": VARIANTS[v][1],
                "training": _acc_at(w / f"run-{v}" / "metrics.jsonl", steps),
                "eval": _eval_table(w / f"eval-{v}.json"),
            }
            for v in chosen
        },  # fmt: skip
        "initial_eval": _eval_table(w / "eval-initial.json"),
        "stages": [asdict(s) for s in bench.stages],
        "total_seconds": time.perf_counter() - bench.start,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "summary.md").write_text(_markdown(summary))
    for v in chosen[:4]:
        m = w / f"run-{v}" / "metrics.jsonl"
        if m.exists():
            shutil.copy(m, args.out / f"metrics-{v}.jsonl")
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(w / "logs", arcname="logs")
        for f in w.glob("eval-*.json"):
            tar.add(f, arcname=f.name)
    print(_markdown(summary), flush=True)


def _markdown(s: dict) -> str:  # type: ignore[type-arg]
    lines = ["| stage | seconds | rc |", "|---|---|---|"]
    lines += [
        f"| {st['name']} | {st['seconds']:.0f} | {st['rc']}{' (timeout)' if st['timed_out'] else ''} |"
        for st in s["stages"]
    ]
    lines += ["", f"answers regenerated: {s['answers']}; total {s['total_seconds']:.0f} s", ""]
    lines += [
        "| variant | codec | steps | first loss | acc by position (last steps) | τ sim |",
        "|---|---|---|---|---|---|",
    ]
    for v, d in s["variants"].items():
        t = d["training"]
        last = t.get(f"step_{t.get('steps_done')}", {}) if t else {}
        lines.append(
            f"| {v} | {d['codec']} | {t.get('steps_done')} | {t.get('first_loss')} | {last.get('acc')} | {last.get('tau_sim')} |"
        )
    lines += ["", "Training curves (acc by position, τ sim) at steps:"]
    for v, d in s["variants"].items():
        for k, val in (d["training"] or {}).items():
            if k.startswith("step_"):
                lines.append(f"- {v} {k}: acc {val['acc']} τ_sim {val['tau_sim']} loss {val['loss']}")
    lines += ["", "| variant | set | τ | target tok/s | spec tok/s | speedup |", "|---|---|---|---|---|---|"]
    for v, d in [*s["variants"].items(), ("initial", {"eval": s["initial_eval"]})]:
        for r in d["eval"]:
            lines.append(
                f"| {v} | {r['name']} | {r['tau']} | {r['target_tokens_per_s']} | {r['spec_tokens_per_s']} | {r['speedup']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
