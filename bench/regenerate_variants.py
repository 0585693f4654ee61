"""``dflash regenerate``'s engine variants side by side in one run: the same command on the same records,
one variant after another for the same wall time each, through ``bench/regenerate_profile.py`` (so each
also gets its kernel profile and its driver's seconds). Prints each variant's new tokens/s and ms a step
from regenerate's own throughput line, as a ratio to the first variant, and writes them as JSON.

A variant is a name and regenerate flags; ``--tree NAME=DIR`` runs that variant from another checkout
(e.g. an earlier commit's ``dflash_offline`` and ``bench``: ``git archive COMMIT dflash_offline bench``),
with today's ``regenerate_profile.py`` copied in (its timers detect an engine without ``_collect``). Each
variant stops with a SIGINT after ``--seconds`` (regenerate keeps every finished answer) and writes its own
answers file, so each variant starts from the same records. Everything after ``--`` is regenerate's own
arguments, ``--out`` excepted:

    python bench/regenerate_variants.py --seconds 72 --out-dir /tmp/ab --tree before=/tmp/before \\
      --variants '{"before": "", "now": "", "graphs": "--prefill-graphs on",
                   "live": "--decode-attention live"}' \\
      -- --target default --data PROMPTS --skip 12600 --max-new-tokens 256 --max-prompt-tokens 1536 \\
      --batch-size 1024 --max-batch-tokens 8192 --gpus 0 --no-progress

On the CPU (``--target random:tiny --limit 30 --batch-size 16``) it runs as a smoke test of the variants.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

THROUGHPUT = re.compile(
    r"throughput: ([\d,]+) conversations, ([\d,]+) answers, ([\d,]+) new tokens, ([\d,]+) new tok/s over "
    r"([\d.]+) s of generation.*?engine: ([\d,]+) steps decoding a mean ([\d.]+) of ([\d,]+) slots.*? in "
    r"([\d.]+) s"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class VariantResult:
    """One variant's figures, from regenerate's throughput line."""

    name: str
    flags: str
    tree: str
    returncode: int
    conversations: int
    new_tokens: int
    new_tok_per_s: float
    generation_s: float
    steps: int
    mean_decoding_slots: float
    step_ms: float
    """Seconds inside the engine's steps over the steps (the wall time a step, the host's included)."""


def parse_throughput(log: str) -> dict[str, float] | None:
    """The figures of regenerate's last throughput line in ``log`` (None without one)."""
    found = THROUGHPUT.findall(log)
    if not found:
        return None
    conv, _answers, tokens, rate, gen_s, steps, mean, _slots, steps_s = found[-1]

    def num(text: str) -> float:
        return float(text.replace(",", ""))

    return {
        "conversations": num(conv),
        "new_tokens": num(tokens),
        "new_tok_per_s": num(rate),
        "generation_s": num(gen_s),
        "steps": num(steps),
        "mean_decoding_slots": num(mean),
        "step_ms": 1000.0 * num(steps_s) / max(num(steps), 1.0),
    }


def run_variant(
    name: str, flags: str, tree: Path, regen_args: list[str], out_dir: Path, seconds: float
) -> VariantResult:
    """Run one variant for ``seconds`` (then SIGINT, 60 s to stop, then SIGKILL)."""
    script = tree / "bench" / "regenerate_profile.py"
    if tree.resolve() != ROOT.resolve():  # the same measurement for every tree: today's script
        script.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "bench" / "regenerate_profile.py", script)
    vdir = out_dir / name
    vdir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, str(script), "--driver-json", str(vdir / "driver.json"), "--skip", "300", "--active",
        "20", "--json", str(vdir / "profile.json"), "--", *regen_args, *shlex.split(flags), "--out",
        str(vdir / "answers.jsonl"),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    log_path = vdir / "log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    figures = parse_throughput(log_path.read_text(errors="replace")) or {}
    return VariantResult(
        name=name,
        flags=flags,
        tree=str(tree),
        returncode=proc.returncode,
        conversations=int(figures.get("conversations", 0)),
        new_tokens=int(figures.get("new_tokens", 0)),
        new_tok_per_s=figures.get("new_tok_per_s", 0.0),
        generation_s=figures.get("generation_s", 0.0),
        steps=int(figures.get("steps", 0)),
        mean_decoding_slots=figures.get("mean_decoding_slots", 0.0),
        step_ms=round(figures.get("step_ms", 0.0), 2),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variants", required=True, help='JSON {name: "regenerate flags"}; the first is the base'
    )
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR: run variant NAME from DIR")
    ap.add_argument(
        "--seconds", type=float, default=72.0, help="wall time of each variant, start-up included"
    )
    ap.add_argument("--out-dir", type=Path, required=True, help="each variant's answers, log and profile")
    ap.add_argument("--json", type=Path, help="the results (default: OUT_DIR/variants.json)")
    ap.add_argument("regen_args", nargs=argparse.REMAINDER, help="-- then regenerate's arguments")
    args = ap.parse_args()
    regen_args = args.regen_args[1:] if args.regen_args[:1] == ["--"] else args.regen_args
    if "--out" in regen_args:
        ap.error("--out is per variant (OUT_DIR/NAME/answers.jsonl)")
    variants: dict[str, str] = json.loads(args.variants)
    trees = dict(t.split("=", 1) for t in args.tree)
    unknown = set(trees) - set(variants)
    if unknown:
        ap.error(f"--tree for no variant: {sorted(unknown)}")
    results = []
    for name, flags in variants.items():
        start = time.time()
        r = run_variant(name, flags, Path(trees.get(name, ROOT)), regen_args, args.out_dir, args.seconds)
        results.append(r)
        print(
            f"{name:>10}: {r.new_tok_per_s:>9,.0f} new tok/s, {r.step_ms:6.2f} ms a step, "
            f"{r.mean_decoding_slots:7.1f} slots decoding, {r.conversations:,} conversations "
            f"(rc {r.returncode}, {time.time() - start:.0f} s)",
            flush=True,
        )
    base = results[0]
    print(f"against {base.name}:")
    for r in results[1:]:
        rate = r.new_tok_per_s / base.new_tok_per_s if base.new_tok_per_s else float("nan")
        step = r.step_ms / base.step_ms if base.step_ms else float("nan")
        print(f"{r.name:>10}: {rate:.2f}x new tok/s, {step:.2f}x ms a step")
    out = args.json or args.out_dir / "variants.json"
    out.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
