"""Where a decode step of a small target goes on the GPU: why regenerate and eval decode slowly.

``dflash regenerate`` measured ≈ 130 ms a decode step for SmolLM2-135M at batch 256 on one H200
(2.1k new tok/s), and ``dflash eval`` ≈ 50 ms a target-only token at batch 1, while the same model's
prefill runs at ≈ 105k tok/s. This script times, side by side in one run, on a random-weight model of
SmolLM2-135M's shape (no download, no package beyond torch and transformers):

- a bare decode loop (``model(...)`` with the KV cache, no ``generate``) at batch 1 and 256;
- ``generate`` with the dynamic cache and with the static cache, batch 256;
- a profile of a few bare decode steps: host (CPU) time against device (kernel) time, top ops.

    python bench/profile_decode.py                 # CUDA if present, else CPU at a small size
    python bench/profile_decode.py --budget-s 60   # skip what would not fit in the budget
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch


def smollm2_shaped_model(device: torch.device, dtype: torch.dtype, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def bare_decode(model: Any, batch: int, context: int, steps: int, device: torch.device) -> float:
    """ms per decode step of ``model(...)`` with the cache returned by a prefill of ``context`` tokens."""
    ids = torch.randint(0, 49152, (batch, context), device=device)
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(3):  # warm-up
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


@torch.inference_mode()
def generate_rate(
    model: Any, batch: int, context: int, new: int, device: torch.device, *, padded: bool, **kw: Any
) -> float:
    """new tokens/s of ``generate`` (greedy, exactly ``new`` tokens a row); ``padded``: rows left-padded by
    0-50 % of the context, as static generate batches (bench/reference_engines.py) are."""
    ids = torch.randint(0, 49152, (batch, context), device=device)
    mask = torch.ones_like(ids)
    if padded:
        pads = torch.randint(0, context // 2, (batch,), device=device)
        mask = (torch.arange(context, device=device)[None, :] >= pads[:, None]).long()
    args = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(input_ids=ids[:, -16:], attention_mask=mask[:, -16:], **{**args, "max_new_tokens": 4,
                   "min_new_tokens": 4}, **kw)  # fmt: skip
    sync(device)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, **args, **kw)
    sync(device)
    return batch * new / (time.perf_counter() - t0)


@torch.inference_mode()
def profile_decode(model: Any, batch: int, context: int, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, 49152, (batch, context), device=device)
    out = model(input_ids=ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    steps = 5
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync(device)
    wall = (time.perf_counter() - t0) / steps * 1e3
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / steps
    launches = (
        sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel"))) / steps
    )
    print(f"profile batch {batch}: wall {wall:.2f} ms/step (profiler on), "
          f"kernels {device_us / 1e3:.2f} ms/step, kernel launches {launches:.0f}/step")  # fmt: skip
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=12, max_name_column_width=48))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    started = time.monotonic()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers, big, new = (30, 256, 64) if cuda else (4, 8, 8)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {device}, {dtype}, "
        f"{layers} layers"
    )
    model = smollm2_shaped_model(device, dtype, layers)
    print(f"model built in {time.monotonic() - started:.1f} s", flush=True)

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    for batch in (1, big):
        ms = bare_decode(model, batch, args.context, 20, device)
        print(f"bare decode, batch {batch:4d}, context {args.context}: {ms:7.2f} ms/step = "
              f"{batch / ms * 1e3:9.0f} tok/s", flush=True)  # fmt: skip
    if left() > 20:
        profile_decode(model, big, args.context, device)
        sys.stdout.flush()
    variants: list[tuple[str, bool, dict[str, Any]]] = [
        ("dynamic cache, unpadded", False, {}),
        ("dynamic cache, left-padded", True, {}),
        ("static cache, left-padded", True, {"cache_implementation": "static"}),
    ]
    for name, padded, kw in variants:
        if left() < 15:
            print(f"generate ({name}): skipped, budget")
            continue
        try:
            rate = generate_rate(model, big, args.context, new, device, padded=padded, **kw)
            print(f"generate ({name}), batch {big}, {new} new: {rate:9.0f} new tok/s", flush=True)
        except Exception as e:  # a transformers without this cache kind: say so and go on
            print(f"generate ({name}): {type(e).__name__}: {e}", flush=True)
    if left() > 15:
        profile_decode(model, 1, args.context, device)
    print(f"total {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
