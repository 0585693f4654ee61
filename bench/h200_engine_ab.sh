#!/usr/bin/env bash
# The decode engine's measurements on one H200 as one detached job, stage after stage while the device
# time lasts (the machine may be taken back at any time, so every figure is written under /tmp/results as
# soon as it exists, and each follow-up call copies it back). Staged as for bench/h200_quality_run.sh
# (wheels in /tmp/site, /tmp/stage, the tree in /tmp/tree); optionally an earlier commit's package and bench
# scripts as /tmp/stage/engine-before.tgz for a "before" variant of the side by side:
#   git archive COMMIT dflash_offline $(git ls-tree --name-only COMMIT bench/ | grep '\.py$') | gzip \
#     > .device/stage/engine-before.tgz
# Run from /tmp/tree:
#   bash /tmp/follow.sh start s -- bash bench/h200_engine_ab.sh run SECONDS_LEFT
#   bash /tmp/follow.sh wait s 280; bash bench/h200_engine_ab.sh collect      # calls back to back
# Stages (STAGES, comma-separated, default all, in this order; one whose cost does not fit the seconds
# left, less a 60 s reserve, is skipped with a note):
#   tests    pytest -m gpu of the decode engine (the live attention's kernel and engine tests among them,
#            and the compiled target and drafter inside the engine's and the cycle's graphs)
#   cycle    bench/spec_cycle.py: eval's speculative cycle over one target decode step, both models eager
#            and both compiled (dflash eval --compile on), ms and kernels a step and a cycle (the issue's
#            goal: a cycle <= 1.5x a step)
#   ab       bench/regenerate_variants.py: regenerate's engine variants (before, now: the defaults, padded:
#            the defaults before the ninth session, each default left out in turn, --compile on), AB_S
#            seconds each (56), on the records after those the quality runs answered (--skip 12600: the
#            slots stay full); the warm-up run compiles first (inductor's on-disk cache serves the variants)
#   decode   bench/decode.py --sections live: decode throughput with each attention, SmolLM2's and
#            Qwen3-8B's shapes (random weights), and SmolLM2's with its layers compiled
#   qwen3    bench/decode.py --sections qwen3-live,qwen3-profile: Qwen3-8B's shape with the live attention
#            at batch 256 and 512 (256 new tokens) and 256 (512 new), and the kernel profile of its step
#   codecs   dflash generate of the staged ShareGPT answers with the default codec, then fp8, CODEC_S seconds
#            each (75, stopped by SIGINT: each prints what it committed and its tok/s), the caches deleted;
#            then the fp8 codec's GPU tests in the background
#   rest     the rest of the ShareGPT file, resumed from the fastest ab variant's answers (REST_S, 240 s;
#            the answers gzipped for bench/answers/)
#   turns    bench/regenerate_turns.py: KV reuse across turns against whole prompts, each attention
#   quality  bench/h200_quality_run.sh with the fp8 cache beside the default at equal steps, on the first
#            6,000 chat conversations and the 6,000 code answers (at least 1,200 s: ≈ 1,000 steps each).
#            Q_* variables change it: Q_CHAT (chat conversations staged, 6000), Q_CODE2=1 (the second code
#            file, bench/answers/code-answers-2.jsonl.gz, trained on too), Q_CODECS (auto: fp8 if the codecs
#            stage measured it at >= 0.9x the default codec, else the default codec with Q_CHAT_DEFAULT
#            conversations, 9000, and "@fp8" dropped from the variants), Q_VARIANTS,
#            Q_EVAL_VARIANTS, Q_STEPS_PER_S, Q_VAL_EVERY, Q_REGEN_S (0: the staged answers as they are),
#            Q_GEN_S, Q_EVAL_S, Q_MIN_S (the seconds it needs, 1200), Q_CODE_LIMIT code problems of Q_CODE_PROMPTS
#            (default /tmp/stage/code-prompts.jsonl.gz) answered after the chat (their answers come back by
#            `collect` as code-answers-new.jsonl.gz), Q_INIT_PARTS (a folder of an earlier
#            drafter's parts, joined into /tmp/init/run-all for --init-from). The drafter of variant Q_KEEP
#            (the first) is split for `dflash train --init-from` in a later session
#            (bench/drafter_parts.sh), and `collect` brings its parts back. Q_EQUAL_STEPS=1: every variant
#            trains the same number of steps (h200_quality.py --equal-steps).
# REGEN_ARGS replaces regenerate's arguments (a CPU smoke test: --target random:tiny ... --batch-size 16).
set -uo pipefail
cmd=${1:?run SECONDS_LEFT, or collect}
R=/tmp/results
if [ "$cmd" = collect ]; then
  out=${OUT:-/tmp/out}; mkdir -p "$out" $R
  # The quality run's best drafter so far (RUN/drafter is exported at each better validation), split anew
  # whenever it changed: every follow-up call brings it back, so a machine lost mid-run still leaves the
  # next session its warm start. RUN is variant Q_KEEP's (default "all", the one-variant plan's).
  run=/tmp/q/run-${Q_KEEP:-all}
  if [ -f $run/drafter/config.json ] && [ $run/drafter/model.safetensors -nt $R/drafter/drafter.part00 ]; then
    rm -rf $R/drafter.new && PYTHONPATH=/tmp/site:$PWD bash bench/drafter_parts.sh split $run $R/drafter.new \
      && rm -rf $R/drafter && mv $R/drafter.new $R/drafter
  fi
  # Code problems the quality run answered (Q_CODE_LIMIT), kept for the sessions after as a file of their own.
  if [ /tmp/q/answers.jsonl -nt $R/code-answers-new.jsonl.gz ] && grep -q '^{"id": "code-' /tmp/q/answers.jsonl; then
    grep '^{"id": "code-' /tmp/q/answers.jsonl | gzip > $R/code-answers-new.jsonl.gz
  fi
  [ -d /tmp/q ] && (cd /tmp/q && tar czf $R/q.tgz report/summary.* report/logs.txt run-*/metrics.jsonl \
    eval-*.json chat_eval-*.json logs 2>/dev/null)
  tar czf "$out/results.tgz" -C $R --exclude='*/answers.jsonl*' --exclude=./drafter \
    --exclude=./code-answers-new.jsonl.gz . && ls -la "$out"
  [ -f $R/code-answers-new.jsonl.gz ] && cp $R/code-answers-new.jsonl.gz "$out/"
  # The kept drafter's parts (15 MiB each) as files of their own: what comes back is at most 16 MiB a file.
  [ -d $R/drafter ] && cp $R/drafter/* "$out/" && ls -la "$out"
  exit 0
fi
T0=$(date +%s); LEFT=${2:?seconds of device time left}
mkdir -p $R
left() { echo $(( LEFT - ($(date +%s) - T0) )); }
# fits NAME COST: whether stage NAME is asked for and COST seconds fit the time left (a note if not).
fits() {
  case ",${STAGES:-tests,cycle,ab,decode,qwen3,codecs,rest,turns,quality}," in *",$1,"*) ;; *) return 1 ;; esac
  if [ "$(left)" -lt $(( $2 + 60 )) ]; then echo "$1 skipped: $(left) s left, it needs $2"; return 1; fi
  echo "== $1 at $(( $(date +%s) - T0 )) s ($(left) s left)"
}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_PRESET_TOKENIZER=/tmp/stage/tokenizer
export DFLASH_CACHE_DIR=/tmp/dflash-user-cache
# shellcheck disable=SC2206  # split on purpose
A=(${REGEN_ARGS:---target default --data /tmp/stage/sharegpt-prompts.jsonl.gz --max-new-tokens 256
   --max-prompt-tokens 1536 --batch-size 1024 --max-batch-tokens 8192 --gpus 0 --no-progress})

if fits tests 240; then
  timeout 240 python3 -m pytest -q -m gpu tests/decode -p no:cacheprovider > $R/gpu-tests.txt 2>&1
  tail -3 $R/gpu-tests.txt
fi

if fits cycle 240; then
  timeout 240 python3 bench/spec_cycle.py --target random:smollm2-135m --data /tmp/stage/sharegpt-prompts.jsonl.gz \
    --prompts 3 --new-tokens 128 --json $R/spec-cycle.json > $R/spec-cycle.txt 2>&1
  tail -3 $R/spec-cycle.txt
fi

best=now flags=""
if fits ab $(( 6 * ${AB_S:-56} + 150 )); then
  # The GGUF weights cache, so that no variant pays it, and inductor's compile of the target's layers
  # (cached on disk: the compiled variants trace again but build no kernels).
  timeout 180 python3 -m dflash_offline regenerate "${A[@]}" --skip 17000 --limit 8 --compile on \
    --out /tmp/warm/answers.jsonl > $R/warm.log 2>&1
  tail -2 $R/warm.log
  # "now": the defaults (on a GPU: live attention, KV reuse, prefill graphs); "padded": the defaults before.
  variants='{"now": "", "padded": "--decode-attention padded --reuse-kv off --prefill-graphs off",
             "no-reuse": "--reuse-kv off", "no-graphs": "--prefill-graphs off", "compiled": "--compile on"}'
  trees=()
  if [ -f /tmp/stage/engine-before.tgz ]; then
    mkdir -p /tmp/before && tar -xzf /tmp/stage/engine-before.tgz -C /tmp/before
    variants="{\"before\": \"\", ${variants#\{}"
    trees=(--tree before=/tmp/before)
  fi
  python3 bench/regenerate_variants.py --seconds "${AB_S:-56}" --out-dir $R/ab "${trees[@]}" \
    --variants "$variants" -- "${A[@]}" --skip 12600 2>&1 | tee $R/ab.txt
  best=$(python3 -c "
import json; rs = [r for r in json.load(open('$R/ab/variants.json')) if r['name'] != 'before' and r['returncode'] in (0, 130)]
print(max(rs, key=lambda r: r['new_tok_per_s'])['name'] if rs else 'now')")
  flags=$(python3 -c "import json; print(json.loads('''$variants''')['$best'])")
  echo "fastest: $best ($flags)"
fi

if fits decode 320; then
  python3 bench/decode.py --data /tmp/stage/sharegpt-prompts.jsonl.gz --sections live --budget-s 300 \
    --limit-s 40 --json $R/decode-live.json > $R/decode-live.txt 2>&1
  tail -12 $R/decode-live.txt
fi

if fits qwen3 300; then
  timeout 300 python3 bench/decode.py --data /tmp/stage/sharegpt-prompts.jsonl.gz --sections qwen3-live,qwen3-profile \
    --budget-s 280 --limit-s 60 --json $R/qwen3.json > $R/qwen3.txt 2>&1
  tail -8 $R/qwen3.txt
fi

if fits codecs $(( 2 * ${CODEC_S:-75} + 90 )); then
  gunzip -c /tmp/stage/answers-00.jsonl.gz > /tmp/codecs-data.jsonl
  # A first generate converts the GGUF weights into the user cache (≈ 30 s); a short one pays it here, so
  # that the timed runs compare the codecs alone.
  timeout 120 python3 -m dflash_offline generate --cache /tmp/codec-warm --target default \
    --data /tmp/codecs-data.jsonl --limit 64 --max-len 2048 --too-long truncate --gpus 0 --no-progress \
    > $R/codec-warm.log 2>&1; rm -rf /tmp/codec-warm
  for codec in default fp8; do
    flags=(); [ "$codec" = default ] || flags=(--codec "$codec")
    timeout -s INT "${CODEC_S:-75}" python3 -m dflash_offline generate --cache /tmp/codec-$codec --target default \
      --data /tmp/codecs-data.jsonl --max-len 2048 --too-long truncate --gpus 0 --no-progress "${flags[@]}" \
      > $R/codec-$codec.log 2>&1
    echo "$codec: $(grep -E 'committed|writer busy' $R/codec-$codec.log | tr -s ' ' | tr '\n' ' ')"
    # The run's committed tok/s after its start-up (its summary line), for Q_CODECS=auto.
    sed -nE 's/.*committed [0-9]+ samples, [0-9]+ tokens \([0-9,]+ tok\/s; ([0-9,]+) tok\/s after start-up\).*/\1/p' \
      $R/codec-$codec.log \
      | tr -d , | tail -1 > $R/codec-$codec.rate
    rm -rf /tmp/codec-$codec
  done
  rm -f /tmp/codecs-data.jsonl
  # The fp8 codec's GPU tests (device encode and decode bit for bit against the CPU's), in the background
  # while the next stage stages its data.
  (timeout 150 python3 -m pytest -q -m gpu tests/cache/test_fp8.py tests/train/test_fp8_train.py \
    -p no:cacheprovider > $R/fp8-gpu-tests.txt 2>&1 &)
