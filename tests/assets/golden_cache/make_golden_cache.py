"""Write the golden cache of the current format that tests/cache/test_golden.py reads with the current code.

Run once per format version, from the repository root:
    .venv/bin/python tests/assets/golden_cache/make_golden_cache.py
and commit the folder it writes (``tests/assets/golden_cache/v<format>``: v1 was written by format 1,
v2 by format 2, which names manifest parts with their sha256, v3 by format 3, which stores each sample's
conversation root in its row). Never regenerate an existing version:
the point is that today's reader still reads what an older writer wrote.

The content is a pure function of the sample index through integer hashing (splitmix64), not of a
random number generator whose stream could change between numpy versions.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
VERSION_DIR = HERE / "v3"
SAMPLES_PER_CONVERSATION = 3
"""v3 on: samples 3c, 3c + 1, 3c + 2 are records of one conversation (their stored root)."""
NUM_SAMPLES = 24
LAYER_IDS = (1, 3)
HIDDEN_SIZE = 16
BUCKET_EDGES = (8, 16, 32)
SPECIAL_BITS = (0x7FC1, 0xFFC1, 0x7F81, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def golden_sample(k: int) -> dict:
    """Sample k: id, source index, bucket, and its arrays (features as uint16 bf16 bits)."""
    width = len(LAYER_IDS) * HIDDEN_SIZE
    num_tokens = 1 + int(mix(np.array([k]))[0] % np.uint64(40))
    base = np.uint64(k) << np.uint64(32)
    cells = base + np.arange(num_tokens * width, dtype=np.uint64)
    bits = (mix(cells) & np.uint64(0xFFFF)).astype(np.uint16).reshape(num_tokens, width)
    bits[0, : len(SPECIAL_BITS)] = SPECIAL_BITS
    rows = base + np.uint64(1 << 31) + np.arange(num_tokens, dtype=np.uint64)
    input_ids = (mix(rows) % np.uint64(50_000)).astype(np.int32)
    loss_mask = (mix(rows + np.uint64(1 << 30)) & np.uint64(1)).astype(np.uint8)
    return {
        "sample_id": f"golden-{k:03d}",
        "source_index": k,
        "bucket_id": bisect.bisect_left(BUCKET_EDGES, num_tokens),
        "conversation_root": f"golden-conversation-{k // SAMPLES_PER_CONVERSATION}",
        "features_bits": bits,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
    }


def fingerprint_dict() -> dict:
    return {
        "target_id": "random:golden",
        "weights_hash": "golden-weights",
        "num_target_layers": 4,
        "layer_ids": list(LAYER_IDS),
        "hidden_size": HIDDEN_SIZE,
        "storage_dtype": "bfloat16",
        "codec": "blosc-zstd-1-shuffle",
        "tokenizer_hash": "golden-tokenizer",
        "chat_template_hash": "golden-template",
        "max_length": 64,
        "too_long": "skip",
        "bucket_edges": list(BUCKET_EDGES),
        "data_source": "golden",
        "compute_dtype": "float32",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=VERSION_DIR)
    args = parser.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists: golden caches are written once per format version")
    import torch

    from dflash_offline.cache.fingerprint import CacheFingerprint
    from dflash_offline.cache.manifest import record_run
    from dflash_offline.cache.rows import RunRow, SampleToWrite
    from dflash_offline.cache.writer import ShardWriter

    fingerprint = CacheFingerprint.from_dict(fingerprint_dict())
    halves = (range(0, NUM_SAMPLES // 2), range(NUM_SAMPLES // 2, NUM_SAMPLES))
    for worker, (session, indices) in enumerate(zip(("golden-a", "golden-b"), halves)):
        # Small chunks and shards so that samples cross chunk and shard boundaries.
        with ShardWriter(args.out, fingerprint, worker=worker, session=session, chunk_bytes=512, shard_bytes=4096) as w:
            for k in indices:
                s = golden_sample(k)
                w.add(
                    SampleToWrite(
                        sample_id=s["sample_id"],
                        source_index=s["source_index"],
                        input_ids_T=s["input_ids"],
                        loss_mask_T=s["loss_mask"],
                        features_TF=torch.from_numpy(s["features_bits"].view(np.int16)).view(torch.bfloat16),
                        bucket_id=s["bucket_id"],
                        conversation_root=s["conversation_root"],
                    )
                )
                if k == 5:
                    w.flush()
            w.add_failure(sample_id=f"golden-bad-{worker}", source_index=100 + worker, reason="too_long", detail="99 > 64")
    stamp = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    record_run(
        args.out,
        RunRow(
            run_id="golden-run",
            command="generate",
            started_at=stamp,
            finished_at=stamp,
            status="finished",
            num_workers=2,
            samples_committed=NUM_SAMPLES,
            tokens_committed=sum(golden_sample(k)["input_ids"].shape[0] for k in range(NUM_SAMPLES)),
            bytes_written=0,
            failures=2,
            fingerprint_json=json.dumps(fingerprint_dict(), sort_keys=True),
            host="golden",
        ),
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
