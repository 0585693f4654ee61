"""The feature codecs side by side in one run: bytes a token, generate tok/s, training tokens/s, error.

    PYTHONPATH=. .venv/bin/python bench/codec_compare.py --data ANSWERS.jsonl.gz --limit 60 \\
        [--codecs default,fp8,nf4] [--target default] [--device cpu] [--train-steps 6] \\
        [--validation VAL.json] [--work DIR] [--keep]

For each codec (``default``: the lossless default codec, bf16 values) it runs ``dflash generate`` over the
same records into ``DIR/cache-<codec>`` and reports:

  row B             the stored row's bytes a token before any lossless stage (bf16: 2 × F);
  bytes a token     the feature array's files on disk ÷ tokens (the ids and loss mask, 5 B a token, apart);
                    ÷ raw = over bf16's 2 × F bytes;
  generate tok/s    tokens committed ÷ the run's seconds once its worker was ready (start-up apart);
  train tok/s       the median ``tokens_per_s`` of ``dflash train --max-steps N`` on that cache after its
                    first step (``--train-steps 0``: skipped), the reader decoding on the CPU or the
                    prefetcher on the device;
  rel. error        with ``default`` among the codecs: ||x̂ − x|| / ||x|| per captured layer, x̂ the codec's
                    decoded features and x the default cache's bf16 ones of the same samples;
  val τ ÷ bf16      with ``--validation``: the chain τ ratio that ``bench/fp8_validation.py --json`` wrote.

Caches are removed after their row unless ``--keep`` (a cache of millions of tokens is tens of GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.cache.codecs import DEFAULT_CODEC, raw_token_bytes  # noqa: E402
from dflash_offline.cache.reader import CacheReader  # noqa: E402
from dflash_offline.generate.config import GenerateConfig  # noqa: E402
from dflash_offline.generate.run import run_generate  # noqa: E402
from dflash_offline.placement import Placement  # noqa: E402

ERROR_TOKENS = 300_000
"""At most this many tokens of each cache are compared for the error (the first samples by id)."""


@dataclass(kw_only=True, slots=True)
class CodecRow:
    """One codec's figures."""

    codec: str
    tokens: int = 0
    feature_bytes: int = 0
    row_bytes: int = 0
    """The stored row's bytes a token (``FeatureStorage.row_bytes``), before any lossless stage."""
    raw_bytes: int = 0
    generate_tok_s: float = 0.0
    generate_seconds: float = 0.0
    train_tok_s: float | None = None
    layer_error: list[float] = field(default_factory=list)
    val_ratio: float | None = None


def feature_bytes_on_disk(cache: Path) -> int:
    return sum(f.stat().st_size for f in cache.glob("shards/*.zarr/features/c/**/*") if f.is_file())


def generate(args: argparse.Namespace, codec: str, cache: Path) -> CodecRow:
    config = GenerateConfig(
        cache_dir=cache,
        target=args.target,
        data=args.data,
        limit=args.limit if args.limit > 0 else None,
        max_length=args.max_len,
        too_long="truncate",
        layer_ids=tuple(int(i) for i in args.layer_ids.split(",")) if args.layer_ids else None,
        codec=DEFAULT_CODEC if codec == "default" else codec,
        progress=False,
        placement=Placement(gpus=(0,)) if args.device == "cuda" else Placement(num_cpu_workers=1),
    )
    started = time.perf_counter()
    summary = run_generate(config)
    wall = time.perf_counter() - started
    if summary.status != "finished":
        sys.exit(f"generate --codec {codec} ended {summary.status}")
    with CacheReader.open(cache) as reader:
        width = reader.fingerprint.feature_width
        row_bytes = reader.storage.row_bytes
    return CodecRow(
        codec=codec,
        tokens=summary.tokens_committed,
        feature_bytes=feature_bytes_on_disk(cache),
        row_bytes=row_bytes,
        raw_bytes=summary.tokens_committed * (raw_token_bytes(width) - raw_token_bytes(0)),
        generate_tok_s=summary.capture_tokens_per_second or summary.tokens_per_second,
        generate_seconds=wall,
    )


