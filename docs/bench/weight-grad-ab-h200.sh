#!/usr/bin/env bash
# Layer checkpointing and the in-place weight-gradient matmul (kernels/linear.py), before and after: stage 2 of
# two chunks of a 256K sparse step (Qwen2.5-7B shape, random bf16 weights, budget 64 pages of 128, one selection
# per chunk, bf16 KV-gradients, every layer checkpointed) under the profiler, once as the code is and once with
# every dW returned to autograd (what checkpointed layers got before: the saved weight was the checkpoint's
# detached alias, whose .grad is None), in one lease.
#   bash docs/bench/weight-grad-ab-h200.sh OUT
set -u
out=${1:-/root/wg}
mkdir -p "$out"
args=(--model qwen2.5-7b --context 262144 --budget-pages 64 --selection chunk --grad-dtype bfloat16
      --checkpoint-layers --offload gpu --chunks 40:42 --top 30 --timeline-bin 16)
python3 -u -m lightning_oomb.bench.profile_step "${args[@]}" > "$out/in-place.txt" 2>&1
python3 -u -c "
import runpy, sys
import lightning_oomb.kernels.linear as linear
linear._adds_in_place = lambda weight: False
sys.argv = ['profile_step'] + sys.argv[1:]
runpy.run_module('lightning_oomb.bench.profile_step', run_name='__main__')
" "${args[@]}" > "$out/through-autograd.txt" 2>&1
touch "$out/done"
