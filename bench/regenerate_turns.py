"""Multi-turn regenerate with and without the previous turn's KV cache reused, side by side in one run.

``dflash regenerate`` answers every human turn of a conversation, each prompt holding the conversation
so far; with reuse (``decode/parked.py``) a turn keeps its slot for the next turn, which prefills only what
its prompt adds. Both modes run the real ``Driver`` over ``SlotEngine`` on the same conversations (the
first ``--limit`` records of ``--data`` with at least ``--min-turns`` human turns; the embedded ShareGPT
file by default); "whole" drops the reuse hints, so every prompt is prefilled from its first token, which
is what regenerate did before. First each mode runs once, untimed, on ``--warmup`` other conversations (so
that the first mode timed does not pay the process's first-use costs); then the modes alternate
(``--repeats`` rounds, the order flipped each round). Each row gives the prefill tokens per conversation
(the engine's count, padding excluded), prefill forwards and steps, conversations/s and new tok/s (driver
start to last line
written; engine set-up apart), and what costs on a GPU beyond the tokens: the prefill forwards that attend
over the cache and their distinct shapes (those new to the process each cost cuDNN a plan), the decode
graphs captured, the share of decode rows that were live; the outputs of the modes are compared line
for line (equal on the CPU in float32).

``--kv reuse|whole`` runs one of the two modes only; ``--decode-attention padded live`` runs each mode
once per attention over the cache (``+live``: each row's live keys read in place, the flash kernel, on a
GPU in half precision), with each value's conversations/s as a ratio to the first's;
``--prefill-wait-steps 0 8`` runs each mode once per value of the engine's ``prefill_wait_steps`` (``dflash
regenerate --prefill-wait``: a prefill forward its prompts do not fill waits up to K steps while rows decode),
named ``whole+wait8`` etc., and the summary gives each value's conversations/s and prefill forwards as a ratio
to the first value's.

  python bench/regenerate_turns.py --target random:tiny --limit 24 --max-new-tokens 32 --batch-size 8
  python bench/regenerate_turns.py --target default --limit 512 --max-new-tokens 256 --batch-size 256 \\
      --max-prompt-tokens 1536 --repeats 2 --json out.json                                  # one H200
  python bench/regenerate_turns.py --target default --data sharegpt.jsonl --min-turns 1 --limit 2048 \\
      --max-new-tokens 256 --batch-size 1024 --max-batch-tokens 8192 --max-prompt-tokens 1536 \\
      --kv whole --prefill-wait-steps 0 8 --repeats 1 --warmup 64 --json wait.json   # prefill waits, one H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.data.conversations import Conversation  # noqa: E402
from dflash_offline.data.sources import iter_records  # noqa: E402
from dflash_offline.data.user_groups import user_groups  # noqa: E402
from dflash_offline.decode.steps import PrefillShape  # noqa: E402
from dflash_offline.regenerate.driver import KEY, ConversationSink, Driver  # noqa: E402
from dflash_offline.regenerate.engine_protocol import EngineOptions, Finished  # noqa: E402
from dflash_offline.regenerate.generation import GenerationSettings  # noqa: E402
from dflash_offline.regenerate.jsonl_out import ResumableJsonl  # noqa: E402
from dflash_offline.regenerate.slot_engine import SlotEngine  # noqa: E402
from dflash_offline.target_model.loader import (  # noqa: E402
    compute_dtype,
    load_target,
    resolve_device,
    stop_token_ids,
)


class WholePrompts:
    """``SlotEngine`` without the reuse hints: every turn's prompt prefilled from its first token."""

    name = "slots"

    def __init__(self, engine: SlotEngine) -> None:
        self.engine = engine

    def submit(
        self, key: str, prompt: Sequence[int], *, keep_slot: bool = False, continues: str | None = None
    ) -> None:
        self.engine.submit(key, prompt)

    def release(self, key: str) -> None:
        self.engine.release(key)

    def pending(self) -> int:
        return self.engine.pending()

    def poll(self, timeout: float) -> list[Finished]:
        return self.engine.poll(timeout)

    def close(self, *, abort: bool = False) -> None:
        self.engine.close(abort=abort)


def multi_turn(data: str | None, *, limit: int, min_turns: int) -> list[Conversation]:
    """The first ``limit`` conversations with at least ``min_turns`` human turns."""
    out: list[Conversation] = []
    for item in iter_records(data):
        if len(out) >= limit:
            break
        if isinstance(item, Conversation) and len(user_groups(item.messages)) >= min_turns:
            out.append(item)
    return out


def mode_name(reuse: bool, wait: int, attention: str = "padded") -> str:
    return (
        ("reuse" if reuse else "whole")
        + (f"+wait{wait}" if wait else "")
        + ("+live" if attention == "live" else "")
    )


