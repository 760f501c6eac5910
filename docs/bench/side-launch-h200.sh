#!/usr/bin/env bash
# Follow-up of gather-launch-h200.sh (issue 29: how much of the side streams' copying hides behind compute):
# fewer programs for the gathers ahead (8) and for the host gradient additions (16 and 8 persistent programs
# instead of ADD_LAUNCH's 64), each against the same step with every page on the GPU, 128K tokens, one warm-up
# and one timed step per run, on one H200 (nvidia-h200 kind); about 6 minutes. Under setsid:
#   setsid nohup bash docs/bench/side-launch-h200.sh /root/sl > /root/sl.log 2>&1 < /dev/null &
set -u
out=${1:-/root/sl}
mkdir -p "$out"
common=(--model qwen2.5-7b --lengths 128K --budget-pages 64 --selection chunk --grad-dtype bfloat16
        --checkpoint-layers --repeats 1 --warmup 1)
python3 -m lightning_oomb.cli bench "${common[@]}" --modes sparse --out "$out/gpu" > "$out/gpu.log" 2>&1
for launch in 16:64x32x4 8:64x32x4 16:16x32x4 16:8x32x4; do
    python3 -m lightning_oomb.cli bench "${common[@]}" --modes sparse-offload --gather-programs "${launch%%:*}" \
        --add-launch "${launch#*:}" --out "$out/host-${launch/:/-}" > "$out/host-${launch/:/-}.log" 2>&1
done
touch "$out/done"
