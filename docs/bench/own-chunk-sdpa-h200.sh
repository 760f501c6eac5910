#!/usr/bin/env bash
# The chunk's own keys (past 0; the Gluon past kernels take no part) and a 32K past: our attention kernels
# against SDPA's flash and cuDNN backends on the same causal lengths; then the GPU strategies' test.
#   bash docs/bench/own-chunk-sdpa-h200.sh OUT
set -u
out=${1:?usage: own-chunk-sdpa-h200.sh OUT}
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -m lightning_oomb.bench.kernels --pasts 0,32768 --sdpa-backend cudnn --out "$out/kernels-cudnn.csv" \
    > "$out/kernels-cudnn.txt" 2>&1
python -m lightning_oomb.bench.kernels --pasts 0 --out "$out/kernels-flash.csv" > "$out/kernels-flash.txt" 2>&1
python -m pytest -q -m gpu tests/test_gpu_strategies.py > "$out/gpu-strategies.txt" 2>&1
echo done > "$out/done"
