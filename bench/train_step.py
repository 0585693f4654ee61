"""Training-step throughput: tokens/s of ``dflash train``'s optimizer step alone (no data loading), eager
and compiled side by side, at SmolLM2-135M width and at Qwen3-8B width.

The step is the one the training loop runs (``train.step.OptimizerStep``: bf16 autocast on CUDA, flex
attention, the chunked LM-head loss, AdamW, clipping), on synthetic microbatches already on the device:
documents of 200–2,000 tokens packed to ``--tokens`` per microbatch (a prompt without loss, then the
answer), ``--anchors`` anchors per microbatch drawn by the training rule, loss rows computed on the host
as the prefetcher does, random bf16 features of 5 target layers. A step is ``--grad-accum`` microbatches;
eight distinct microbatches are cycled so that shapes vary as in real data.

Modes, each timed over ``--steps`` steps after ``--warmup`` (compilation happens in the warm-up):
  eager          the step as ``dflash train --compile off`` runs it: results stay on the device, read at
                 the end
  compiled       the same compiled, as ``dflash train`` runs it on CUDA by default (``--compile auto``:
                 ``DFlashDrafter.compile_training``, inductor)
  eager+sync     (``--sync-every-step``) every step's metrics read back at once (``--log-every 1``)
  eager+old-syncs (``--sync-every-step``) also the host syncs the step made before: ``nonzero`` in the
                 forward (no precomputed loss rows), two blocking syncs before each microbatch (the loss
                 weights' ``w[0] = 0.0``), the metrics and the gradient norm read every step

One command on one H200 (the coordinator's):
    python bench/train_step.py --sync-every-step
prints a table and writes ``$OUT/train_step.json`` (or ``--json``). CPU smoke (seconds):
    python bench/train_step.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_offline.drafter.anchors import sample_anchors
from dflash_offline.drafter.batch import DocumentTensors, DrafterInputs, pack_documents
from dflash_offline.drafter.config import DrafterConfig
from dflash_offline.drafter.loss import loss_rows
from dflash_offline.drafter.model import DFlashDrafter
from dflash_offline.placement import DistInfo
from dflash_offline.target_model.layers import default_layer_ids
from dflash_offline.target_model.presets import RANDOM_PRESETS
from dflash_offline.train.config import CPU_LAYOUT, GPU_LAYOUT, TOKENS_PER_ANCHOR
from dflash_offline.train.step import OptimizerStep, StepOutcome

WIDTHS = {"smollm2": "smollm2-135m", "qwen3-8b": "qwen3-8b"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """What one measurement trains."""

    width: str
    num_layers: int
    block_size: int
    anchors: int
    tokens: int
    grad_accum: int


def drafter_for(width: str, shape: Shape, device: torch.device, *, smoke: bool) -> DFlashDrafter:
    preset = RANDOM_PRESETS[WIDTHS[width]]
    hf = preset.hf_config().to_dict()
    if smoke:  # tiny stand-in with the same structure
        hf.update(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
        )
        hf.update(vocab_size=4096)
    config = DrafterConfig.from_target_config(
        hf,
        target_layer_ids=default_layer_ids(int(hf["num_hidden_layers"])),
        mask_token_id=int(hf["vocab_size"]) - 1,
        num_layers=shape.num_layers,
        block_size=shape.block_size,
        num_anchors=shape.anchors,
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    embed = (torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.02).to(device)
    head = (
        embed if hf.get("tie_word_embeddings") else (torch.randn(embed.shape, generator=g) * 0.02).to(device)
    )
    torch.manual_seed(0)
    return DFlashDrafter(config, embed_VH=embed, lm_head_VH=head).to(device)


def microbatch(config: DrafterConfig, shape: Shape, seed: int, device: torch.device) -> DrafterInputs:
    """Documents of 200–2,000 tokens (a tenth prompt, the rest answer) packed to ``shape.tokens``."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    docs, left = [], shape.tokens
    while left > 0:
        n = min(left, int(rng.integers(200, 2001)))
        mask = torch.ones(n, dtype=torch.bool)
        mask[: max(1, n // 10)] = False
        docs.append(
            DocumentTensors(
                input_ids_T=torch.randint(0, config.vocab_size - 1, (n,), generator=g),
                features_TF=torch.randn(n, config.feature_width, generator=g).to(torch.bfloat16),
                loss_mask_T=mask,
            )
        )
        left -= n
    row = pack_documents(docs)
    anchors = sample_anchors(
        row.loss_mask_T, row.doc_ids_T, num_anchors=shape.anchors, generator=g, max_total=shape.anchors
    )
    rows = loss_rows(row.loss_mask_T, row.doc_ids_T, anchors, config.block_size)
    return replace(row, anchors_A=anchors, loss_rows_N=rows).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OldSyncs:
    """The host syncs the step made before they were removed: two per microbatch before its forward
    (``w[0] = 0.0`` in the loss weights and the forward's decay weights) and the forward's ``nonzero``
    (the inputs carry no precomputed loss rows, so the forward computes them)."""

    def __init__(self, step: OptimizerStep, device: torch.device) -> None:
        self._step = step
        self._device = device
        inner = step.ddp_model

        class Wrapped(torch.nn.Module):
            def forward(self, x: DrafterInputs, **kwargs: Any) -> Any:
                _sync(device)
                _sync(device)
                return inner(x, **kwargs)

        step.ddp_model = Wrapped()

    def __call__(self, inputs: list[DrafterInputs], padding: list[bool]) -> StepOutcome:
        return self._step([replace(x, loss_rows_N=None) for x in inputs], padding)


def measure(
    shape: Shape, *, mode: str, device: torch.device, steps: int, warmup: int, smoke: bool
) -> dict[str, Any]:
    model = drafter_for(shape.width, shape, device, smoke=smoke)
    if mode == "compiled":
        model.compile_training()
    pool = [microbatch(model.config, shape, seed, device) for seed in range(8)]
    params = model.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    step = OptimizerStep(
        model=model,
        ddp_model=model,
        params=params,
        optimizer=optimizer,
        drafter_config=model.config,
        info=DistInfo(rank=0, world_size=1, local_rank=device.index or 0, device=device, backend="none"),
        grad_clip=1.0,
        attention="auto",
        autocast=torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else None,
    )
    run = OldSyncs(step, device) if mode == "eager+old-syncs" else step
    read_every_step = mode in ("eager+sync", "eager+old-syncs")
    outcome = None
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            t0 = time.perf_counter()
        batch = [pool[(i * shape.grad_accum + j) % len(pool)] for j in range(shape.grad_accum)]
        outcome = run(batch, [False] * shape.grad_accum)
        if read_every_step:
            outcome.read()
    assert outcome is not None
    totals, _grad_norm = outcome.read()  # the one sync of the device-resident modes
    seconds = time.perf_counter() - t0
    tokens = steps * shape.grad_accum * shape.tokens
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    del model, optimizer, step, run, pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {
        "width": shape.width,
        "mode": mode,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1000 * seconds / steps,
        "final_loss": totals.loss,
        "peak_gib": peak,
    }


def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    """``--layouts``: (grad_accum, tokens, anchors) of each ``GxTxA`` item."""
    layouts = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--layouts: {item!r} is not GRAD_ACCUMxTOKENSxANCHORS of positive integers")
        layouts.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return layouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="smollm2,qwen3-8b")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument(
        "--sync-every-step", action="store_true", help="also the eager+sync and eager+old-syncs rows"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per microbatch; default: dflash train's")
    ap.add_argument("--grad-accum", type=int, default=None, help="default: dflash train's on --device")
    ap.add_argument("--anchors", type=int, default=None, help="default: dflash train's for --tokens")
    ap.add_argument(
        "--layouts",
        default=None,
        help="microbatch layouts measured side by side, GRAD_ACCUMxTOKENSxANCHORS each, comma-separated "
        "(e.g. 4x8192x512,1x32768x2048: one step's tokens and blocks in 4 microbatches or in 1); default: "
        "--grad-accum x --tokens x --anchors",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny widths and sizes (CPU, seconds)")
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/train_step.json when $OUT is set")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.tokens, args.grad_accum, args.anchors = 3, 1, 512, 2, 32
    # dflash train's defaults on this device (train/config.py), where not given.
    layout = GPU_LAYOUT if str(args.device).startswith("cuda") else CPU_LAYOUT
    args.tokens = args.tokens or layout.tokens_per_microbatch
    args.grad_accum = args.grad_accum or layout.grad_accum
    args.anchors = args.anchors or max(1, args.tokens // TOKENS_PER_ANCHOR)
    layouts = parse_layouts(args.layouts) if args.layouts else [(args.grad_accum, args.tokens, args.anchors)]
    device = torch.device(args.device)
    modes = [m for m in args.modes.split(",") if m]
    if args.sync_every_step:
        modes += ["eager+sync", "eager+old-syncs"]
    rows = []
    for width in [w for w in args.widths.split(",") if w]:
        for grad_accum, tokens, anchors in layouts:
            shape = Shape(
                width=width,
                num_layers=args.layers,
                block_size=args.block_size,
                anchors=anchors,
                tokens=tokens,
                grad_accum=grad_accum,
            )
            layout = f"{grad_accum}x{tokens}x{anchors}"
            for mode in modes:
                try:
                    row = measure(
                        shape,
                        mode=mode,
                        device=device,
                        steps=args.steps,
                        warmup=args.warmup,
                        smoke=args.smoke,
                    )
                except Exception as e:  # one failing mode (a compiler error, memory) must not lose the others
                    row = {"width": width, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                row["layout"] = layout
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    done = [r for r in rows if "tokens_per_s" in r]
    eager = {(r["width"], r["layout"]): r["tokens_per_s"] for r in done if r["mode"] == "eager"}
    first = layouts[0]
    first_layout = f"{first[0]}x{first[1]}x{first[2]}"
    by_first = {(r["width"], r["mode"]): r["tokens_per_s"] for r in done if r["layout"] == first_layout}
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {k: getattr(args, k) for k in ("block_size", "layers")},
        "layouts": [f"{g}x{t}x{a}" for g, t, a in layouts],
        "steps": args.steps,
        "rows": rows,
    }
    out = args.json or (Path(os.environ["OUT"]) / "train_step.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\n{'width':<10} {'layout':<14} {'mode':<16} {'tokens/s':>12} {'step ms':>9} {'× eager':>8} "
        f"{'× ' + first_layout:>16} {'peak GiB':>9}"
    )
    nan = float("nan")
    for r in rows:
        if "error" in r:
            print(f"{r['width']:<10} {r['layout']:<14} {r['mode']:<16} {r['error'][:60]}")
            continue
        ratio = r["tokens_per_s"] / eager.get((r["width"], r["layout"]), nan)
        vs_first = r["tokens_per_s"] / by_first.get((r["width"], r["mode"]), nan)
        print(
            f"{r['width']:<10} {r['layout']:<14} {r['mode']:<16} {r['tokens_per_s']:>12,.0f} "
            f"{r['step_ms']:>9.1f} {ratio:>8.2f} {vs_first:>16.2f} {r['peak_gib']:>9.1f}"
        )
    if out is not None:
        print(f"report: {out}")


if __name__ == "__main__":
    main()
