#!/usr/bin/env bash
# Sparse steps with K/V pages in host memory (issue 29), on one H200 (nvidia-h200 kind), through the bench:
# Qwen2.5-7B shape, random bf16 weights, budget 64 pages of 128, bf16 KV-gradients, layer checkpointing.
#   1. one selection per chunk (--selection chunk), every page on the GPU (mode sparse) at 64K (the kernels
#      compile there) and 256K: the step without gathers;
#   2. the same with every page on the host (mode sparse-offload) at 256K and 768K: the GPU's growth per +10K
#      tokens, the pages gathered, the gathers' time on the compute stream (stage 1) and on the side stream
#      (stage 2, ahead of their calls), and against 1. how much of it the step time shows;
#   3. one selection per query tile (--selection tile) at 256K, every page on the host: an unbounded union.
# 1M does not fit with every page on the host within the machine's 112 GiB budget.
# Every point is one step, timed cold (no warm-up step: the CSV's pin_s is the share spent page-locking host
# memory), so the whole fits one lease next to other work (8 minutes at 8676b3d). Run it under setsid and read
# $OUT/*/results.csv back (device README).
#   bash docs/bench/host-kv-h200.sh OUT
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/hostkv}
mkdir -p "$out"
common=(--model qwen2.5-7b --budget-pages 64 --grad-dtype bfloat16 --checkpoint-layers --repeats 1 --warmup 0)
"$python" -m lightning_oomb.cli bench "${common[@]}" --modes sparse --lengths 64K,256K --selection chunk --out "$out/gpu"
"$python" -m lightning_oomb.cli bench "${common[@]}" --modes sparse-offload --lengths 256K,768K --selection chunk \
    --out "$out/chunk"
"$python" -m lightning_oomb.cli bench "${common[@]}" --modes sparse-offload --lengths 256K --selection tile \
    --out "$out/tile"
touch "$out/done"
