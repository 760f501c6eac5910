#!/usr/bin/env bash
# Sparse steps with K/V pages in host memory (issue 29), on one H200 (nvidia-h200 kind), through the bench:
# Qwen2.5-7B shape, random bf16 weights, budget 64 pages of 128, bf16 KV-gradients, layer checkpointing,
# offload "host" (every layer's K/V and KV-gradient pages pinned on the host: `sparse-offload`).
#   1. one selection per chunk (--selection chunk) at 256K, 512K, 768K: the GPU's growth per +10K tokens, the
#      pages gathered, step time against the plan (planned 53 s and 107 s at 256K and 512K);
#   2. one selection per query tile (the default) at 256K: what an unbounded union costs (planned 87 s, most of
#      it the gathers at an assumed 50 GB/s).
# 1M does not fit with every page on the host within the machine's 112 GiB budget (116 GiB planned).
# The Triton kernels compile in an untimed 64K point; every other point is one step, timed cold (no warm-up step),
# so the whole fits one lease next to other work (about 12 minutes). Run it under setsid and read
# $OUT/*/results.csv back (device README).
#   bash docs/bench/host-kv-h200.sh OUT
set -u
out=${1:-/root/hostkv}
mkdir -p "$out"
common=(--model qwen2.5-7b --modes sparse-offload --budget-pages 64 --grad-dtype bfloat16 --checkpoint-layers
        --repeats 1 --warmup 0)
python3 -m lightning_oomb.cli bench "${common[@]}" --lengths 64K,256K,512K,768K --selection chunk --out "$out/chunk"
python3 -m lightning_oomb.cli bench "${common[@]}" --lengths 256K --out "$out/tile"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_host_kv.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests: rc $?" >> "$out/gpu-tests.log"
touch "$out/done"
