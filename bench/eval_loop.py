"""Per-step cost of eval's decode loop (``decode/speculative.py``): ms per target-only token, ms per
speculative cycle.

A cycle emits τ tokens, so speculative decoding beats target-only once τ > cycle ms ÷ token ms (the
break-even τ printed here). The drafter is an untrained DFlash drafter of the default size (5 layers,
B = 16) over the target's head: its proposals are wrong (τ ≈ 1), its cost is real.

    PYTHONPATH=. python bench/eval_loop.py --target random:smollm2-135m --prompts 3 --new-tokens 48
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflash_offline.decode import DecodeResult, SingleSequence
from dflash_offline.drafter import DFlashDrafter, DrafterConfig, resolve_mask_token_id
from dflash_offline.target_model.loader import compute_dtype, load_target, resolve_device

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a hash map works, with an example in Python.",
    "What are three good reasons to learn a second language?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="random:smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = compute_dtype(args.dtype, device)
    target = load_target(args.target, device=device, dtype=dtype)
    info = target.info
    n = info.num_layers
    layer_ids = tuple(sorted({1, n // 2, n - 2})) if n > 3 else (0, n - 1)
    config = DrafterConfig.from_target_config(
        info.hf_config,
        target_layer_ids=layer_ids,
        mask_token_id=resolve_mask_token_id(target.tokenizer, info.vocab_size),
        num_layers=args.num_layers,
        block_size=args.block_size,
    )
    torch.manual_seed(0)
    model = target.model
    drafter_model = DFlashDrafter(
        config, embed_VH=model.get_input_embeddings().weight, lm_head_VH=model.get_output_embeddings().weight
    )
    drafter_model = drafter_model.to(device).cast_parameters(dtype).eval()
    tok = target.tokenizer
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for p in PROMPTS[: args.prompts]
    ]
    engine = SingleSequence(model, max_len=max(map(len, prompts)) + args.new_tokens + args.block_size)
    none: frozenset[int] = frozenset()

    def target_only(prompt: list[int], new_tokens: int) -> DecodeResult:
        return engine.target_only(prompt, max_new_tokens=new_tokens, stop_ids=none)

    def speculative(prompt: list[int], new_tokens: int) -> DecodeResult:
        return engine.speculative(
            prompt, drafter_model, layer_ids=layer_ids, max_new_tokens=new_tokens, stop_ids=none
        )

    target_only(prompts[0], 8)  # warm-up
    speculative(prompts[0], 8)
    token_ms, cycle_ms = [], []
    for prompt in prompts:
        base = target_only(prompt, args.new_tokens)
        spec = speculative(prompt, args.new_tokens)
        token_ms.append(1e3 * base.decode_seconds / base.num_target_forwards)
        cycle_ms.append(1e3 * spec.decode_seconds / spec.num_cycles)
    t, c = statistics.median(token_ms), statistics.median(cycle_ms)
    print(
        f"{args.target} {device} {str(dtype).removeprefix('torch.')} threads={args.threads} "
        f"B={args.block_size} drafter layers={args.num_layers}: target-only {t:.2f} ms/token, "
        f"speculative {c:.2f} ms/cycle, break-even tau {c / t:.2f} (medians of {len(prompts)} prompts)"
    )


if __name__ == "__main__":
    main()
