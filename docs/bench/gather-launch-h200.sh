#!/usr/bin/env bash
# How the side streams' launches change a sparse step with every page on the host (issue 29: how much of the
# side streams' copying hides behind the compute), on one H200 (nvidia-h200 kind): Qwen2.5-7B shape, random
# bf16 weights, budget 64, one selection per chunk, bf16 KV-gradients, layer checkpointing, 128K tokens, one
# warm-up and REPEATS timed steps per run (default 1; about a minute each, the median reported). First the step with every page on the GPU (no
# gathers), then every page on the host for each GATHER:ADD launch given: GATHER persistent programs for the
# gathers ahead of their calls (bench --gather-programs; 1048576: one per page, the launch before), ADD the host
# gradient additions' PROGRAMSxROWSxWARPS (bench --add-launch). The default list is the run of 4aa457d in
# docs/benchmarks.md. Run under setsid and read OUT back in later calls:
#   setsid nohup bash docs/bench/gather-launch-h200.sh /root/gl [GATHER:ADD ...] > /root/gl.log 2>&1 < /dev/null &
set -u
out=${1:-/root/gl}
shift || true
launches=("${@:-1048576:64x32x4 64:64x32x4 16:64x32x4}")
mkdir -p "$out"
common=(--model qwen2.5-7b --lengths 128K --budget-pages 64 --selection chunk --grad-dtype bfloat16
        --checkpoint-layers --repeats "${REPEATS:-1}" --warmup 1)
python3 -m lightning_oomb.cli bench "${common[@]}" --modes sparse --out "$out/gpu" > "$out/gpu.log" 2>&1
for launch in ${launches[@]}; do
    name="host-${launch/:/-}"
    python3 -m lightning_oomb.cli bench "${common[@]}" --modes sparse-offload --gather-programs "${launch%%:*}" \
        --add-launch "${launch#*:}" --out "$out/$name" > "$out/$name.log" 2>&1
done
touch "$out/done"
