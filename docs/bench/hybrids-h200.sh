#!/usr/bin/env bash
# A hybrid model through `lightning-oomb fit` on one GPU (issue 70, item 4): eight of Qwen3-Next-80B-A3B's 48 layers
# (its built-in shape with num_hidden_layers 8: six Gated DeltaNet layers and two attention layers, 512 experts a
# layer, 13.8B parameters; the whole model's 79B bf16 weights fit no single GPU), random bf16 weights written to a
# local directory, LoRA rank 16 through `cli_route`:
#   1. examples/lora.yaml at 128K tokens, 2 steps;
#   2. examples/qwen2.5-7b-1m-sparse.yaml at 1,048,576 tokens (sparse attention on the two attention layers), LoRA
#      rank 16 and plain AdamW instead of the YAML's full training, 2 steps.
# Each summary.json holds the step times, GPU and host peaks and the plan's; the fit log holds the plan (its step
# time counts the delta rule's FLOPs at attention's efficiency and, where flash-linear-attention is not installed,
# the small operations transformers' torch path launches in its Python loop over 64-token blocks).
# Run it under setsid and read OUT/*/summary.json back (device README).
#   bash docs/bench/hybrids-h200.sh OUT [MODEL_DIR] [128k] [1m]    (both parts when none is named)
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/hybrids}
model=${2:-/root/qwen3-next-8-layers}
shift $(( $# < 2 ? $# : 2 ))
parts=${*:-128k 1m}
mkdir -p "$out"
"$python" - "$out/qwen3-next-8-layers.json" <<'PY'
import json, sys
from lightning_oomb.core.model_shape import load_config_dict
config = load_config_dict("qwen3-next-80b-a3b")
config["num_hidden_layers"] = 8
json.dump(config, open(sys.argv[1], "w"))
PY
route() { "$python" -m lightning_oomb.bench.cli_route --model-dir "$model" --make-model "$out/qwen3-next-8-layers.json" \
  --steps 2 --checkpoint-every 0 "$@"; }
for part in $parts; do
  case $part in
    128k) logged "$out/128k.log" route --config examples/lora.yaml --seq-len 131072 --out "$out/128k" ;;
    1m) logged "$out/1m-sparse.log" route --config examples/qwen2.5-7b-1m-sparse.yaml --lora-rank 16 \
          --optimizer adamw --seq-len 1048576 --out "$out/1m-sparse" ;;
    *) echo "unknown part $part (128k, 1m)" >&2; exit 2 ;;
  esac
done
touch "$out/done"
