#!/usr/bin/env bash
# A trained drafter and what `dflash eval` needs of its run, in pieces small enough to come back from a GPU
# machine (files of at most 16 MiB) and travel to the next one, where `dflash train --init-from` continues it.
#   bash bench/drafter_parts.sh split RUN OUT    # RUN/drafter as bfloat16 in parts of 15 MiB (OUT/drafter.part*),
#                                                # its config.json and the run's small files (OUT/run-files.tgz)
#   bash bench/drafter_parts.sh join DIR RUN     # the reverse: RUN/config.json, snapshot.parquet, …,
#                                                # RUN/drafter/{config.json, model.safetensors}
# The run's files (config.json, snapshot.parquet, validation_groups.parquet, metrics.jsonl) let eval find
# what the drafter trained on (its held-out rule follows --init-from down the chain) when RUN is rebuilt at
# its old absolute path and its cache is there again; bfloat16 halves the weights (the training keeps float32
# master weights and starts from these rounded ones).
set -euo pipefail
cmd=${1:?split RUN OUT, or join DIR RUN}
case "$cmd" in
  split)
    run=${2:?RUN}; out=${3:?OUT}; mkdir -p "$out"
    tmp=$(mktemp -d)
    python3 - "$run/drafter" "$tmp" <<'EOF'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(src / "model.safetensors")).items()}
save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
config["torch_dtype"] = "bfloat16"
(dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
EOF
    split -b 15m -d "$tmp/model.safetensors" "$out/drafter.part"
    cp "$tmp/config.json" "$out/drafter-config.json"
    files=(config.json snapshot.parquet)
    for f in validation_groups.parquet metrics.jsonl; do [ -f "$run/$f" ] && files+=("$f"); done
    tar czf "$out/run-files.tgz" -C "$run" "${files[@]}"
    echo "$run/drafter -> $(ls "$out" | tr '\n' ' ')"
    rm -rf "$tmp"
    ;;
  join)
    dir=${2:?DIR}; run=${3:?RUN}; mkdir -p "$run/drafter"
    tar xzf "$dir/run-files.tgz" -C "$run"
    cat "$dir"/drafter.part* > "$run/drafter/model.safetensors"
    cp "$dir/drafter-config.json" "$run/drafter/config.json"
    echo "$run: $(ls "$run" | tr '\n' ' '); drafter: $(du -h "$run/drafter/model.safetensors" | cut -f1)"
    ;;
  *) echo "split RUN OUT, or join DIR RUN" >&2; exit 2 ;;
esac
