"""One trained drafter validated on the same held-out samples several times: their features read from a
cache of the default (lossless) codec, then from a cache of each lossy codec (``--codecs``: fp8, nf4) of
the same records. What a lossy codec's rounding moves in what a trained drafter predicts, measured side
by side (codec ÷ bf16); the part of "within 2 % of bf16" that a CPU can measure (the whole criterion is
a drafter trained on the codec's features against one trained on bf16, judged by held-out ``dflash
eval``: a GPU run, bench/RESULTS.md, "fp8 features against bf16, trained at equal steps").

    PYTHONPATH=. .venv/bin/python bench/fp8_validation.py --drafter RUN/drafter --data ANSWERS.jsonl \\
        --work DIR [--val-samples 60] [--codecs fp8,nf4]

``--data``: chat JSONL the target answered itself (e.g. held-out conversations of
``bench/answers/answers-00.jsonl.gz`` that the drafter never trained on). Each cache is written by ``dflash
generate --target default`` unless ``DIR/cache-<codec>`` already holds it (a rerun resumes). Each validation
is ``dflash train --init-from DRAFTER --lr 1e-12 --max-steps 1``: one step at a learning rate that moves no
weight by a float32 ulp, whose closing validation is therefore the drafter's own, on the split that
``--val-samples`` takes by a hash of the sample ids (the same samples in both caches: checked); a run
directory that holds its validation already is read again, not rerun (``--fresh``). On 2 CPU
cores a validation of 60 ShareGPT conversations takes ≈ 10 minutes (the chain τ runs a block at every
anchor of each turn's first tokens).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_offline.train.validation import TURN_GROUPS, validation_ids_of_run  # noqa: E402


def codec_flags(name: str) -> list[str]:
    """generate's codec flags of a name (bf16: the default codec, lossless)."""
    return [] if name == "bf16" else ["--codec", name]


SCALARS = ("val_loss", "val_simulated_tau", "val_block_tau", "val_chain_tau")


def dflash(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_offline", *args]


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}); its log: {log}\n{log.read_text()[-2000:]}")


def last_validation(run_dir: Path) -> dict | None:
    """The last validation of a run's metrics.jsonl (None: none yet)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    rows = [r for r in rows if "val_chain_tau" in r]
    return rows[-1] if rows else None


def validate_as_is(
    drafter: Path,
    cache: Path,
    out: Path,
    log: Path,
    *,
    val_samples: int,
    tokens_per_microbatch: int = 4096,
    num_anchors: int = 256,
    chain_tokens: int = 256,
    fresh: bool = False,
) -> dict:
    """The drafter's own validation on ``val_samples`` of ``cache`` (``dflash train --init-from DRAFTER --lr
    1e-12 --max-steps 1``: module docstring), run into ``out`` unless ``out`` holds one already (``fresh``:
    run again); its metrics line."""
    if fresh or last_validation(out) is None:
        shutil.rmtree(out, ignore_errors=True)
        run(
            dflash("train", "--cache", str(cache), "--out", str(out), "--target", "default",
                   "--init-from", str(drafter), "--lr", "1e-12", "--max-steps", "1",
                   "--val-samples", str(val_samples), "--val-group", "sample", "--val-every", "1",
                   "--val-chain-tokens", str(chain_tokens),
                   "--tokens-per-microbatch", str(tokens_per_microbatch), "--num-anchors", str(num_anchors),
                   "--compile", "off", "--no-tensorboard", "--no-progress"),
            log,
        )  # fmt: skip
    else:
        print(f"{out} validated already")
    result = last_validation(out)
    assert result is not None
    return result


def recode(source: Path, dest: Path, codec: str) -> None:
    """A cache of ``codec`` holding the samples of the bf16 cache ``source``: the writer encodes the same
    bf16 values that generate's capture step would (``cache/lossy.py``), so the stored bytes are the same."""
    import dataclasses

    from dflash_offline.cache.codecs import storage_dtype
    from dflash_offline.cache.reader import CacheReader
    from dflash_offline.cache.rows import SampleToWrite
    from dflash_offline.cache.writer import ShardWriter

    if (dest / "cache.json").exists():
        return
    with CacheReader.open(source) as reader:
        fingerprint = dataclasses.replace(reader.fingerprint, codec=codec, storage_dtype=storage_dtype(codec))
        ids = reader.samples.sample_id.tolist()
        sources = dict(zip(ids, reader.samples.source_index.tolist(), strict=True))
        with ShardWriter(dest, fingerprint, worker=0) as writer:
            for a in range(0, len(ids), 16):
                for sample in reader.read(ids[a : a + 16]):
                    writer.add(
                        SampleToWrite(
                            sample_id=sample.sample_id,
                            source_index=int(sources[sample.sample_id]),
                            input_ids_T=sample.input_ids_T.numpy(),
                            loss_mask_T=sample.loss_mask_T.numpy(),
                            features_TF=sample.features_TF,
                            bucket_id=sample.bucket_id,
                        )
                    )


