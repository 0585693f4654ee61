"""What a stop of ``dflash regenerate`` keeps of the tokens it decoded, and what its rerun decodes again.

One uninterrupted run of multi-turn chat data is the reference. Then, for each stop point (a fraction of
the reference's answers), a run is stopped by a real SIGINT to this process (the first Ctrl-C) once that
many answers have come back, and rerun twice from a copy of what it left: as ``dflash regenerate`` does now
(continuing the conversations in progress from ``<out>.partial``), and with ``<out>.partial`` deleted first,
which is what it did before (every conversation in flight answered again from its first turn). Reported:

  - decoded: tokens of every answer the stopped run finished, plus the tokens of the answers still in the
    engine at the stop (cut mid-answer, lost either way);
  - kept before: the tokens in the complete conversations it wrote (all that was kept before);
  - kept now: those plus the answered turns of the conversations in progress (``<out>.partial``);
  - rerun tokens before / now: new tokens the rerun decodes to finish the data set (the reference decodes
    ``total``); both reruns must end with the reference's output.

  python bench/regenerate_stop.py                                    # CPU: random:tiny, 48 ShareGPT records
  python bench/regenerate_stop.py --target default --limit 256 --max-new-tokens 128 --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.placement import Placement  # noqa: E402
from dflash_offline.regenerate.config import RegenerateConfig  # noqa: E402
from dflash_offline.regenerate.run import RegenerateStopped, RegenerateSummary, run_regenerate  # noqa: E402
from dflash_offline.regenerate.slot_engine import SlotEngine  # noqa: E402


class Instruments:
    """Counts the answers the engine returns, sends this process SIGINT once ``stop_after`` have come back,
    and records the tokens still in the engine when a stopped run closes it."""

    def __init__(self) -> None:
        self.answers = 0
        self.stop_after: int | None = None
        self.cut_tokens = 0
        poll, close = SlotEngine.poll, SlotEngine.close

        def counted_poll(engine: SlotEngine, timeout: float) -> Any:
            finished = poll(engine, timeout)
            self.answers += len(finished)
            if self.stop_after is not None and self.answers >= self.stop_after:
                self.stop_after = None
                os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a stop at the next check
            return finished

        def measured_close(engine: SlotEngine, *, abort: bool = False) -> None:
            rows = engine._engine._decoding.values()  # the rows cut mid-answer (bench-only peek)
            self.cut_tokens += sum(len(r.generated) for r in rows)
            close(engine, abort=abort)

        SlotEngine.poll = counted_poll  # type: ignore[method-assign]
        SlotEngine.close = measured_close  # type: ignore[method-assign]

    def reset(self) -> None:
        self.answers, self.cut_tokens = 0, 0


def answer_tokens(path: Path, key: str) -> int:
    """Generated tokens in ``path``: the output's assistant messages, or the partial file's answers."""
    if not path.exists():
        return 0
    total = 0
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if key == "messages":
            total += sum(len(m["token_ids"]) for m in record["messages"] if m["role"] == "assistant")
        else:
            total += sum(a["num_tokens"] for a in record["answers"])
    return total


def conversations(path: Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {line["source_sample_id"]: line["messages"] for line in lines}
    assert len(by_id) == len(lines), f"{path}: a conversation written twice"
    return by_id


def one_stop(
    args: argparse.Namespace, work: Path, instruments: Instruments, stop_after: int
) -> dict[str, Any]:
    """Stop a run after ``stop_after`` answers, then rerun it with and without its partial file."""
    out = work / f"stop{stop_after}" / "out.jsonl"
    instruments.reset()
    instruments.stop_after = stop_after
    try:
        run_regenerate(config(args, out))
        raise SystemExit(f"the run ended before {stop_after} answers: choose a smaller stop point")
    except RegenerateStopped as stopped:
        summary: RegenerateSummary = stopped.summary
    written = answer_tokens(out, "messages")
    partial = out.with_name(out.name + ".partial")
    kept = answer_tokens(partial, "answers")
    cut = instruments.cut_tokens
    decoded = summary.new_tokens + cut
    assert summary.new_tokens == written + kept, "every finished answer is written or kept"
    before = work / f"stop{stop_after}-before" / "out.jsonl"
    before.parent.mkdir()
    shutil.copy(out, before)
    reruns = {}
    for name, path in (("now", out), ("before", before)):
        instruments.reset()
        rerun = run_regenerate(config(args, path))
        assert rerun is not None
        reruns[name] = rerun.new_tokens
    return {
        "stop_after_answers": stop_after,
        "written_conversations": summary.written,
        "kept_conversations": summary.kept,
        "kept_turns": summary.kept_answers,
        "decoded_tokens": decoded,
        "cut_mid_answer_tokens": cut,
        "finished_answer_tokens": summary.new_tokens,
        "kept_before": written,
        "kept_now": written + kept,
        "kept_before_fraction": round(written / decoded, 4),
        "kept_now_fraction": round((written + kept) / decoded, 4),
        "kept_before_fraction_of_finished": round(written / summary.new_tokens, 4),
        "rerun_tokens_before": reruns["before"],
        "rerun_tokens_now": reruns["now"],
        "outputs": (out, before),
    }


def config(args: argparse.Namespace, out: Path) -> RegenerateConfig:
    return RegenerateConfig(
        out=out, data=args.data, target=args.target, limit=args.limit, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, progress=False,
        placement=Placement(threads_per_worker=args.threads),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:tiny")
    ap.add_argument("--data", default=None, help="chat data (default: the embedded ShareGPT file)")
    ap.add_argument("--limit", type=int, default=48, help="records answered")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8, help="slots (the window is twice as many)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: every core)")
    ap.add_argument("--stops", default="0.25,0.5,0.75", help="stop points, as fractions of all answers")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    instruments = Instruments()
    with tempfile.TemporaryDirectory(prefix="regenerate-stop-") as tmp:
        work = Path(tmp)
        reference = run_regenerate(config(args, work / "reference.jsonl"))
        assert reference is not None
        expected = conversations(work / "reference.jsonl")
        print(
            f"{args.target}, {args.limit} records: {reference.written} conversations, {reference.answers} "
            f"answers, {reference.new_tokens} new tokens (batch {args.batch_size}, window "
            f"{2 * args.batch_size}, {args.max_new_tokens} new tokens per answer)",
            flush=True,
        )
        rows = []
        for fraction in (float(f) for f in args.stops.split(",")):
            row = one_stop(args, work, instruments, max(1, round(fraction * reference.answers)))
            for path in row.pop("outputs"):
                assert conversations(path) == expected, f"{path}: not the uninterrupted run's output"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("stop after | decoded (cut) | kept before | kept now | rerun decodes before | now | of all")
    for r in rows:
        decoded = f"{r['decoded_tokens']} ({r['cut_mid_answer_tokens']})"
        kept = f"{r['kept_before_fraction']:>11.1%} | {r['kept_now_fraction']:>8.1%}"
        reruns = f"{r['rerun_tokens_before']:>20} | {r['rerun_tokens_now']:>4}"
        print(f"{r['stop_after_answers']:>10} | {decoded:>13} | {kept} | {reruns} | {reference.new_tokens}")
    if args.json:
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "total": reference.new_tokens}
        args.json.write_text(json.dumps({**result, "stops": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
