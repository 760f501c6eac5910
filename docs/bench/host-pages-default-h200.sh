#!/usr/bin/env bash
# Host-page steps as a user gets them by default (offload="host"), against the same step with every page on
# the GPU, on one H200 (nvidia-h200 kind), through the bench: Qwen2.5-7B shape, random bf16 weights, bf16
# KV-gradients, layer checkpointing, no optimizer.
#   1. sparse, budget 64 pages of 128, one selection per chunk, every page on the GPU (mode sparse) at 64K
#      (the kernels compile there) and 512K: the step without gathers;
#   2. sparse-offload with --selection left at auto (per chunk, offload="host"'s default) at 256K and 512K: the
#      GPU's growth per +10K tokens (target <= 2 MB) and the step time against 1. at 512K, less pin_s
#      (target <= 1.3x; pin_s, the page-locking of host memory, reported apart: target <= 15 s for ~100 GiB);
#   3. dense at 128K, every page on the GPU (mode oomb) and streamed from the host (mode offload), one warm-up
#      step each: the ratio of their step times (target <= 1.15x).
# Sparse points are one cold step each, as in host-kv-h200.sh. Run it under setsid and read $OUT/*/results.csv
# back (device README).
#   bash docs/bench/host-pages-default-h200.sh OUT
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/hostpages}
mkdir -p "$out"
sparse=(--model qwen2.5-7b --budget-pages 64 --grad-dtype bfloat16 --checkpoint-layers --repeats 1 --warmup 0)
"$python" -m lightning_oomb.cli bench "${sparse[@]}" --modes sparse --lengths 64K,512K --selection chunk --out "$out/gpu"
"$python" -m lightning_oomb.cli bench "${sparse[@]}" --modes sparse-offload --lengths 256K,512K --out "$out/host"
"$python" -m lightning_oomb.cli bench --model qwen2.5-7b --grad-dtype bfloat16 --checkpoint-layers --modes oomb,offload \
    --lengths 128K --repeats 1 --warmup 1 --out "$out/dense"
touch "$out/done"
