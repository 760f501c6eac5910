#!/usr/bin/env bash
# The models users train (issue 56) on one H200 (nvidia-h200 kind), through the bench, random bf16 weights of
# the built-in shapes, bf16 KV-gradients, layer checkpointing, no optimizer:
#   moe     Qwen3-30B-A3B (128 experts, 8 per token), LoRA rank 16 on q, k, v, o, sparse attention (64 pages of
#           128): the planner's longest context on this machine (`lightning-oomb plan --max-context`, its host
#           budget), one cold step (mode sparse);
#   gemma   Gemma 3 12B at 128K dense, LoRA rank 16, the built-in shape (five sliding-window layers of 1,024
#           tokens per global layer), one warm-up and one timed step (mode oomb);
#   global  the same shape with every layer global (layer_types all full_attention, written to
#           OUT/gemma-3-12b-global/config.json), the same steps: the sliding-window layers' speed-up and memory.
# Where the pages do not fit the GPU the Gemma steps stream them from host memory (the all-global twin on an 80 GB
# card; the windowed model keeps its local layers' K/V pages only where a later chunk's window reaches them).
# About 10 minutes on an H200. Run it under setsid and read OUT/*/results.csv and OUT/max-context.txt back
# (device README).
#   bash docs/bench/families-h200.sh OUT [moe] [gemma] [global]    (all three when none is named)
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/families}
shift $(( $# < 1 ? $# : 1 ))
parts=${*:-moe gemma global}
mkdir -p "$out"
common=(--grad-dtype bfloat16 --checkpoint-layers --lora-rank 16)
for part in $parts; do
  case $part in
    moe)
      logged "$out/max-context.txt" "$python" -m lightning_oomb.cli plan --model qwen3-30b-a3b --max-context \
        --lora-rank 16 --budget-pages 64 --grad-dtype bfloat16 --checkpoint-layers on
      row="LoRA rank 16, sparse"
      context=$(grep "^$row" "$out/max-context.txt" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+(,[0-9]+)+$/) {gsub(",", "", $i); print $i; exit}}' || true)
      case $context in ''|*[!0-9]*) echo "no longest context for '$row' in $out/max-context.txt" >&2; exit 1 ;; esac
      echo "longest LoRA sparse context of qwen3-30b-a3b on this machine: $context tokens"
      "$python" -m lightning_oomb.cli bench --model qwen3-30b-a3b "${common[@]}" --modes sparse --budget-pages 64 \
        --lengths "$context" --repeats 1 --warmup 0 --out "$out/moe" ;;
    gemma)
      "$python" -m lightning_oomb.cli bench --model gemma-3-12b "${common[@]}" --modes oomb --lengths 128K \
        --repeats 1 --warmup 1 --out "$out/gemma-windows" ;;
    global)
      mkdir -p "$out/gemma-3-12b-global"
      "$python" - "$out/gemma-3-12b-global/config.json" <<'PY'
import json, sys
from lightning_oomb.core.model_shape import load_config_dict
config = load_config_dict("gemma-3-12b")
config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
json.dump(config, open(sys.argv[1], "w"))
PY
      "$python" -m lightning_oomb.cli bench --model "$out/gemma-3-12b-global/config.json" "${common[@]}" \
        --modes oomb --lengths 128K --repeats 1 --warmup 1 --out "$out/gemma-global" ;;
    *) echo "unknown part $part (moe, gemma, global)" >&2; exit 2 ;;
  esac
done
touch "$out/done"
