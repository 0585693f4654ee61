"""Eval's speculative cycle against one target decode step, eager and compiled, side by side.

``dflash eval``'s loop at batch 1 (``decode/speculative.py``: CUDA graphs on a GPU): ms per target-only
decode step and per speculative cycle, with the target's and the drafter's layers eager and through
``torch.compile`` (``--compile on``), each cycle as a multiple of the step of the same variant, and the
operators a step and a cycle launch (the profiler's CUDA kernels on a GPU; on the CPU the aten operators
that compute, views left out, and the compiled graphs' fused kernels): at batch 1 they do little
arithmetic, so their time should follow those.
The drafter is an untrained one of the default size (5 layers, B = 16) unless ``--drafter`` names an
export; its proposals do not change the cost of a cycle. Both variants decode the same prompts in one
process, alternated.

    python bench/spec_cycle.py --target random:smollm2-135m --prompts 3 --new-tokens 128   # one GPU: ≈ 1 min
    python bench/spec_cycle.py --prompts 2 --new-tokens 32                                 # CPU: ≈ 2 min
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import drafter_layers, untrained_drafter  # noqa: E402
from bench.first_turns import first_turns  # noqa: E402
from dflash_offline.decode import SingleSequence  # noqa: E402
from dflash_offline.target_model.loader import compute_dtype, load_target, resolve_device  # noqa: E402

# Operators that move no data (views, allocations, dispatch wrappers around the ones counted).
_NOT_COMPUTING_NAMES = (
    "view",
    "as_strided",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "reshape",
    "_reshape_alias",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "alias",
    "detach",
    "lift_fresh",
    "resolve_conj",
    "resolve_neg",
    "split",
    "chunk",
    "unbind",
    "narrow",
    "unflatten",
    "flatten",
    "contiguous",
    "result_type",
    "is_nonzero",
    "empty",
    "empty_like",
    "empty_strided",
    "to",
    "_to_copy",
    "item",
    "_local_scalar_dense",
    "matmul",
    "linear",
    "scaled_dot_product_attention",
)
NOT_COMPUTING = frozenset("aten::" + name for name in _NOT_COMPUTING_NAMES)
NOT_KERNELS = ("TorchDynamo", "AOTDispatcher", "## ", "Torch-Compiled", "CompiledFunction")


def operators(fn: Any, device: torch.device) -> collections.Counter[str]:
    """What ``fn`` launches: CUDA kernels on a GPU; on the CPU each outermost computing operator (one that
    no other computing operator called: ``aten::mm``, not ``linear`` above it nor a ``resize_`` under it),
    and the compiled graphs' fused kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = list(prof.events())
    if device.type == "cuda":
        return collections.Counter(
            e.name
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
        )

    def computes(e: Any) -> bool:
        return e.name not in NOT_COMPUTING and not e.name.startswith(NOT_KERNELS)

    def outermost(e: Any) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::") and computes(parent):
                return False
            parent = parent.cpu_parent
        return True

    return collections.Counter(
        e.name
        for e in events
        if (e.name.startswith("aten::") or "_fused_" in e.name) and computes(e) and outermost(e)
    )


