"""Blosc zstd-1 + byte-shuffle encode and decode throughput of 1 MiB bf16 chunks on 1..N threads
(does numcodecs release the GIL from worker threads?). Prints GB/s per thread count."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numcodecs
import numpy as np


def main() -> None:
    codec = numcodecs.Blosc(cname="zstd", clevel=1, shuffle=numcodecs.Blosc.SHUFFLE, blocksize=1 << 20)
    rng = np.random.default_rng(0)
    chunks = [
        (rng.standard_normal(1 << 19, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for _ in range(64)
    ]
    encoded = [codec.encode(c) for c in chunks]
    nbytes = sum(c.nbytes for c in chunks)
    for threads in sorted({1, 2, 4, 8, os.cpu_count() or 1}):
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(codec.encode, chunks))
            enc = nbytes / (time.perf_counter() - start) / 1e9
            start = time.perf_counter()
            list(pool.map(codec.decode, encoded))
            dec = nbytes / (time.perf_counter() - start) / 1e9
        print(f"threads {threads:>2}: encode {enc:5.2f} GB/s, decode {dec:5.2f} GB/s")


if __name__ == "__main__":
    main()
