#!/usr/bin/env bash
# The optimizer choices on one H200 (nvidia-h200 kind): the GPU optimizer tests (the compiled Kahan step), the
# learning-quality benchmark on the GPU, then in the background (setsid; poll OUT/fit/done) the planner's longest
# full-training sparse context with OPTIMIZER's state (default adamw8bit) through `lightning-oomb fit`
# (docs/bench/longest-fit-h200.sh) from a copy of this tree, so that a later device call may replace the tree.
#   [OPTIMIZER=adamw8bit] bash docs/bench/optimizers-h200.sh OUT [MODEL_DIR]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:?OUT}
model=${2:-/root/qwen2.5-7b}
mkdir -p "$out"
logged "$out/gpu.txt" nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv
logged "$out/gpu-tests.txt" "$python" -m pytest -q -p no:cacheprovider tests/test_optimizers.py -m gpu
logged "$out/learning-gpu.log" "$python" -m lightning_oomb.bench.learning --accelerator gpu --out "$out/learning-gpu"
copy=/root/oomb-tree
rm -rf "$copy" && cp -r . "$copy"
cd "$copy" && setsid nohup env OPTIMIZER="${OPTIMIZER:-adamw8bit}" bash docs/bench/longest-fit-h200.sh "$out/fit" "$model" 2 \
  > "$out/fit.log" 2>&1 < /dev/null &
echo "the longest fit runs on in the background: $out/fit.log, done when $out/fit/done exists"
