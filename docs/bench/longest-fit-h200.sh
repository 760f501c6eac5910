#!/usr/bin/env bash
# The user's route at the edge of one H200 (nvidia-h200 kind, issue 29): `lightning-oomb plan --max-context` on
# this machine names the longest sparse context (budget 64 pages, per query tile, bf16 KV-gradients) of full
# training with OPTIMIZER (default adamw; any name `plan --optimizer` takes), or with TRAINING=lora of LoRA rank 16
# (q, k, v, o; AdamW on the adapters); then
# `lightning-oomb fit` runs the 1M sparse YAML at that length (`bench.cli_route --seq-len [--lora-rank 16]`)
# from a local directory of random Qwen2.5-7B weights, for STEPS steps (default 2), no checkpoint, sampling the
# child's resident set, the machine's memory and the GPU every second (fit-memory.csv). About 16 minutes for
# two full-training steps, 14 for LoRA: run it under setsid and read OUT back (device README).
#   [TRAINING=full|lora] [OPTIMIZER=adamw8bit] bash docs/bench/longest-fit-h200.sh OUT MODEL_DIR [STEPS]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/longest-fit}
model=${2:-/root/qwen2.5-7b}
steps=${3:-2}
training=${TRAINING:-full}
optimizer=${OPTIMIZER:-adamw}
case $training in
  full) row="full training, $optimizer, sparse"; extra=(--optimizer "$optimizer") ;;
  lora) row="LoRA rank 16, sparse"; extra=(--lora-rank 16) ;;
  *) echo "TRAINING must be full or lora, got $training" >&2; exit 1 ;;
esac
mkdir -p "$out"
logged "$out/max-context.txt" "$python" -m lightning_oomb.cli plan --model qwen2.5-7b --max-context --grad-dtype bfloat16 \
  --optimizer "$optimizer"
context=$(grep "^$row" "$out/max-context.txt" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+(,[0-9]+)+$/) {gsub(",", "", $i); print $i; exit}}' || true)
case $context in ''|*[!0-9]*) echo "no longest context for '$row' in $out/max-context.txt" >&2; exit 1 ;; esac
echo "longest $training sparse context on this machine: $context tokens"
"$python" -m lightning_oomb.bench.cli_route --config examples/qwen2.5-7b-1m-sparse.yaml --model-dir "$model" \
  --make-model qwen2.5-7b --seq-len "$context" --steps "$steps" --checkpoint-every 0 "${extra[@]}" --out "$out"
touch "$out/done"