def train_drafter(args: argparse.Namespace, cache: Path) -> Path:
    """A drafter trained for ``--train-steps`` on ``cache`` with the same ``--val-samples`` held out (the
    samples validated later: never trained on); its export."""
    out = args.work / "drafter-run"
    if not (out / "drafter" / "config.json").exists():
        run(
            dflash("train", "--cache", str(cache), "--out", str(out), "--target", "default",
                   "--max-steps", str(args.train_steps), "--val-samples", str(args.val_samples),
                   "--val-group", "sample", "--val-every", str(args.train_steps),
                   "--tokens-per-microbatch", str(args.tokens_per_microbatch),
                   "--num-anchors", str(args.num_anchors), "--compile", "off", "--no-tensorboard",
                   "--no-progress"),
            args.work / "train-drafter.log",
        )  # fmt: skip
    return out / "drafter"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, default=None, help="an exported drafter (RUN/drafter)")
    ap.add_argument(
        "--train-steps", type=int, default=0,
        help="without --drafter: train one for this many steps on the bf16 cache's other samples",
    )  # fmt: skip
    ap.add_argument(
        "--recode", action="store_true",
        help="write each lossy cache from the bf16 one's features (the bytes generate would store) "
        "instead of capturing them again",
    )  # fmt: skip
    ap.add_argument("--data", type=Path, required=True, help="chat JSONL of the target's own answers")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--val-samples", type=int, default=60)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--tokens-per-microbatch", type=int, default=4096)
    ap.add_argument("--num-anchors", type=int, default=256)
    ap.add_argument("--fresh", action="store_true", help="validate again where DIR/run-<codec> has")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    ap.add_argument("--codecs", default="fp8", help="the lossy codecs to compare with bf16, comma-separated")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    splits = {}
    names = ["bf16", *args.codecs.split(",")]
    if args.drafter is None and args.train_steps <= 0:
        sys.exit("give --drafter, or --train-steps to train one")
    for name in names:
        cache = args.work / f"cache-{name}"
        if args.recode and name != "bf16":
            recode(args.work / "cache-bf16", cache, name)
        else:
            run(
                dflash("generate", "--cache", str(cache), "--target", "default", "--data", str(args.data),
                       "--max-len", str(args.max_len), "--too-long", "truncate", "--no-progress",
                       *codec_flags(name)),
                args.work / f"generate-{name}.log",
            )  # fmt: skip
        if args.drafter is None:
            args.drafter = train_drafter(args, cache)
        out = args.work / f"run-{name}"
        result = validate_as_is(
            args.drafter, cache, out, args.work / f"train-{name}.log", val_samples=args.val_samples,
            tokens_per_microbatch=args.tokens_per_microbatch, num_anchors=args.num_anchors, fresh=args.fresh,
        )  # fmt: skip
        results[name] = result
        splits[name] = validation_ids_of_run(out)
        print(f"{name}: validated ({result['val_num_samples']} samples, {result['val_seconds']:.0f} s)")
    if any(splits[name] != splits["bf16"] for name in names):
        sys.exit("the caches' validation splits differ: not the same records")
    print_ratios(results, names[1:])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def print_ratios(results: dict[str, dict], lossy: list[str]) -> None:
    """Each metric of bf16 and of each lossy codec, and the codec ÷ bf16 ratios."""
    bf16 = results["bf16"]
    print(f"\n{'metric':<24} {'bf16':>9} " + " ".join(f"{n:>9} {n + '/bf16':>10}" for n in lossy))
    for key in SCALARS:
        cells = " ".join(f"{results[n][key]:>9.4f} {results[n][key] / bf16[key]:>10.4f}" for n in lossy)
        print(f"{key:<24} {bf16[key]:>9.4f} {cells}")
    for i, turn in enumerate(TURN_GROUPS):
        b = bf16["val_chain_tau_by_turn"][i]
        by_turn = [results[n]["val_chain_tau_by_turn"][i] for n in lossy]
        cells = " ".join(f"{v:>9.4f} {v / b:>10.4f}" for v in by_turn)
        print(f"{'val_chain_tau turn ' + turn:<24} {b:>9.4f} {cells}")
    for n in lossy:
        diffs = [
            f - b for b, f in zip(bf16["val_acc_by_position"], results[n]["val_acc_by_position"], strict=True)
        ]
        print(f"accuracy by block position, {n} − bf16: {' '.join(f'{d:+.4f}' for d in diffs)}")


if __name__ == "__main__":
    main()
