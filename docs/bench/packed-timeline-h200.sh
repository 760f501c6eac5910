#!/usr/bin/env bash
# Which chunks of a long packed dense step are slow (issue 31's open gap: 1M tokens of 30,000-token documents,
# whose starts fall mid-page, took 1.16x the step of 32K-token documents with fewer FLOPs; docs/benchmarks.md,
# "Packed documents"), on one H200 (nvidia-h200 kind), about 7 minutes (planned 96 s a step): a 512K full-training step, bf16
# KV-gradients, every chunk's attention recomputed in stage 2, for each document length DOC given (default
# 32k 30000), with the seconds of every chunk of both stages (the timeline) and the kernels of chunks
# 116-124 under torch's profiler: with 30,000-token documents chunks 117 and 124 hold a border (their first
# document's past runs in the portable Triton kernels) and 118-123 belong to one document that starts
# mid-page (one extra Triton call per kernel for its first partial page).
#   setsid nohup bash docs/bench/packed-timeline-h200.sh OUT [DOC ...] > OUT.log 2>&1 < /dev/null &
set -u
out=${1:-/root/packed-timeline}
shift || true
[ $# -eq 0 ] && set -- 32k 30000
mkdir -p "$out"
for doc in "$@"; do
  python3 -m lightning_oomb.bench.profile_step --model qwen2.5-7b --context 512k --grad-dtype bfloat16 \
      --keep-attention 0 --keep-graphs 0 --top 20 --document-length "$doc" --chunks 116:125 --timeline-bin 16 \
      > "$out/packed-$doc.txt" 2>&1
done
touch "$out/done"
