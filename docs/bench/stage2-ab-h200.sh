#!/usr/bin/env bash
# Stage 2 of two chunks of a 256K sparse step under the profiler, for an earlier tree and for this one, in one
# lease (Qwen2.5-7B shape, random bf16 weights, budget 64 pages of 128, one selection per chunk, bf16
# KV-gradients, every layer checkpointed, pages on the GPU): what a change to stage 2's kernels gains.
#   git archive COMMIT | tar -x -C BEFORE      (here; carry BEFORE to the device)
#   bash docs/bench/stage2-ab-h200.sh BEFORE OUT
set -u
before=$1
out=${2:-/root/ab}
mkdir -p "$out"
args=(--model qwen2.5-7b --context 262144 --budget-pages 64 --selection chunk --grad-dtype bfloat16
      --checkpoint-layers --offload gpu --chunks 40:42 --top 30 --timeline-bin 16)
(cd "$before" && PYTHONPATH=$PWD python3 -u -m lightning_oomb.bench.profile_step "${args[@]}") > "$out/before.txt" 2>&1
PYTHONPATH=$PWD python3 -u -m lightning_oomb.bench.profile_step "${args[@]}" > "$out/after.txt" 2>&1
touch "$out/done"
