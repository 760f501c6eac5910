#!/usr/bin/env bash
# The longest sparse steps one H200 (nvidia-h200 kind, ~112 GiB host budget) holds, through the bench (issue 29):
# Qwen2.5-7B shape, random bf16 weights, budget 64 pages of 128, one selection per chunk, bf16 KV-gradients,
# layer checkpointing, no optimizer, offload "auto" (the placement a training step would choose):
#   1. full training at 1,835,008 tokens (1.75M; KV-gradient pages of every layer on the host);
#   2. LoRA rank 16 at 2,080,768 tokens (the LoRA row of `lightning-oomb plan --max-context` on the H200 at
#      8676b3d; 2,097,152 was 4 GiB over the host budget with whole layers moved).
# Results: docs/benchmarks.md, "How long a context fits on one H200".
# One cold step each (--warmup 0; a 64K step first compiles the kernels): the CSV's pin_s is the share spent page-locking host memory. 12.3 minutes at 8676b3d:
# run it under setsid and read $OUT/*/results.csv back (device README).
#   bash docs/bench/longest-context-h200.sh OUT            (CASES="full" runs the first only)
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/longest}
mkdir -p "$out"
common=(--model qwen2.5-7b --modes sparse --budget-pages 64 --selection chunk --grad-dtype bfloat16
        --checkpoint-layers --repeats 1 --warmup 0)
for case in ${CASES:-full lora}; do
    case $case in
        full) "$python" -m lightning_oomb.cli bench "${common[@]}" --lengths 65536,1835008 --out "$out/full" ;;
        lora) "$python" -m lightning_oomb.cli bench "${common[@]}" --lengths 2080768 --lora-rank 16 --out "$out/lora" ;;
        *) echo "CASES are full and lora, got $case" >&2; exit 1 ;;
    esac
done
touch "$out/done"
