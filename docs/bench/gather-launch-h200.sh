#!/usr/bin/env bash
# How the persistent programs of stage 2's host K/V gathers (kernels.host_pages.GATHER_AHEAD_PROGRAMS) change
# a sparse step with every page on the host (issue 29: how much of the side stream's copying hides behind the
# compute), on one H200 (nvidia-h200 kind): Qwen2.5-7B shape, random bf16 weights, budget 64, one selection per
# chunk, bf16 KV-gradients, layer checkpointing, 128K tokens, one warm-up and one timed step per run. First the
# step with every page on the GPU (no gathers), then every page on the host with one program per page (the
# launch before persistent programs), 64 and 16 programs. Run under setsid; read OUT back in later calls:
#   setsid nohup bash docs/bench/gather-launch-h200.sh /root/gl > /root/gl.log 2>&1 < /dev/null &
set -u
out=${1:-/root/gl}
mkdir -p "$out"
common=(--model qwen2.5-7b --lengths 128K --budget-pages 64 --selection chunk --grad-dtype bfloat16
        --checkpoint-layers --repeats 1 --warmup 1)
python3 -m lightning_oomb.cli bench "${common[@]}" --modes sparse --out "$out/gpu" > "$out/gpu.log" 2>&1
for programs in 1048576 64 16; do
    python3 -m lightning_oomb.cli bench "${common[@]}" --modes sparse-offload --gather-programs $programs \
        --out "$out/host-$programs" > "$out/host-$programs.log" 2>&1
done
touch "$out/done"