def load_drafter(target: Any, path: str | None, layer_ids: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
    if path is None:
        return untrained_drafter(target, layer_ids, num_layers=5), layer_ids
    from dflash_offline.eval.run import load_drafter_for

    model = load_drafter_for(target, Path(path), dtype=target.dtype)
    return model, tuple(model.config.target_layer_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:smollm2-135m")
    ap.add_argument("--drafter", default=None, help="an exported drafter (default: an untrained one)")
    ap.add_argument("--data", default=None, help="chat data for the prompts (default: the embedded ShareGPT)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled variant")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cpu":
        # Inductor's C++ kernels as profiler events (on a GPU the profiler sees its kernels anyway).
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    target = load_target(args.target, device=device, dtype=compute_dtype(None, device))
    drafter, layer_ids = load_drafter(target, args.drafter, drafter_layers(target.info.num_layers))
    prompts = [
        t.prompt_ids[:1000]
        for t in first_turns(target.tokenizer, args.data, max_prompt_tokens=1024, limit=args.prompts)
    ]
    max_len = 1024 + args.new_tokens + drafter.config.block_size + 1
    stop: frozenset[int] = frozenset()
    seqs = {
        "eager": SingleSequence(target.model, max_len=max_len),
        "compiled": SingleSequence(target.model, max_len=max_len, compile_backend=args.backend),
    }
    with torch.inference_mode():
        t0 = time.monotonic()
        for seq in seqs.values():  # warm-up: graphs of the small buckets, the compile
            seq.target_only(prompts[0], max_new_tokens=8, stop_ids=stop)
            seq.speculative(prompts[0], drafter, layer_ids=layer_ids, max_new_tokens=8, stop_ids=stop)
        warm_s = time.monotonic() - t0
        steps: dict[str, list[Any]] = {name: [] for name in seqs}
        cycles: dict[str, list[Any]] = {name: [] for name in seqs}
        for prompt in prompts:
            for name, seq in seqs.items():
                steps[name].append(seq.target_only(prompt, max_new_tokens=args.new_tokens, stop_ids=stop))
                cycles[name].append(
                    seq.speculative(
                        prompt, drafter, layer_ids=layer_ids, max_new_tokens=args.new_tokens, stop_ids=stop
                    )
                )
        # Operators of one step and one cycle: a separate loop without CUDA graphs (a replay hides them).
        counted = {
            "eager": SingleSequence(target.model, max_len=max_len, cuda_graphs=False),
            "compiled": SingleSequence(
                target.model, max_len=max_len, cuda_graphs=False, compile_backend=args.backend
            ),
        }
        short = prompts[0][:200]
        ops: dict[str, float] = {}
        result: Any = None

        def spec(seq: SingleSequence) -> None:
            nonlocal result
            result = seq.speculative(short, drafter, layer_ids=layer_ids, max_new_tokens=48, stop_ids=stop)

        for name, seq in counted.items():
            spec(seq)  # the compile, outside the profile
            ops[f"cycle_{name}"] = sum(operators(lambda s=seq: spec(s), device).values()) / result.num_cycles
            base = seq.target_only(short, max_new_tokens=48, stop_ids=stop)
            ops[f"step_{name}"] = (
                sum(
                    operators(
                        lambda s=seq: s.target_only(short, max_new_tokens=48, stop_ids=stop), device
                    ).values()
                )
                / base.num_target_forwards
            )

    report: dict[str, Any] = {
        "target": args.target,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "drafter": args.drafter or "untrained, 5 layers, B = 16",
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "warmup_s": round(warm_s, 1),
        "compiled": {
            "target": seqs["compiled"].target_compiled,
            "drafter": seqs["compiled"].drafter_compiled,
        },
    }
    for name in seqs:
        step_ms = (
            1e3 * sum(r.decode_seconds for r in steps[name]) / sum(r.num_target_forwards for r in steps[name])
        )
        cycle_ms = 1e3 * sum(r.decode_seconds for r in cycles[name]) / sum(r.num_cycles for r in cycles[name])
        report[f"step_ms_{name}"] = round(step_ms, 3)
        report[f"ops_per_step_{name}"] = round(ops[f"step_{name}"], 1)
        report[f"cycle_ms_{name}"] = round(cycle_ms, 3)
        report[f"cycle_over_step_{name}"] = round(cycle_ms / step_ms, 3)
        report[f"ops_per_cycle_{name}"] = round(ops[f"cycle_{name}"], 1)
        report[f"tau_{name}"] = round(statistics.mean(r.tau or 0.0 for r in cycles[name]), 3)
    for what in ("step", "cycle"):
        report[f"compiled_over_eager_{what}"] = round(
            report[f"{what}_ms_compiled"] / report[f"{what}_ms_eager"], 3
        )
    print(json.dumps(report, indent=1))
    for name in seqs:
        print(
            f"{name}: step {report[f'step_ms_{name}']:.2f} ms ({ops[f'step_{name}']:.0f} ops), cycle "
            f"{report[f'cycle_ms_{name}']:.2f} ms = {report[f'cycle_over_step_{name}']:.2f}x its step "
            f"({ops[f'cycle_{name}']:.0f} ops)"
        )
    print(
        f"compiled / eager: step {report['compiled_over_eager_step']:.2f}, "
        f"cycle {report['compiled_over_eager_cycle']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
