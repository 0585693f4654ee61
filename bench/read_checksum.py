"""What checking every sample's crc32c costs the training read path (``dflash train`` always checks).

Builds a cache of ``--num-samples`` samples (``--tokens`` each, ``--feature-width`` features, SmolLM2
width by default) per codec, then reads all of them in batches of ``--batch`` through
``CacheReader.read_rows`` (the prefetcher's call, features decoded into one reused buffer as the
prefetcher does) with and without ``check_checksums``, best of ``--repeats``, page cache warm.

    .venv/bin/python bench/read_checksum.py
"""

from __future__ import annotations

import argparse
import bisect
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dflash_offline.cache.checksum import crc32c_extend
from dflash_offline.cache.codecs import raw_token_bytes
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.reader import CacheReader
from dflash_offline.cache.rows import SampleToWrite
from dflash_offline.cache.writer import ShardWriter


def build(root: Path, *, codec: str, num_samples: int, tokens: int, width: int) -> None:
    fingerprint = CacheFingerprint(
        target_id="bench",
        weights_hash="0" * 16,
        num_target_layers=30,
        layer_ids=tuple(range(width // 576)) if width % 576 == 0 else (1,),
        hidden_size=576 if width % 576 == 0 else width,
        storage_dtype="bfloat16",
        codec=codec,
        tokenizer_hash="t",
        chat_template_hash="c",
        max_length=4096,
        too_long="skip",
        bucket_edges=(256, 512, 1024, 2048, 4096),
        data_source="bench",
        compute_dtype="float32",
    )
    rng = np.random.default_rng(0)
    with ShardWriter(root, fingerprint, worker=0) as writer:
        for i in range(num_samples):
            features = torch.from_numpy(rng.standard_normal((tokens, width), dtype=np.float32)).to(
                torch.bfloat16
            )
            writer.add(
                SampleToWrite(
                    sample_id=f"s{i:06d}",
                    source_index=i,
                    input_ids_T=rng.integers(0, 49152, tokens, dtype=np.int32),
                    loss_mask_T=(rng.random(tokens) < 0.6).astype(np.uint8),
                    features_TF=features,
                    bucket_id=bisect.bisect_left(fingerprint.bucket_edges, tokens),
                )
            )


def time_reads(
    root: Path, *, check: bool, batch: int, repeats: int, threads: int
) -> tuple[float, float, int]:
    """(best wall seconds, best process CPU seconds, bytes) of reading every sample once."""
    best = best_cpu = float("inf")
    with CacheReader.open(root, num_threads=threads, check_checksums=check) as reader:
        n = len(reader.samples)
        width = reader.fingerprint.feature_width
        tokens = int(reader.samples.num_tokens[:batch].sum())
        out = np.empty((tokens, width), dtype=np.uint16)
        nbytes = int(reader.samples.num_tokens.astype(np.int64).sum()) * raw_token_bytes(width)
        for _ in range(repeats):
            start, cpu = time.perf_counter(), time.process_time()
            for lo in range(0, n - batch + 1, batch):
                reader.read_rows(np.arange(lo, lo + batch), features_out=out)
            best = min(best, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - cpu)
    return best, best_cpu, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-samples", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--feature-width", type=int, default=5 * 576)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--codecs", default="none,blosc-zstd-1-shuffle")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-crc-") as tmp:
        for codec in args.codecs.split(","):
            root = Path(tmp) / codec
            build(
                root, codec=codec, num_samples=args.num_samples, tokens=args.tokens, width=args.feature_width
            )
            kw = dict(batch=args.batch, repeats=args.repeats, threads=args.threads)
            plain, plain_cpu, nbytes = time_reads(root, check=False, **kw)
            checked, checked_cpu, _ = time_reads(root, check=True, **kw)
            gb = nbytes / 1e9
            print(
                f"{codec:>22}: {gb:.3f} GB  wall: unchecked {gb / plain:.2f} GB/s, checked "
                f"{gb / checked:.2f} GB/s (x{checked / plain:.3f})  "
                f"CPU: unchecked {plain_cpu / gb:.3f} s/GB, "
                f"checked {checked_cpu / gb:.3f} s/GB (x{checked_cpu / plain_cpu:.3f})"
            )
        start = time.process_time()
        block = np.random.default_rng(0).integers(0, 65535, (512, args.feature_width), dtype=np.uint16)
        for _ in range(50):
            crc32c_extend(0, block)
        print(f"crc32c alone: {50 * block.nbytes / 1e9 / (time.process_time() - start):.2f} GB/s of CPU time")


if __name__ == "__main__":
    main()
