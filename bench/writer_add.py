"""Throughput of ``ShardWriter.add`` on the caller's thread, this tree's writer against a baseline
commit's, alternated in one run (the machine may be shared: medians of ``--repeats`` each).

    PYTHONPATH=. .venv/bin/python bench/writer_add.py [--baseline main] [--mb 512] [--codec none]
    PYTHONPATH=. .venv/bin/python bench/writer_add.py --pre-encoded [--codec fp8]

``--pre-encoded`` (an fp8 codec) compares instead, with this tree's writer both times, the samples handed
over as bf16 features (``add`` encodes them on the caller's thread) against the same samples already
encoded (``Fp8Rows``, as generate's capture step hands them over; encoded before the clock starts).

The caller's thread is what bounds generate (a GPU worker stages each sample, then goes on with the
next forward): ``add GB/s`` is raw bytes staged ÷ seconds spent inside ``add()``; ``end to end`` also
counts ``close()`` (the last shard files written and committed). The baseline writer is
``dflash_offline/cache/writer.py`` as of ``--baseline``, loaded beside this tree's package (its other
modules are this tree's). Both caches' manifests must hold the same per-sample checksums; the bench
stops if they differ. Samples: random bf16 features of 5 × 576 dims, 256–2048 tokens each (0.7–5.9 MB),
built once and shared by every run; ``--codec none`` (default) leaves the pool's encoding cheap so the
caller's path is what is measured.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow.compute as pc
import torch

from dflash_offline.cache import writer as current_writer
from dflash_offline.cache.codecs import feature_storage, storage_dtype
from dflash_offline.cache.fingerprint import CacheFingerprint
from dflash_offline.cache.fp8 import encode_rows
from dflash_offline.cache.layout import CacheLayout
from dflash_offline.cache.manifest import read_parts
from dflash_offline.cache.rows import Fp8Rows, SampleToWrite

LAYERS = (1, 8, 14, 20, 27)
WIDTH = 5 * 576
BUCKET_EDGES = (256, 512, 1024, 2048)


def baseline_writer(ref: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{ref}:dflash_offline/cache/writer.py"], check=True, capture_output=True, text=True
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix="dflash-writer-baseline-"))
    path = folder / "baseline_writer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_writer", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_writer"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def fingerprint(codec: str) -> CacheFingerprint:
    return CacheFingerprint(
        target_id="bench",
        weights_hash="bench",
        num_target_layers=30,
        layer_ids=LAYERS,
        hidden_size=WIDTH // len(LAYERS),
        storage_dtype=storage_dtype(codec),  # float8_e4m3fn for the fp8 codecs
        codec=codec,
        tokenizer_hash="bench",
        chat_template_hash="bench",
        max_length=BUCKET_EDGES[-1],
        too_long="skip",
        bucket_edges=BUCKET_EDGES,
        data_source="bench",
        compute_dtype="float32",
    )


def samples(total_mb: int) -> list[SampleToWrite]:
    rng = np.random.default_rng(0)
    out: list[SampleToWrite] = []
    total = 0
    while total < total_mb << 20:
        T = int(rng.integers(256, 2048))
        out.append(
            SampleToWrite(
                sample_id=f"s{len(out):06d}",
                source_index=len(out),
                input_ids_T=rng.integers(0, 49_152, size=T, dtype=np.int32),
                loss_mask_T=(rng.random(T) < 0.6).astype(np.uint8),
                features_TF=torch.from_numpy(rng.standard_normal((T, WIDTH), dtype=np.float32)).to(
                    torch.bfloat16
                ),
                bucket_id=bisect.bisect_left(BUCKET_EDGES, T),
            )
        )
        total += T * (WIDTH * 2 + 5)
    return out


def pre_encoded(batch: list[SampleToWrite], codec: str) -> list[SampleToWrite]:
    """The same samples with their features as fp8 rows of ``codec``'s layout."""
    layout = feature_storage(codec, num_layers=len(LAYERS), hidden_size=WIDTH // len(LAYERS)).lossy
    if layout is None:
        raise SystemExit(f"--pre-encoded needs an fp8 codec, not {codec!r}")
    out = []
    for sample in batch:
        assert sample.features_TF is not None
        rows = Fp8Rows(layout=layout, rows_TW=encode_rows(sample.features_TF, layout))
        out.append(dataclasses.replace(sample, features_TF=None, fp8_rows=rows))
    return out


def one_run(
    module: ModuleType, root: Path, batch: list[SampleToWrite], codec: str, threads: int
) -> tuple[float, float, float]:
    """(CPU seconds of the caller's thread inside add(), wall seconds inside add(), wall seconds from
    the writer's creation to close() returning)."""
    cpu = wall = 0.0
    start = time.perf_counter()
    writer = module.ShardWriter(
        root, fingerprint(codec), worker=0, flush_seconds=1e9, known_sample_ids=(), encode_threads=threads
    )
    for sample in batch:
        c0, t0 = time.thread_time(), time.perf_counter()
        writer.add(sample)
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - t0
    writer.close()
    return cpu, wall, time.perf_counter() - start


def checksums(root: Path) -> dict[str, int]:
    table = read_parts("samples", CacheLayout.at(root).parts("samples"))
    table = table.sort_by("sample_id")
    return dict(
        zip(table["sample_id"].to_pylist(), pc.cast(table["checksum"], "int64").to_pylist(), strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="the writers' pool (default theirs)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--pre-encoded", action="store_true", help="bf16 features against pre-encoded fp8 rows (no baseline)"
    )
    args = parser.parse_args()
    if args.pre_encoded and args.codec == "none":
        args.codec = "fp8"
    batch = samples(args.mb)
    tokens = sum(s.num_tokens for s in batch)
    raw = tokens * (WIDTH * 2 + 5)
    variants: dict[str, tuple[ModuleType, list[SampleToWrite]]]
    if args.pre_encoded:
        variants = {
            "bf16, encode in add": (current_writer, batch),
            "pre-encoded rows": (current_writer, pre_encoded(batch, args.codec)),
        }
    else:
        variants = {
            f"baseline ({args.baseline})": (baseline_writer(args.baseline), batch),
            "this tree": (current_writer, batch),
        }
    workdir = Path(tempfile.mkdtemp(prefix="dflash-writer-add-", dir=args.workdir))
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    sums: dict[str, dict[str, int]] = {}
    try:
        for r in range(args.repeats):
            for v, (name, (module, inputs)) in enumerate(variants.items()):  # alternated: load hits both
                root = workdir / f"{r}-{v}"
                times[name].append(one_run(module, root, inputs, args.codec, args.threads))
                sums.setdefault(name, checksums(root))
                shutil.rmtree(root)
        first, *others = sums.values()
        if any(other != first for other in others):
            raise SystemExit("the writers' manifests hold different checksums")
        print(
            f"ShardWriter.add, {len(batch)} samples, {raw / 1e9:.2f} GB raw, codec {args.codec}, "
            f"median of {args.repeats}; per-sample checksums identical"
        )
        columns = ("add, caller CPU", "add, wall", "end to end")
        print(f"GB/s of raw bytes (bf16 features + ids + mask): {', '.join(columns)}; tokens/s of add, wall")
        print(f"{'writer':>20s}" + "".join(f"{c:>17s}" for c in (*columns, "add, tokens/s")))
        medians = {}
        for name, runs in times.items():
            medians[name] = [statistics.median(raw / t[i] / 1e9 for t in runs) for i in range(3)]
            rate = statistics.median(tokens / t[1] for t in runs)
            print(f"{name:>20s}" + "".join(f"{m:17.2f}" for m in medians[name]) + f"{rate:17,.0f}")
        base, this = medians.values()
        print(f"{'ratio':>20s}" + "".join(f"{b / a:16.2f}×" for a, b in zip(base, this, strict=True)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
