#!/usr/bin/env bash
# The common cards' memory on one H200 (nvidia-h200 kind, issue 55 item 3): the strategy's GPU memory budget
# (gpu_memory, which holds the caching allocator to it) stands in for a 24 GiB or 80 GiB card. Only the
# memory is capped: the H200's compute and PCIe remain, so step times are the H200's. For CASE
#   qlora-24   examples/qlora-24gb.yaml, QLoRA rank 16 nf4, at the planner's longest context for 24 GiB;
#   qlora-80   the same YAML at the planner's longest context for 80 GiB (79 GiB, what torch sees of one);
#   full-80    examples/qwen2.5-7b-h100.yaml, full training with its optimizer, at the longest for 79 GiB;
# `lightning-oomb plan --max-context` names the context (this machine's host budget, one selection per chunk),
# then `lightning-oomb fit` runs STEPS steps of it (bench.cli_route: random Qwen2.5-7B weights in MODEL_DIR,
# the child's memory sampled every second). Needs bitsandbytes for the QLoRA cases. Run it under setsid.
#   bash docs/bench/capped-cards-h200.sh CASE OUT [MODEL_DIR] [STEPS]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
case_=${1:?CASE}; out=${2:?OUT}; model=${3:-/root/qwen2.5-7b}; steps=${4:-2}
case $case_ in
  qlora-24) gpu=24GiB; yaml=examples/qlora-24gb.yaml; row="QLoRA rank 16, nf4, sparse"
            flags=(--lora-rank 16 --quantization nf4) ;;
  qlora-80) gpu=79GiB; yaml=examples/qlora-24gb.yaml; row="QLoRA rank 16, nf4, sparse"
            flags=(--lora-rank 16 --quantization nf4) ;;
  full-80)  gpu=79GiB; yaml=examples/qwen2.5-7b-h100.yaml; row="full training, adamw8bit-kahan, sparse"
            flags=(--optimizer adamw8bit-kahan) ;;
  *) echo "CASE must be qlora-24, qlora-80 or full-80, got $case_" >&2; exit 1 ;;
esac
mkdir -p "$out"
logged "$out/max-context.txt" "$python" -m lightning_oomb.cli plan --model qwen2.5-7b --max-context --grad-dtype bfloat16 \
  --selection chunk --gpu-memory "$gpu" "${flags[@]}"
context=$(grep "^$row" "$out/max-context.txt" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+(,[0-9]+)+$/) {gsub(",", "", $i); print $i; exit}}' || true)
case $context in ''|*[!0-9]*) echo "no longest context for '$row' in $out/max-context.txt" >&2; exit 1 ;; esac
echo "$case_: longest context on a $gpu budget with this machine's host: $context tokens"
"$python" -m lightning_oomb.bench.cli_route --config "$yaml" --model-dir "$model" --make-model qwen2.5-7b \
  --seq-len "$context" --steps "$steps" --checkpoint-every 0 --gpu-memory "$gpu" --out "$out"
touch "$out/done"