fi

if fits rest $(( ${REST_S:-240} + 30 )); then
  mkdir -p /tmp/rest && cp $R/ab/$best/answers.jsonl* /tmp/rest/ 2>/dev/null
  # shellcheck disable=SC2086  # $flags: regenerate flags, split on purpose
  timeout -s INT "${REST_S:-240}" python3 -m dflash_offline regenerate "${A[@]}" --skip 12600 $flags \
    --out /tmp/rest/answers.jsonl > $R/rest.log 2>&1
  echo "rest: rc $?; $(wc -l < /tmp/rest/answers.jsonl) conversations"
  grep "throughput:" $R/rest.log | tail -1
  gzip -c /tmp/rest/answers.jsonl > $R/more-answers-sharegpt.jsonl.gz
  [ -f /tmp/rest/answers.jsonl.partial ] && gzip -c /tmp/rest/answers.jsonl.partial > $R/more-answers-partial.jsonl.gz
fi

if fits turns 260; then
  timeout 250 python3 bench/regenerate_turns.py --target default --data /tmp/stage/sharegpt-prompts.jsonl.gz \
    --limit 256 --max-new-tokens 128 --max-prompt-tokens 1536 --batch-size 256 --max-batch-tokens 8192 \
    --repeats 1 --warmup 8 --decode-attention padded live --json $R/turns.json > $R/turns.txt 2>&1
  tail -2 $R/turns.txt | cut -c1-2000
