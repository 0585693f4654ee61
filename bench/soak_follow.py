"""Soak test of ``dflash generate --window-limit`` beside ``dflash train --follow`` under SIGKILL: many
rounds, each on its own generated chat data, with random kills of generate, of train or of both at random
points; every killed command is rerun with the same command, then both run to their end.

After each round: every training sample trained exactly its ``--passes`` (counted from the run's records),
every sealed training store retired by the run and no validation store, no retired store read, verify
clean, and every sample committed once and bit-equal to a plain generate's of the same data
(tests/train/follow_kill_helpers.py: ``check_against_reference``). A round that fails keeps its folder.

    PYTHONPATH=. python bench/soak_follow.py --rounds 10 --kills 4
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.generate.helpers import generate_cmd, make_chat_jsonl, run_in_process  # noqa: E402
from tests.train.follow_kill_helpers import (  # noqa: E402
    VICTIMS,
    KillOutcome,
    check_against_reference,
    follow_cmd,
    kill_during_follow,
    window_generate_cmd,
)


def one_round(
    work: Path, seed: int, kills: int, records: int, delay_s: tuple[float, float]
) -> list[KillOutcome]:
    rng = np.random.default_rng(seed)
    data = make_chat_jsonl(work / "chat.jsonl", records, seed=seed)
    reference = work / "reference"
    run_in_process(generate_cmd(reference, data))
    cache, run = work / "window", work / "run"
    victims = [str(v) for v in rng.choice(VICTIMS, size=kills)]
    outcomes = kill_during_follow(
        window_generate_cmd(cache, data), follow_cmd(cache, run), victims, rng, work / "logs", delay_s=delay_s
    )
    check_against_reference(cache, run, reference)
    return outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--kills", type=int, default=4, help="kills a round")
    ap.add_argument("--records", type=int, default=60, help="generated chat records a round")
    ap.add_argument(
        "--seed", type=int, default=0, help="round r uses seed + r (its data, victims and delays)"
    )
    ap.add_argument("--delay", type=float, nargs=2, default=(1.0, 8.0), metavar=("MIN", "MAX"),
                    help="seconds from one kill (or the start) to the next, uniform")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=None, help="failed rounds are kept here")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-soak-follow-"))
    landed: Counter[str] = Counter()
    missed = 0
    failed: list[int] = []
    started = time.perf_counter()
    for r in range(args.rounds):
        work = workdir / f"round-{args.seed + r}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.perf_counter()
        try:
            outcomes = one_round(work, args.seed + r, args.kills, args.records, tuple(args.delay))
        except AssertionError:
            failed.append(args.seed + r)
            print(
                f"round {args.seed + r}: FAILED, kept in {work}\n{traceback.format_exc()[-3000:]}", flush=True
            )
            continue
        for o in outcomes:
            landed.update(o.landed)
            missed += not o.landed
        plan = ", ".join(f"{o.victim} {o.delay_s:.1f}s{'' if o.landed else ' (ended)'}" for o in outcomes)
        print(f"round {args.seed + r}: ok in {time.perf_counter() - t0:.0f} s; kills: {plan}", flush=True)
        shutil.rmtree(work)
    rounds_ok = args.rounds - len(failed)
    print(
        f"\n{args.rounds} rounds in {time.perf_counter() - started:.0f} s: {rounds_ok} passed every check, "
        f"{len(failed)} failed {failed or ''}\nkills that found their command running: generate "
        f"{landed['generate']}, train {landed['train']}; kills that found it ended (rerun only): {missed}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
