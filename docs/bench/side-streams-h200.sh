#!/usr/bin/env bash
# How much of the side streams' work hides behind the compute (issue 29), by the profiler's timestamps, on one
# H200 (nvidia-h200 kind): a warm 128K sparse step (Qwen2.5-7B shape, random bf16 weights, budget 64, one
# selection per chunk, bf16 KV-gradients, layer checkpointing) with every page on the host, then with every
# page on the GPU, then with the host's ops and CUDA runtime calls; each report ends with the streams' busy times and the side streams' hidden share and the compute stream's idle gaps. About six
# minutes. Run under setsid and read OUT back in later calls:
#   setsid nohup bash docs/bench/side-streams-h200.sh /root/ss > /root/ss.log 2>&1 < /dev/null &
set -u
out=${1:-/root/ss}
context=${CONTEXT:-128k}
mkdir -p "$out"
common=(--model qwen2.5-7b --context "$context" --budget-pages 64 --selection chunk --grad-dtype bfloat16
        --checkpoint-layers --top 20)
for offload in host gpu; do
    python3 -m lightning_oomb.bench.profile_step "${common[@]}" --offload "$offload" \
        > "$out/profile-$context-$offload.txt" 2>&1
done
# The host's side: which CUDA runtime calls (host waits among them) the host path adds.
python3 -m lightning_oomb.bench.profile_step "${common[@]}" --offload host --ops 30 \
    > "$out/profile-$context-host-ops.txt" 2>&1
# Two chunks of both stages as Chrome traces with the host's side: is a gap of the compute stream a wait for
# the host (the kernel after it launched late) or for another stream?
python3 -u -m lightning_oomb.bench.profile_step "${common[@]}" --offload host --chunks 20:22 \
    --trace "$out/trace-$context-host" > "$out/profile-$context-host-chunks.txt" 2>&1
touch "$out/done"
