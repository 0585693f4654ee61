"""New tokens/s of ``dflash regenerate``'s engine, the decode engine (``slots``), side by side in one run on
the same prompts with transformers' own ways as references (``bench/reference_engines.py``): sorted
static ``generate`` batches (``static``) and transformers' continuous batching (``cb``).

The prompts are the first user turns of the first ``--limit`` records, rendered with the chat template;
every engine gets all of them at once and is timed from the first submit to the last answer (model load
and engine set-up, e.g. the KV cache and CUDA graphs, are reported apart). Each reference's greedy answers
are compared with the decode engine's (equal on the CPU in float32; in bf16 they may part at near-ties).

  python bench/regenerate.py --target random:tiny --limit 16 --max-new-tokens 16 --batch-size 8  # CPU smoke
  python bench/regenerate.py --target default --data sharegpt.jsonl --limit 512 --max-new-tokens 256 \\
      --batch-size 256 --json out.json                                                           # one H200
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.first_turns import first_turns  # noqa: E402
from bench.reference_engines import DEFAULT_KV_TOKENS, ReferenceOptions, reference_engine  # noqa: E402
from dflash_offline.regenerate.engine_protocol import EngineOptions  # noqa: E402
from dflash_offline.regenerate.generation import GeneratedTokens, GenerationSettings  # noqa: E402
from dflash_offline.regenerate.slot_engine import SlotEngine  # noqa: E402
from dflash_offline.target_model.loader import (  # noqa: E402
    compute_dtype,
    load_target,
    resolve_device,
    stop_token_ids,
)


def make_engine(
    name: str,
    model: Any,
    settings: GenerationSettings,
    args: argparse.Namespace,
    batch_size: int,
    pad_id: int,
) -> Any:
    """``slots`` (regenerate's engine) or a reference (``static``, ``cb``) at ``batch_size``."""
    if name == "slots":
        options = EngineOptions(
            batch_size=batch_size, kv_tokens=args.kv_tokens, max_batch_tokens=args.max_batch_tokens,
            max_prompt_tokens=args.max_prompt_tokens, cuda_graphs=args.cuda_graphs != "off",
        )  # fmt: skip
        return SlotEngine(model, settings, options)
    budget = max(args.kv_tokens or DEFAULT_KV_TOKENS, args.max_prompt_tokens + args.max_new_tokens)
    reference = ReferenceOptions(
        batch_size=batch_size, kv_tokens=budget, max_batch_tokens=args.max_batch_tokens,
        cuda_graphs=args.cuda_graphs, pad_id=pad_id,
    )  # fmt: skip
    return reference_engine(name, model, settings, reference)


def run_engine(
    make: Any, model: Any, prompts: list[list[int]], limit_s: float
) -> tuple[dict[str, Any], dict[int, GeneratedTokens]]:
    """Time one engine (``make()`` builds it) over every prompt, submitted at once."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = make()
    setup = time.perf_counter() - t0
    answers: dict[int, GeneratedTokens] = {}
    start = time.perf_counter()
    timed_out = False
    try:
        for i, p in enumerate(prompts):
            engine.submit(str(i), p)
        while len(answers) < len(prompts):
            if time.perf_counter() - start > limit_s:
                timed_out = True
                break
            for f in engine.poll(timeout=0.5):
                answers[int(f.key)] = f.tokens
        seconds = time.perf_counter() - start
    finally:
        engine.close(abort=timed_out)
    new_tokens = sum(len(a.token_ids) for a in answers.values())
    row = {
        "engine": engine.name,
        "prompts": len(prompts),
        "answered": len(answers),
        "timed_out": timed_out,
        "new_tokens": new_tokens,
        "seconds": round(seconds, 3),
        "setup_seconds": round(setup, 3),
        "new_tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else 0.0,
        "stopped": sum(a.finish_reason == "stop" for a in answers.values()),
    }
    if device.type == "cuda":
        row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row, answers


def compare(a: dict[int, GeneratedTokens], b: dict[int, GeneratedTokens]) -> dict[str, Any]:
    common = sorted(set(a) & set(b))
    firsts = []
    for i in common:
        x, y = a[i].token_ids, b[i].token_ids
        if x != y:
            firsts.append(next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))))
    return {
        "compared": len(common),
        "identical": len(common) - len(firsts),
        "median_first_divergence": statistics.median(firsts) if firsts else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:tiny")
    ap.add_argument("--data", default=None, help="chat data (default: the embedded ShareGPT file)")
    ap.add_argument(
        "--limit", type=int, default=64, help="records read (their first user turns are the prompts)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=None, help="default: 256 on CUDA, 16 on the CPU")
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help=f"default: slots as dflash regenerate (the free GPU memory), the references {DEFAULT_KV_TOKENS}",
    )
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument(
        "--cuda-graphs",
        choices=["auto", "on", "off"],
        default="auto",
        help="auto: on for slots, transformers' choice for cb",
    )
    ap.add_argument(
        "--engines", default="slots,static,cb", help="of slots, static, cb; measured in this order"
    )
    ap.add_argument(
        "--cb-batch-sizes",
        default=None,
        help="comma-separated batch sizes to measure cb at (each its own run; default: --batch-size)",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--limit-seconds", type=float, default=240.0, help="per engine; partial figures after it")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    device = resolve_device(args.device)
    dtype = compute_dtype(args.dtype, device)
    t0 = time.perf_counter()
    target = load_target(args.target, device=device, dtype=dtype)
    load_seconds = time.perf_counter() - t0
    tokenizer = target.tokenizer
    prompts = [
        turn.prompt_ids
        for turn in first_turns(
            tokenizer, args.data, max_prompt_tokens=args.max_prompt_tokens, records=args.limit
        )
    ]
    stop = stop_token_ids(tokenizer, target.model)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop))
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_ids=stop)
    batch_size = args.batch_size or (256 if device.type == "cuda" else 16)
    import transformers

    print(
        f"target {args.target} on {device} ({dtype}), transformers {transformers.__version__}, "
        f"torch {torch.__version__}; {len(prompts)} prompts "
        f"(mean {statistics.mean(map(len, prompts)):.0f} tokens), {args.max_new_tokens} new tokens, "
        f"batch {batch_size}, kv {args.kv_tokens or 'default'}, max batch tokens {args.max_batch_tokens}, "
        f"CUDA graphs {args.cuda_graphs}; loaded in {load_seconds:.1f} s",
        flush=True,
    )
    runs = []
    for name in args.engines.split(","):
        sizes = (
            [int(b) for b in args.cb_batch_sizes.split(",")] if name == "cb" and args.cb_batch_sizes else []
        )
        runs += [(name, b) for b in sizes or [batch_size]]
    rows: list[dict[str, Any]] = []
    answers: dict[str, dict[int, GeneratedTokens]] = {}
    for name, batch in runs:
        make = functools.partial(make_engine, name, target.model, settings, args, batch, pad)
        try:
            row, ans = run_engine(make, target.model, prompts, args.limit_seconds)
        except Exception as e:  # e.g. no continuous batching in this transformers: measure the rest
            rows.append({"engine": name, "batch_size": batch, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        row["batch_size"] = batch
        fastest = [r for r in rows if r.get("engine") == name and "error" not in r]
        if not fastest or row["new_tokens_per_second"] > max(r["new_tokens_per_second"] for r in fastest):
            answers[name] = ans
        rows.append(row)
        print(json.dumps(row), flush=True)
    result: dict[str, Any] = {
        "target": args.target,
        "device": str(device),
        "dtype": str(dtype),
        "transformers": transformers.__version__,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engines": rows,
    }
    summarize(result, rows, answers)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def summarize(
    result: dict[str, Any], rows: list[dict[str, Any]], answers: dict[str, dict[int, GeneratedTokens]]
) -> None:
    """Each reference's best rate against the decode engine's, and how many greedy answers agree."""
    by: dict[str, dict[str, Any]] = {}
    for r in rows:  # the fastest run of each engine
        if "error" not in r and r["new_tokens_per_second"] > by.get(r["engine"], {}).get(
            "new_tokens_per_second", -1
        ):
            by[r["engine"]] = r
    if "slots" not in by:
        return
    slots = by["slots"]["new_tokens_per_second"]
    for name in sorted(set(by) - {"slots"}):
        ratio = slots / max(by[name]["new_tokens_per_second"], 1e-9)
        agreement = compare(answers["slots"], answers[name])
        result[f"slots_over_{name}"] = round(ratio, 3)
        result[f"greedy_agreement_{name}"] = agreement
        print(
            f"slots {slots:,.0f} new tok/s, {name} {by[name]['new_tokens_per_second']:,.0f} (batch "
            f"{by[name]['batch_size']}): ratio slots/{name} {ratio:.2f}; greedy answers identical: "
            f"{agreement['identical']}/{agreement['compared']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
