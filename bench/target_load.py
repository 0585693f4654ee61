"""Loading the default target (SmolLM2-135M-Instruct GGUF): transformers' GGUF load (dequantized at every
load, as before target_model/gguf_weights.py) against the load from the cached dequantized weights, side by
side in one run, in a private cache directory (its first load, which writes the cache, timed apart).

  python bench/target_load.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["DFLASH_CACHE_DIR"] = cache
        from dflash_offline.target_model import loader

        def timed() -> float:
            t = time.perf_counter()
            loader.load_target("default", device="cpu", dtype=torch.float32)
            return time.perf_counter() - t

        first = timed()  # tokenizer and config derived, the GGUF dequantized and written
        direct, cached = [], []
        original = loader.cached_weights_dir
        for r in range(args.repeats):
            for mode in ("gguf", "cached") if r % 2 == 0 else ("cached", "gguf"):
                loader.cached_weights_dir = (lambda *a: None) if mode == "gguf" else original  # type: ignore[assignment]
                (direct if mode == "gguf" else cached).append(timed())
        loader.cached_weights_dir = original  # type: ignore[assignment]
    d, c = statistics.median(direct), statistics.median(cached)
    print(f"first load (writes the cache): {first:.2f} s")
    print(f"GGUF load, dequantized: median {d:.2f} s of {[round(x, 2) for x in direct]}")
    print(f"cached weights:         median {c:.2f} s of {[round(x, 2) for x in cached]}")
    print(f"ratio: {d / c:.0f}x faster from the cache")


if __name__ == "__main__":
    main()
