"""Where a drafter's held-out τ goes on one kind of data: ``dflash train``'s validation chain τ on held-out
answers (teacher-forced drafts over cached features) beside ``dflash eval``'s τ decoded live on the same
records, on a standard set (HumanEval by default) and on other prompt files, side by side.

- validation chain τ ≈ eval on the same records: training and decoding see the same thing on this data
  (a gap would be a train/inference mismatch: features, positions, template, anchor rule);
- eval on the same records against eval on HumanEval or another prompt file: how far those prompts are from
  the data (the distribution's part of a set's τ).

    PYTHONPATH=. .venv/bin/python bench/heldout_gap.py --drafter RUN/drafter --answers ANSWERS.jsonl \\
        --work DIR [--prompts NAME=FILE ...] [--bench humaneval] [--limit 20]

``--answers``: chat JSONL the target answered itself that the drafter never trained on (e.g. ``dflash
regenerate --target default --data PROBLEMS.jsonl --out ANSWERS.jsonl --max-new-tokens 256`` over code
problems of a set it did not train on). They are cached (``dflash generate --target default``) and
validated as ``bench/fp8_validation.py`` does (``dflash train --init-from DRAFTER --lr 1e-12 --max-steps
1``, ``--val-samples`` of them held out by a hash of their ids: the drafter's own weights; the run is read
again, not rerun, when it holds its validation). Then ``dflash eval`` of that run's drafter decodes the
held-out records (``--bench validation``) and ``--bench`` live, and each ``--prompts`` file's first
``--limit`` records (``--bench sharegpt --data FILE``: prompts the drafter never trained on). A rerun
reuses every report in DIR. On 2 CPU cores a prompt of 256 new tokens takes ≈ 15 s to decode both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from fp8_validation import dflash, run, validate_as_is  # noqa: E402


def eval_sets(report: Path) -> dict[str, dict]:
    """Each question set of an eval report, by name (its τ, prompts decoded, cycles …)."""
    data = json.loads(report.read_text())
    return {s["name"]: s for s in data["sets"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, required=True, help="an exported drafter (RUN/drafter)")
    ap.add_argument("--answers", type=Path, required=True, help="chat JSONL of the target's own answers")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--val-samples", type=int, default=40)
    ap.add_argument("--bench", default="humaneval", help="dflash eval's standard sets beside validation")
    ap.add_argument(
        "--prompts", action="append", default=[], help="NAME=FILE: held-out prompts decoded as one more set"
    )
    ap.add_argument("--limit", type=int, default=20, help="questions a set")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cache, out = args.work / "cache", args.work / "run"
    run(
        dflash("generate", "--cache", str(cache), "--target", "default", "--data", str(args.answers),
               "--max-len", "2048", "--too-long", "truncate", "--no-progress"),
        args.work / "generate.log",
    )  # fmt: skip
    validation = validate_as_is(
        args.drafter, cache, out, args.work / "train.log", val_samples=args.val_samples,
        chain_tokens=args.max_new_tokens,
    )  # fmt: skip
    common = ["--drafter", str(out / "drafter"), "--target", "default", "--limit", str(args.limit),
              "--max-new-tokens", str(args.max_new_tokens), "--no-progress"]  # fmt: skip
    reports = {"standard": (["--bench", f"validation,{args.bench}"], args.work / "eval-standard.json")}
    for spec in args.prompts:
        name, _, path = spec.partition("=")
        reports[name] = (["--bench", "sharegpt", "--data", path], args.work / f"eval-{name}.json")
    sets: dict[str, dict] = {}
    for name, (flags, report) in reports.items():
        if not report.is_file():
            run(dflash("eval", *common, *flags, "--json", str(report)), args.work / f"eval-{name}.log")
        for set_name, s in eval_sets(report).items():
            sets[name if set_name == "sharegpt" else set_name] = s
    chain = validation["val_chain_tau"]
    print(f"validation chain τ over {validation['val_num_samples']} held-out records: {chain:.3f}")
    print(f"\n{'eval set':<28} {'prompts':>7} {'τ':>7} {'÷ validation chain τ':>21}")
    for name, s in sets.items():
        print(f"{name:<28} {s['num_prompts']:>7} {s['tau']:>7.3f} {s['tau'] / chain:>21.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"validation": validation, "sets": sets}, indent=1) + "\n")


if __name__ == "__main__":
    main()
