"""fp8 e4m3 scaling granularity on real SmolLM2-135M features: relative error per captured layer.

    PYTHONPATH=. .venv/bin/python bench/fp8_error.py [--conversations 120] [--max-tokens 512]

Captures the hidden states after layers 1, 8, 14, 20, 27 of SmolLM2-135M-Instruct (float32 on the CPU,
cast to bf16 as generate stores them) for ShareGPT conversations (cached in ``--features`` so that a
second run skips the capture), then quantises them to float8 e4m3 with one scale per

  - (token, layer);
  - (token, layer, group of g dims) for g in 32, 64, 192 (576 = 9 × 64: 128 does not divide it);
  - (token, layer), the k largest |x| of each (token, layer) stored apart as exact bf16 (k in 1, 2, 4, 8),

decodes back to bf16 and prints, per layer, the relative Frobenius error ||x̂ - x|| / ||x|| over all
dims and over the non-outlier dims (all but the 8 dims of largest mean |x| in that layer), plus the
stored bytes per token over bf16's (float32 scales; outliers as uint16 index + bf16 value).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import real_smollm2_samples

from dflash_offline.cache.fp8 import E4M3_MAX

HIDDEN = 576
NUM_LAYERS = 5
LAYER_NAMES = ("1", "8", "14", "20", "27")


def quantise_groups(x_TLH: torch.Tensor, group: int) -> torch.Tensor:
    """float32 decode of x quantised with one scale per ``group`` consecutive dims."""
    T, L, H = x_TLH.shape
    g = x_TLH.reshape(T, L, H // group, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).reshape(T, L, H)


def quantise_outliers(x_TLH: torch.Tensor, k: int) -> torch.Tensor:
    """float32 decode with the k largest |x| of each (token, layer) kept exactly, the rest per-row fp8."""
    top = x_TLH.abs().topk(k, dim=-1).indices
    rest = x_TLH.scatter(-1, top, 0.0)
    dec = quantise_groups(rest, x_TLH.shape[-1])
    return dec.scatter(-1, top, x_TLH.gather(-1, top))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--features", type=Path, default=Path("/tmp/dflash-smollm2-features.pt"))
    args = parser.parse_args()
    if args.features.exists():
        features = torch.load(args.features)
    else:
        samples = real_smollm2_samples(args.conversations, args.max_tokens)
        features = torch.cat([s.features_TF for s in samples])
        torch.save(features, args.features)
    T = features.shape[0]
    x = features.to(torch.float32).reshape(T, NUM_LAYERS, HIDDEN)
    print(
        f"{T} tokens of real SmolLM2 features ({args.features}); max |x| per layer "
        + ", ".join(f"{v:.0f}" for v in x.abs().amax(dim=(0, 2)).tolist())
        + "; RMS per layer "
        + ", ".join(f"{v:.1f}" for v in x.square().mean(dim=(0, 2)).sqrt().tolist())
    )
    # The dims that dominate each layer (largest mean |x|): "non-outlier" error excludes them.
    outlier_dims = x.abs().mean(dim=0).topk(8, dim=-1).indices  # [L, 8]
    keep_LH = torch.ones(NUM_LAYERS, HIDDEN, dtype=torch.bool)
    keep_LH.scatter_(1, outlier_dims, False)
    print("dominant dims per layer: " + "; ".join(str(d[:4].tolist()) for d in outlier_dims))
    fp8_bytes = NUM_LAYERS * HIDDEN
    schemes: dict[str, tuple[torch.Tensor, int]] = {
        "per (token, layer)": (quantise_groups(x, HIDDEN), fp8_bytes + 4 * NUM_LAYERS),
    }
    for g in (32, 64, 192):
        schemes[f"per (token, layer, {g} dims)"] = (
            quantise_groups(x, g),
            fp8_bytes + 4 * NUM_LAYERS * HIDDEN // g,
        )
    for k in (1, 2, 4, 8):
        schemes[f"per (token, layer) + top-{k} bf16"] = (
            quantise_outliers(x, k),
            fp8_bytes + NUM_LAYERS * (4 + 4 * k),
        )
    header = f"{'scheme':34s} {'stored/raw':>10s} | " + " ".join(f"{'L' + n:>13s}" for n in LAYER_NAMES)
    print("\nrelative Frobenius error per layer, all dims / non-outlier dims (decoded to bf16)")
    print(header)
    for name, (dec, row_bytes) in schemes.items():
        dec = dec.to(torch.bfloat16).to(torch.float32)
        err = dec - x
        cells = []
        for layer in range(NUM_LAYERS):
            e, r = err[:, layer], x[:, layer]
            keep = keep_LH[layer]
            all_rel = e.norm() / r.norm()
            rest_rel = e[:, keep].norm() / r[:, keep].norm()
            cells.append(f"{all_rel:.4f}/{rest_rel:.4f}")
        print(
            f"{name:34s} {row_bytes / (2 * NUM_LAYERS * HIDDEN):10.4f} | "
            + " ".join(f"{c:>13s}" for c in cells)
        )
    bf16_only = x.to(torch.bfloat16).to(torch.float32)  # the input is bf16 already: 0 by construction
    assert torch.equal(bf16_only, x)


if __name__ == "__main__":
    main()
