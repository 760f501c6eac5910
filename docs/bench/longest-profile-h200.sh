#!/usr/bin/env bash
# Where the 1.75M full-parameter step goes (issue 29's "1.3x of the floor" and "80% of the copy time hidden"),
# on one H200 (nvidia-h200 kind): the bench's step at 1,835,008 tokens (Qwen2.5-7B shape, random bf16 weights,
# budget 64, one selection per chunk, bf16 KV-gradients, layer checkpointing, offload "auto"), its chunk
# timeline from CUDA events, and both stages of a few chunk ranges under the profiler (each stream's busy time,
# the side streams' share under the compute stream, the compute stream's idle gaps). First the GPU test of
# host waits (dense, sparse, sparse with every page on the host). Samples `free -m` every 5 s. About 8 minutes:
#   setsid nohup bash docs/bench/longest-profile-h200.sh /root/lp > /root/lp.log 2>&1 < /dev/null &
set -u
out=${1:-/root/lp}
chunks=${CHUNKS:-440:442,300:302,100:102}
mkdir -p "$out"
(while :; do date +%T >> "$out/free.txt"; free -m >> "$out/free.txt"; sleep 5; done) &
sampler=$!
python3 -m pytest -q -m gpu tests/test_gpu_end_to_end.py -k host_waits > "$out/gpu-test-host-waits.log" 2>&1
python3 -u -m lightning_oomb.bench.profile_step --model qwen2.5-7b --context 1835008 --budget-pages 64 \
    --selection chunk --grad-dtype bfloat16 --checkpoint-layers --offload auto --chunks "$chunks" --top 25 \
    --timeline-bin 32 > "$out/profile-1835008.txt" 2>&1
kill "$sampler"
touch "$out/done"
