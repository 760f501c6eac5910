#!/usr/bin/env bash
# The chunk's own keys (past 0; the Gluon past kernels take no part) and a 32K past: our attention kernels
# against SDPA's flash and cuDNN backends on the same causal lengths; then the GPU strategies' test.
#   bash docs/bench/own-chunk-sdpa-h200.sh OUT
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:?usage: own-chunk-sdpa-h200.sh OUT}
mkdir -p "$out"
logged "$out/nvidia-smi.txt" nvidia-smi
logged "$out/kernels-cudnn.txt" "$python" -m lightning_oomb.bench.kernels --pasts 0,32768 --sdpa-backend cudnn \
    --out "$out/kernels-cudnn.csv"
logged "$out/kernels-flash.txt" "$python" -m lightning_oomb.bench.kernels --pasts 0 --out "$out/kernels-flash.csv"
logged "$out/gpu-strategies.txt" "$python" -m pytest -q -m gpu tests/test_gpu_strategies.py
echo done > "$out/done"