fi

if fits quality "${Q_MIN_S:-1200}"; then
  budget=$(( $(left) - 60 ))
  chat=${Q_CHAT:-6000} regen=${Q_REGEN_S:-60} gen=${Q_GEN_S:-200} ev=${Q_EVAL_S:-200}
  codecs=${Q_CODECS:-default,fp8} pair='{"bf16": "", "fp8": "@fp8"}' variants=${Q_VARIANTS:-$pair}
  if [ "$codecs" = auto ]; then
    # fp8 when the codecs stage measured it at ≥ 0.9× the default codec's rate; else the default codec, its
    # variants' "@fp8" dropped and Q_CHAT_DEFAULT conversations (what fits the disk at 0.70 of raw).
    fp8_rate=$(cat $R/codec-fp8.rate 2>/dev/null); default_rate=$(cat $R/codec-default.rate 2>/dev/null)
    # (A rate of 0, a run that committed nothing, measured nothing.)
    if [ "${fp8_rate:-0}" -gt 0 ] && [ "${default_rate:-0}" -gt 0 ] && [ $(( fp8_rate * 10 )) -ge $(( default_rate * 9 )) ]; then
      codecs=fp8
    else
      codecs=default chat=${Q_CHAT_DEFAULT:-9000} variants=${variants//@fp8/}
    fi
    echo "codec: $codecs (generate's tok/s: fp8 ${fp8_rate:-?}, default ${default_rate:-?})"
  fi
  # Without pipefail here: head's early exit ends gunzip with SIGPIPE, which is how this subset is cut.
  (set +o pipefail; gunzip -c /tmp/stage/answers-00.jsonl.gz | head -n "$chat" | gzip -1 > /tmp/stage/a) \
    && mv /tmp/stage/a /tmp/stage/answers-00.jsonl.gz
  echo "staged chat conversations: $(gunzip -c /tmp/stage/answers-00.jsonl.gz | wc -l)"
  [ "${Q_CODE2:-0}" = 1 ] && cp /tmp/stage/code-answers-2.jsonl.gz /tmp/stage/extra-answers-code-2.jsonl.gz
  # An earlier session's drafter (bench/drafter_parts.sh split) to continue: Q_VARIANTS then names
  # --init-from /tmp/init/run-all/drafter.
  [ -n "${Q_INIT_PARTS:-}" ] && bash bench/drafter_parts.sh join "$Q_INIT_PARTS" /tmp/init/run-all
  # Training's seconds at least: h200_quality.py gives it too what regenerate and generate leave unused.
  train=$(( budget - regen - gen - ev - 90 ))
  echo "quality run: BUDGET_S=$budget TRAIN_S=$train chat $chat code2 ${Q_CODE2:-0} variants $variants"
  BUDGET_S=$budget REGEN_S=$regen REGEN_LIMIT=$chat GEN_S=$gen TRAIN_S=$train EVAL_S=$ev \
    CODE_LIMIT=${Q_CODE_LIMIT:-0} CODE_PROMPTS=${Q_CODE_PROMPTS:-/tmp/stage/code-prompts.jsonl.gz} \
    VAL_EVERY=${Q_VAL_EVERY:-200} STEPS_PER_S=${Q_STEPS_PER_S:-4.5} CODECS=$codecs \
    VARIANTS=$variants EVAL_VARIANTS=${Q_EVAL_VARIANTS:-all} EQUAL_STEPS=${Q_EQUAL_STEPS:-} \
    bash bench/h200_quality_run.sh
  keep=${Q_KEEP:-$(python3 -c "import json, sys; print(next(iter(json.loads(sys.argv[1]))))" "$variants")}
  [ -f /tmp/q/run-"$keep"/drafter/config.json ] && bash bench/drafter_parts.sh split /tmp/q/run-"$keep" $R/drafter
fi
echo "done at $(( $(date +%s) - T0 )) s"
