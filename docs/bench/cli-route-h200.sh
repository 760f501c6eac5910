#!/usr/bin/env bash
# The route a user takes, on one H200 (nvidia-h200 kind): random Qwen2.5-7B weights written to a local
# directory, then `lightning-oomb fit` on each GPU example YAML for 3 steps with a checkpoint at step 2, resumed
# from it for the third step again, then train_step + AdamW in the same process for the ratio (2 steps at 1M,
# a steady one). The YAMLs run in the order given (default: 1m lora 128k; the 1M one first, so a lease that
# ends early still has the headline); at 1M all three parts take about 23 minutes, LoRA and 128K about 10.
# `packed`: the 128K YAML on documents of 32,768 tokens with document masking, 3 steps and no checkpoint, then
# 2 steps of train_step + AdamW given the same position ids (issue 31 through the user's route).
# `128k-adamw`, `1m-adamw`: the same YAML with plain AdamW instead of its own optimizer (adamw8bit-kahan), 2 steps
# and no checkpoint: its own optimizer's cost, when run in the same call as `128k` or `1m`.
# Results: docs/benchmarks.md, "How fast through `lightning-oomb fit`?" and "Checkpoints and resuming through
# `lightning-oomb fit`".
#   bash docs/bench/cli-route-h200.sh WORKDIR MODEL_DIR [1m] [lora] [128k] [packed] [128k-adamw] [1m-adamw]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
work=${1:-/root/job}
model=${2:-/root/qwen2.5-7b}
shift $(( $# < 2 ? $# : 2 ))
names=${*:-1m lora 128k}
mkdir -p "$work"
route() { "$python" -m lightning_oomb.bench.cli_route --model-dir "$model" --steps 3 --delete-checkpoints "$@"; }
[ -f "$model/config.json" ] || "$python" -c "import sys; from pathlib import Path
from lightning_oomb.bench.cli_route import make_model
print(f'random qwen2.5-7b weights written in {make_model(\"qwen2.5-7b\", Path(sys.argv[1])):.1f} s')" "$model"
for name in $names; do
  case $name in
    1m) free_gb=$(df --output=avail -B1G "$work" | tail -1)
        [ "$free_gb" -lt 50 ] && { echo "disk free ${free_gb} GB: no room for the 46 GB 1M checkpoint" >&2; exit 1; }
        route --config examples/qwen2.5-7b-1m-sparse.yaml --checkpoint-every 2 --resume --baseline --baseline-steps 2 \
          --out "$work/1m" ;;
    lora) route --config examples/lora.yaml --checkpoint-every 2 --resume --baseline --out "$work/lora" ;;
    128k) route --config examples/qwen2.5-7b-128k.yaml --checkpoint-every 2 --resume --baseline --out "$work/128k" ;;
    packed) route --config examples/qwen2.5-7b-128k.yaml --document-length 32768 --baseline --baseline-steps 2 \
          --out "$work/packed" ;;
    128k-adamw) route --config examples/qwen2.5-7b-128k.yaml --steps 2 --checkpoint-every 0 --optimizer adamw \
          --out "$work/128k-adamw" ;;
    1m-adamw) route --config examples/qwen2.5-7b-1m-sparse.yaml --steps 2 --checkpoint-every 0 --optimizer adamw \
          --out "$work/1m-adamw" ;;
    *) echo "unknown YAML name $name (1m, lora, 128k, packed, 128k-adamw, 1m-adamw)" >&2; exit 2 ;;
  esac
done
touch "$work/done"