def train_rate(args: argparse.Namespace, cache: Path, out: Path) -> float | None:
    """Median tokens/s of a short ``dflash train`` on the cache, its first step left out."""
    if args.train_steps <= 0:
        return None
    cmd = [sys.executable, "-m", "dflash_offline", "train", "--cache", str(cache), "--out", str(out),
           "--target", args.target, "--max-steps", str(args.train_steps), "--log-every", "1",
           "--val-fraction", "0", "--compile", "off", "--no-tensorboard", "--no-progress",
           "--tokens-per-microbatch", str(args.tokens_per_microbatch)]  # fmt: skip
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode:
            sys.exit(f"{' '.join(cmd)} failed; its log: {log}\n{log.read_text()[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    rates = [float(r["tokens_per_s"]) for r in rows if "tokens_per_s" in r][1:]
    return statistics.median(rates) if rates else None


def layer_errors(reference: Path, cache: Path) -> list[float]:
    """Relative Frobenius error per captured layer of ``cache``'s decoded features against ``reference``'s."""
    with CacheReader.open(reference) as ref, CacheReader.open(cache) as got:
        ids = sorted(ref.samples.sample_id.tolist())
        L, H = len(ref.fingerprint.layer_ids), ref.fingerprint.hidden_size
        err_L = torch.zeros(L, dtype=torch.float64)
        norm_L = torch.zeros(L, dtype=torch.float64)
        tokens = 0
        for a in range(0, len(ids), 32):
            batch = ids[a : a + 32]
            for x, y in zip(ref.read(batch), got.read(batch), strict=True):
                x_TLH = x.features_TF.to(torch.float64).view(-1, L, H)
                y_TLH = y.features_TF.to(torch.float64).view(-1, L, H)
                err_L += (y_TLH - x_TLH).square().sum(dim=(0, 2))
                norm_L += x_TLH.square().sum(dim=(0, 2))
                tokens += x.num_tokens
            if tokens >= ERROR_TOKENS:
                break
    return (err_L / norm_L).sqrt().tolist()


def print_table(rows: list[CodecRow]) -> None:
    print(
        f"\n{'codec':<14} {'tokens':>10} {'row B':>7} {'B/token':>8} {'÷ raw':>7} {'gen tok/s':>10} "
        f"{'train tok/s':>12} {'val τ ÷ bf16':>12}  rel. error per layer"
    )
    for r in rows:
        train = f"{r.train_tok_s:,.0f}" if r.train_tok_s is not None else "-"
        val = f"{r.val_ratio:.4f}" if r.val_ratio is not None else "-"
        err = " ".join(f"{e:.4f}" for e in r.layer_error) or "-"
        print(
            f"{r.codec:<14} {r.tokens:>10,} {r.row_bytes:>7,} {r.feature_bytes / r.tokens:>8,.0f} "
            f"{r.feature_bytes / r.raw_bytes:>7.4f} {r.generate_tok_s:>10,.0f} {train:>12} {val:>12}  {err}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=60, help="records (0: all)")
    ap.add_argument("--codecs", default="default,fp8,nf4")
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--layer-ids", default="", help="captured layers (default: the DFlash rule)")
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--tokens-per-microbatch", type=int, default=4096)
    ap.add_argument("--validation", type=Path, default=None, help="bench/fp8_validation.py --json output")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-codec-compare"))
    ap.add_argument("--keep", action="store_true", help="keep the caches")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    validation = json.loads(args.validation.read_text()) if args.validation else {}
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    reference = args.work / "cache-default"
    for codec in codecs:
        cache = args.work / f"cache-{codec}"
        shutil.rmtree(cache, ignore_errors=True)
        row = generate(args, codec, cache)
        row.train_tok_s = train_rate(args, cache, args.work / f"train-{codec}")
        if "default" in codecs and codec != "default":
            row.layer_error = layer_errors(reference, cache)
        if codec in validation and "bf16" in validation:
            row.val_ratio = validation[codec]["val_chain_tau"] / validation["bf16"]["val_chain_tau"]
        print(f"{codec}: {row}", flush=True)
        rows.append(row)
        if not args.keep and codec != "default":
            shutil.rmtree(cache, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(reference, ignore_errors=True)
    print_table(rows)
    if args.json is not None:
        from dataclasses import asdict

        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
