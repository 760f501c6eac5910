#!/usr/bin/env bash
# Prefill and decoding speed of lightning_oomb.generate for the Qwen2.5-7B shape (random bf16 weights) on one
# GPU, against the plan (docs/planner.md, "Generation"): 16 new tokens after a random prompt of 128K tokens,
# dense and sparse (64 pages per query tile), with transformers' own cached greedy decoding beside them; then
# 1M tokens, sparse, and with DENSE_1M=1 dense and transformers too (a dense 1M prefill is planned at about
# 8 minutes). Run it under setsid and read OUT/*/results.md back (device README).
#   [DENSE_1M=1] bash docs/bench/generate-speed-h200.sh OUT
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:?OUT}
mkdir -p "$out"
speed=("$python" -m lightning_oomb.bench.generate_speed --model qwen2.5-7b --new-tokens 16 --budget-pages 64)
logged "$out/128k.log" "${speed[@]}" --lengths 128K --modes dense,sparse --transformers --out "$out/128k"
if [ "${DENSE_1M:-0}" = 1 ]; then
  logged "$out/1m.log" "${speed[@]}" --lengths 1M --modes sparse,dense --transformers --out "$out/1m"
else
  logged "$out/1m.log" "${speed[@]}" --lengths 1M --modes sparse --out "$out/1m"
fi
touch "$out/done"