def run_mode(
    reuse: bool,
    wait: int,
    attention: str,
    target: Any,
    convs: list[Conversation],
    settings: GenerationSettings,
    args: argparse.Namespace,
    seen_masked: set[PrefillShape],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One pass over ``convs``: its figures and its output lines. ``seen_masked``: the shapes of prefill
    forwards over the cache run before in this process (updated)."""
    options = EngineOptions(
        batch_size=args.batch_size, kv_tokens=args.kv_tokens, max_batch_tokens=args.max_batch_tokens,
        max_prompt_tokens=args.max_prompt_tokens, cuda_graphs=args.cuda_graphs == "on", prefill_wait=wait,
        reuse_kv=True,  # regenerate's default drops the hints on CUDA; this bench measures them
        live_attention=attention == "live",
    )  # fmt: skip
    device = next(target.model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    slots = SlotEngine(target.model, settings, options)
    setup = time.perf_counter() - t0
    engine = slots if reuse else WholePrompts(slots)
    with tempfile.TemporaryDirectory() as tmp:
        out, failed = Path(tmp) / "o.jsonl", Path(tmp) / "f.jsonl"
        with ResumableJsonl(out, key=KEY) as o, ResumableJsonl(failed, key=KEY) as f:
            sink = ConversationSink(
                out=o, failures=f, partial=Path(tmp) / "p.jsonl", source="bench", regenerated_by={},
                on_tally=lambda t: None,
                on_failure=lambda s: None,
            )  # fmt: skip
            driver = Driver(
                engine=engine, sink=sink, tokenizer=target.tokenizer,
                max_prompt_tokens=args.max_prompt_tokens, window=2 * slots.num_slots, done=lambda s: False,
            )  # fmt: skip
            start = time.perf_counter()
            driver.run(iter(convs), should_stop=lambda: False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        # The order lines are written in depends on the schedule; the lines themselves must not.
        # "\n" only: str.splitlines also breaks at U+2028 / U+0085, which the answers hold raw.
        written = out.read_text(encoding="utf-8").split("\n")
        lines = sorted((json.loads(x) for x in written if x), key=lambda d: d[KEY])
    decode = slots._engine
    total = sink.total
    shapes = decode.prefill_shapes
    masked = {k for k in shapes if not k.fresh}
    new_masked = masked - seen_masked
    seen_masked |= masked
    row = {
        "mode": mode_name(reuse, wait, attention),
        "prefill_wait_steps": wait,
        "reads_live_lengths": decode.cache.reads_live_lengths,
        "conversations": total.written,
        "failed": total.failed,
        "answers": total.answers,
        "new_tokens": total.new_tokens,
        "prefill_tokens": decode.num_prefill_tokens,
        "reused_tokens": decode.num_reused_tokens,
        "prefill_tokens_per_conversation": round(decode.num_prefill_tokens / max(1, total.written), 1),
        "prefill_forwards": decode.num_prefills,
        "prompt_tokens_per_prefill_forward": round(decode.num_prefill_tokens / max(1, decode.num_prefills)),
        "steps": decode.num_steps,
        # What the GPU pays that the counts above do not show (measured on the CPU with
        # random:tiny: 126 of 129 prefill forwards over the cache had a new shape, before padded shapes):
        # a forward attending over the cache may cost the kernel a plan for each (rows, width, attended
        # length) not seen before in the process; a decode graph is captured per (rows, attended length).
        "masked_prefill_forwards": sum(n for k, n in shapes.items() if not k.fresh),
        "masked_prefill_shapes": len(masked),
        "new_masked_prefill_shapes": len(new_masked),
        "fresh_prefill_shapes": len(shapes) - len(masked),
        "decode_shapes": len(decode.decode_shapes),
        "graphs_captured": decode.graphs.num_captured,
        "decode_rows_live_share": round(decode.num_live_rows / max(1, decode.num_decoded_rows), 3),
        "evictions": decode.num_evictions,
        "moves": decode.num_moves,
        "left_parked": decode.num_parked,
        "seconds": round(seconds, 3),
        "setup_seconds": round(setup, 3),
        "conversations_per_second": round(total.written / seconds, 3),
        "new_tokens_per_second": round(total.new_tokens / seconds, 1),
        # --json only: [rows, width, attended length, fresh, forwards] of every prefill shape.
        "prefill_shape_counts": sorted(
            [s.rows, s.width, s.attend_len, s.fresh, n] for s, n in shapes.items()
        ),
    }
    slots.close()
    return row, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:tiny")
    ap.add_argument("--data", default=None, help="chat data (default: the embedded ShareGPT file)")
    ap.add_argument("--limit", type=int, default=24, help="conversations")
    ap.add_argument("--min-turns", type=int, default=2, help="human turns a conversation needs")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=None)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    ap.add_argument("--kv", choices=["both", "reuse", "whole"], default="both", help="modes run")
    ap.add_argument(
        "--prefill-wait-steps", type=int, nargs="+", default=[0],
        help="the engine's prefill_wait_steps: each mode runs once per value (ratios to the first)",
    )  # fmt: skip
    ap.add_argument(
        "--decode-attention", nargs="+", choices=["padded", "live"], default=["padded"],
        help="the engine's attention over the cache (regenerate --decode-attention): each mode runs once per "
        "value (ratios to the first)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=2, help="rounds; each runs every mode, order flipped")
    ap.add_argument(
        "--warmup", type=int, default=8,
        help="conversations after the timed ones that each mode runs once, untimed, first (0: none)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    dtype = compute_dtype(args.dtype, device)
    target = load_target(args.target, device=device, dtype=dtype)
    found = multi_turn(args.data, limit=args.limit + args.warmup, min_turns=args.min_turns)
    convs, warm = found[: args.limit], found[args.limit :]
    turns = [len(user_groups(c.messages)) for c in convs]
    stop = stop_token_ids(target.tokenizer, target.model)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_ids=stop)
    print(
        f"target {args.target} on {device} ({dtype}), {args.threads} thread(s); {len(convs)} conversations "
        f"of {statistics.mean(turns):.1f} human turns on average (max {max(turns)}), "
        f"{args.max_new_tokens} new tokens, batch {args.batch_size}, max prompt {args.max_prompt_tokens}",
        flush=True,
    )
    seen_masked: set[PrefillShape] = set()
    kv_modes = {"both": (True, False), "reuse": (True,), "whole": (False,)}[args.kv]
    modes = [
        (reuse, wait, attention)
        for reuse in kv_modes
        for wait in args.prefill_wait_steps
        for attention in args.decode_attention
    ]
    if warm:
        # Untimed: the first mode timed must not pay the process's first-use costs (CUDA context, cuBLAS
        # and cuDNN handles, kernel loading) that the other then finds paid.
        for reuse, wait, attention in modes:
            row, _ = run_mode(reuse, wait, attention, target, warm, settings, args, seen_masked)
            print(f"warm-up {row['mode']} on {len(warm)} other conversations: {row['seconds']} s", flush=True)
    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.repeats):
        for reuse, wait, attention in modes if r % 2 == 0 else modes[::-1]:
            row, lines = run_mode(reuse, wait, attention, target, convs, settings, args, seen_masked)
            row["round"] = r
            rows.append(row)
            outputs.setdefault(row["mode"], lines)
            print(json.dumps({k: v for k, v in row.items() if k != "prefill_shape_counts"}), flush=True)
    names = [mode_name(*mode) for mode in modes]
    first = outputs[names[0]]
    summary: dict[str, Any] = {"identical_outputs": all(outputs[n] == first for n in names)}
    for name in names:
        mine = [r for r in rows if r["mode"] == name]
        summary[name] = {
            "prefill_tokens_per_conversation": mine[0]["prefill_tokens_per_conversation"],
            "prefill_forwards": mine[0]["prefill_forwards"],
            "steps": mine[0]["steps"],
            "median_conversations_per_second": statistics.median(r["conversations_per_second"] for r in mine),
            "median_new_tokens_per_second": statistics.median(r["new_tokens_per_second"] for r in mine),
        }
    if len(kv_modes) == 2:
        first_attention = args.decode_attention[0]
        reuse, whole = (
            summary[names[0]],
            summary[mode_name(False, args.prefill_wait_steps[0], first_attention)],
        )
        summary["prefill_ratio"] = round(
            reuse["prefill_tokens_per_conversation"] / whole["prefill_tokens_per_conversation"], 3
        )
        summary["speedup"] = round(
            reuse["median_conversations_per_second"] / whole["median_conversations_per_second"], 3
        )
    for reuse in kv_modes:
        base = summary[mode_name(reuse, args.prefill_wait_steps[0])]
        for wait in args.prefill_wait_steps[1:]:
            mine = summary[mode_name(reuse, wait)]
            mine["speedup_vs_first_wait"] = round(
                mine["median_conversations_per_second"] / base["median_conversations_per_second"], 3
            )
            mine["prefill_forwards_vs_first_wait"] = round(
                mine["prefill_forwards"] / base["prefill_forwards"], 3
            )
    for reuse in kv_modes:
        for wait in args.prefill_wait_steps:
            base = summary[mode_name(reuse, wait, args.decode_attention[0])]
            for attention in args.decode_attention[1:]:
                mine = summary[mode_name(reuse, wait, attention)]
                mine["speedup_vs_first_attention"] = round(
                    mine["median_conversations_per_second"] / base["median_conversations_per_second"], 3
                )
    print(json.dumps(summary), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "summary": summary}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
