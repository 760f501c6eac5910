#!/usr/bin/env bash
# Packed documents (issue 31) and warm host K/V points (issue 29) in one lease of one H200 (nvidia-h200 kind).
# Qwen2.5-7B shape, random bf16 weights, bf16 KV-gradients. Host memory sampled every 5 s into OUT/free.log.
#   1. dense LoRA rank 16 with layer checkpointing: 32K unpacked (3 warm steps: x 32 is "32 separate 32K steps"),
#      then 64K and 1M packed from 32K documents in one process (the 64K step compiles and tunes the kernels
#      with documents, so the 1M step is timed without a warm-up, which would cost 3 more minutes);
#   2. sparse full training, budget 64: 32K unpacked (3 warm steps), then 64K and 1M packed the same way;
#   3. issue 29: one selection per chunk at 256K with every page on the GPU (sparse) and every page on the host
#      (sparse-offload), one warm-up and one timed step each: the gathers' and gradient additions' busy time
#      on the side streams against the step time they add.
# Run it under setsid and read OUT back in later calls (device README):
#   setsid nohup bash docs/bench/issue31-h200.sh /root/i31 > /root/i31.log 2>&1 < /dev/null &
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/i31}
mkdir -p "$out"
(while true; do echo "$(date +%s) $(free -m | awk '/Mem:/ {print $3, $7}')"; sleep 5; done) > "$out/free.log" &
kill_at_exit $!
bench() { "$python" -m lightning_oomb.cli bench --model qwen2.5-7b --grad-dtype bfloat16 "$@"; }
lora=(--modes oomb --lora-rank 16 --checkpoint-layers)
logged "$out/lora-32k.log" bench "${lora[@]}" --lengths 32K --repeats 3 --warmup 1 --out "$out/lora-32k"
logged "$out/lora-packed.log" bench "${lora[@]}" --lengths 64K,1M --document-length 32K --repeats 1 --warmup 0 \
    --out "$out/lora-packed"
logged "$out/sparse-32k.log" bench --modes sparse --lengths 32K --repeats 3 --warmup 1 --out "$out/sparse-32k"
logged "$out/sparse-packed.log" bench --modes sparse --lengths 64K,1M --document-length 32K --repeats 1 --warmup 0 \
    --out "$out/sparse-packed"
hostkv=(--lengths 256K --budget-pages 64 --selection chunk --checkpoint-layers --repeats 1 --warmup 1)
logged "$out/hostkv-gpu.log" bench "${hostkv[@]}" --modes sparse --out "$out/hostkv-gpu"
logged "$out/hostkv-host.log" bench "${hostkv[@]}" --modes sparse-offload --out "$out/hostkv-host"
touch "$out/done"
