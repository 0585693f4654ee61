"""Lossy feature codecs (fp8 e4m3, NF4) on real SmolLM2-135M features: relative error per captured layer.

    PYTHONPATH=. .venv/bin/python bench/fp8_error.py --cache C      # C: a bf16 cache of real SmolLM2
    PYTHONPATH=. .venv/bin/python bench/fp8_error.py [--conversations 120] [--max-tokens 512]
    PYTHONPATH=. .venv/bin/python bench/fp8_error.py --format nf4 --codecs none,fp8,nf4,nf4-zstd-1

Reads every sample of a lossless cache written by ``dflash generate --target default`` (``--cache``), or
captures the hidden states after layers 1, 8, 14, 20, 27 of SmolLM2-135M-Instruct (float32 on the CPU,
cast to bf16 as generate stores them) for ShareGPT conversations (cached in ``--features`` so that a
second run skips the capture), then quantises them to float8 e4m3 with one scale per

  - (token, layer);
  - (token, layer, group of g dims) for g in 32, 64, 192 (576 = 9 × 64: 128 does not divide it);
  - (token, layer), the k largest |x| of each (token, layer) stored apart as exact bf16 (k in 1, 2, 4, 8),

all through the production codec (``cache/fp8.py``: power-of-two scales as int8 exponents, outliers as
uint16 index + bf16 value). ``--format nf4`` instead: NF4 codes (``cache/nf4.py``) with one scale per
(token, layer, g dims) for g in 32, 64 and k in 0, 2, 4 outliers, beside the two other 4-bit formats under
the same power-of-two scales and outliers (simulated here, not codecs): uniform int4 ({-8, …, 7},
max |x| / 2^e ≤ 7) and fp4 e2m1 (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, max |x| / 2^e ≤ 6), nearest level.
Each scheme decodes back to bf16; the script prints, per layer, the relative Frobenius error
||x̂ - x|| / ||x|| over all dims and over the non-outlier dims (all but the 8 dims of largest mean |x|
in that layer), and the stored bytes per token over bf16's. Then writes the same features through
``ShardWriter`` with each of ``--codecs`` and prints stored/raw measured on disk (raw = bf16 bytes).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_io import real_smollm2_samples

from dflash_offline.cache.fp8 import Fp8Layout, top_outliers
from dflash_offline.cache.lossy import LossyLayout, decode_rows, encode_rows
from dflash_offline.cache.nf4 import Nf4Layout

HIDDEN = 576
NUM_LAYERS = 5
LAYER_NAMES = ("1", "8", "14", "20", "27")


INT4_LEVELS = tuple(float(q) for q in range(-8, 8))
E2M1_LEVELS = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def simulated_4bit(
    x_TF: torch.Tensor, levels: tuple[float, ...], group: int, k: int
) -> tuple[torch.Tensor, int]:
    """bf16 decode of x under a 4-bit level set with nf4's scales and outliers (``nf4.py``): the K largest
    |x| exact, the rest x / 2^e to the nearest level, e the smallest with max |x| / 2^e ≤ the top level."""
    lv = torch.tensor(levels, dtype=torch.float64)
    T = x_TF.shape[0]
    x = x_TF.to(torch.float64).reshape(T, NUM_LAYERS, HIDDEN)
    idx = top_outliers(x_TF.reshape(T, NUM_LAYERS, HIDDEN), k) if k else None
    rest = x.scatter(-1, idx, 0.0) if idx is not None else x
    g_TLGg = rest.reshape(T, NUM_LAYERS, HIDDEN // group, group)
    amax = g_TLGg.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / lv.max()))), torch.ones_like(amax))
    v = g_TLGg / scale
    q = lv[torch.bucketize(v, (lv[1:] + lv[:-1]) / 2)]
    out = (q * scale).reshape(T, NUM_LAYERS, HIDDEN)
    if idx is not None:
        out.scatter_(-1, idx, x.gather(-1, idx))
    layout = Nf4Layout(num_layers=NUM_LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    return out.reshape(T, -1).to(torch.bfloat16), layout.row_bytes


def decoded(x_TF: torch.Tensor, group: int, k: int, fmt: str = "fp8") -> tuple[torch.Tensor, int]:
    """bf16 decode of x through a production codec (cache/fp8.py, cache/nf4.py) and the stored bytes a
    token."""
    make = Fp8Layout if fmt == "fp8" else Nf4Layout
    layout: LossyLayout = make(num_layers=NUM_LAYERS, hidden_size=HIDDEN, group_dims=group, num_outliers=k)
    out = torch.empty_like(x_TF)
    for a in range(0, x_TF.shape[0], 4096):  # bounded temporaries
        decode_rows(encode_rows(x_TF[a : a + 4096], layout), layout, out[a : a + 4096])
    return out, layout.row_bytes


def stored_ratios(x_TF: torch.Tensor, codecs: list[str], workdir: Path) -> dict[str, float]:
    """Stored feature bytes / bf16 bytes of x written through ShardWriter with each codec (512-token
    samples), measured on disk in one run."""
    from cache_io import BUCKET_EDGES, fingerprint_for, tree_bytes

    from dflash_offline.cache.codecs import storage_dtype
    from dflash_offline.cache.rows import SampleToWrite
    from dflash_offline.cache.writer import ShardWriter

    ratios = {}
    for codec in codecs:
        root = workdir / codec
        fingerprint = dataclasses.replace(
            fingerprint_for(NUM_LAYERS * HIDDEN, codec), storage_dtype=storage_dtype(codec)
        )
        with ShardWriter(root, fingerprint, worker=0, flush_seconds=1e9) as writer:
            for i, a in enumerate(range(0, x_TF.shape[0], 512)):
                part = x_TF[a : a + 512]
                T = part.shape[0]
                writer.add(
                    SampleToWrite(
                        sample_id=f"real{i:05d}",
                        source_index=i,
                        input_ids_T=np.zeros(T, np.int32),
                        loss_mask_T=np.ones(T, np.uint8),
                        features_TF=part,
                        bucket_id=bisect.bisect_left(BUCKET_EDGES, T),
                    )
                )
        ratios[codec] = tree_bytes(root / "shards", "/features/c/") / (x_TF.numel() * 2)
        shutil.rmtree(root)
    return ratios


def fp8_schemes(features: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    schemes = {"per (token, layer)": decoded(features, HIDDEN, 0)}
    for g in (32, 64, 192):
        schemes[f"per (token, layer, {g} dims)"] = decoded(features, g, 0)
    for k in (1, 2, 4, 8):
        schemes[f"per (token, layer) + top-{k} bf16"] = decoded(features, HIDDEN, k)
    schemes["per (token, layer, 64 dims) + top-4"] = decoded(features, 64, 4)
    return schemes


def nf4_schemes(features: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    schemes = {}
    for g in (32, 64):
        for k in (0, 2, 4):
            schemes[f"nf4, {g} dims + top-{k}"] = decoded(features, g, k, "nf4")
            schemes[f"int4 (sim.), {g} dims + top-{k}"] = simulated_4bit(features, INT4_LEVELS, g, k)
            schemes[f"e2m1 (sim.), {g} dims + top-{k}"] = simulated_4bit(features, E2M1_LEVELS, g, k)
    return schemes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--features", type=Path, default=Path("/tmp/dflash-smollm2-features.pt"))
    parser.add_argument("--no-table", action="store_true", help="only the stored/raw measurement")
    parser.add_argument("--cache", type=Path, default=None, help="read the features of this cache")
    parser.add_argument("--codecs", default="none,blosc-zstd-1-shuffle,fp8,fp8-zstd-1")
    parser.add_argument("--format", choices=("fp8", "nf4"), default="fp8", help="the schemes of the table")
    args = parser.parse_args()
    if args.cache is not None:
        from dflash_offline.cache.reader import CacheReader

        with CacheReader.open(args.cache, check_checksums=True) as reader:
            features = torch.cat([s.features_TF for s in reader.read_rows(range(len(reader.samples)))])
    elif args.features.exists():
        features = torch.load(args.features)
    else:
        samples = real_smollm2_samples(args.conversations, args.max_tokens)
        features = torch.cat([s.features_TF for s in samples])
        torch.save(features, args.features)
    T = features.shape[0]
    x = features.to(torch.float32).reshape(T, NUM_LAYERS, HIDDEN)
    print(
        f"{T} tokens of real SmolLM2 features ({args.cache or args.features}); max |x| per layer "
        + ", ".join(f"{v:.0f}" for v in x.abs().amax(dim=(0, 2)).tolist())
        + "; RMS per layer "
        + ", ".join(f"{v:.1f}" for v in x.square().mean(dim=(0, 2)).sqrt().tolist())
    )
    # The dims that dominate each layer (largest mean |x|): "non-outlier" error excludes them.
    outlier_dims = x.abs().mean(dim=0).topk(8, dim=-1).indices  # [L, 8]
    keep_LH = torch.ones(NUM_LAYERS, HIDDEN, dtype=torch.bool)
    keep_LH.scatter_(1, outlier_dims, False)
    print("dominant dims per layer: " + "; ".join(str(d[:4].tolist()) for d in outlier_dims))
    if not args.no_table:
        schemes = fp8_schemes(features) if args.format == "fp8" else nf4_schemes(features)
        header = f"{'scheme':34s} {'stored/raw':>10s} | " + " ".join(f"{'L' + n:>13s}" for n in LAYER_NAMES)
        print("\nrelative Frobenius error per layer, all dims / non-outlier dims (decoded to bf16)")
        print(header)
        for name, (dec, row_bytes) in schemes.items():
            err = dec.to(torch.float32).reshape(T, NUM_LAYERS, HIDDEN) - x
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
    workdir = Path(tempfile.mkdtemp(prefix="dflash-fp8-"))
    try:
        ratios = stored_ratios(features, args.codecs.split(","), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\nstored/raw (raw = bf16 bytes), written through ShardWriter in this run:")
    for codec, ratio in ratios.items():
        print(f"  {codec:22s} {ratio:.4f}")


if __name__ == "__main__":
    main()
