#!/usr/bin/env bash
# Issue 28's check on one H200: the GPU tests and the 32K/128K dense and sparse bench, the code before the
# redesign (commit 0df88df, unpacked into BEFORE) and after it (this tree), in one call, so both ran on the
# same machine. Prepare BEFORE here, carry it:
#   mkdir -p .before && git archive 0df88df lightning_oomb tests | tar -x -C .before   (.before is git-ignored)
#   bash docs/bench/redesign-before-after-h200.sh .before "$OUT"
set -u
before=${1:-.before}
out=${2:-/tmp/redesign}
mkdir -p "$out"
bench() {  # $1: source root, $2: label
  PYTHONPATH="$1:${PYTHONPATH:-}" python3 -m lightning_oomb.bench.run --model qwen2.5-7b --lengths 32k,128k \
    --modes oomb,sparse --repeats 2 --warmup 1 --out "$out/bench-$2" > "$out/bench-$2.log" 2>&1
  echo "bench $2: rc $?"
}
bench "$before" before
bench "$PWD" after
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_end_to_end.py tests/test_triton_attention.py \
  tests/test_sparse.py tests/test_fused_ops.py tests/test_model_init.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests: rc $?"
tail -3 "$out/gpu-tests.log"
for label in before after; do echo "== $label"; cat "$out/bench-$label"/*.md 2>/dev/null | head -20; done
