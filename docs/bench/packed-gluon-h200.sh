#!/usr/bin/env bash
# Packed documents with the chunks of one document in the Hopper kernels, on one H200 (nvidia-h200 kind), about
# 13 minutes: first the GPU tests of that path (bf16 kernels against the fp32 reference, with and without
# documents; the strategies on one process), then the dense LoRA rank 16 step with layer checkpointing of
# docs/benchmarks.md "Packed documents" (1M tokens of 32K-token documents, after a 64K packed step that compiles
# the kernels; 165.2 s at c58dd48, 32 separate 32K steps 147.0 s), and the same with 30,000-token documents
# (their starts mid-page: 199.4 s at c58dd48, the portable kernels' rate; since then every dense packed chunk
# sees the store from its first key's page, so no dK/dV program is launched for earlier documents' keys).
# Host memory sampled every 5 s into OUT/free.log. TESTS replaces the pytest arguments (the kernels' tests take
# about 3 of the tests' 5 minutes). Run under setsid, read OUT back later:
#   setsid nohup bash docs/bench/packed-gluon-h200.sh /root/pg > /root/pg.log 2>&1 < /dev/null &
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:-/root/pg}
mkdir -p "$out"
(while true; do echo "$(date +%s) $(free -m | awk '/Mem:/ {print $3, $7}')"; sleep 5; done) > "$out/free.log" &
kill_at_exit $!
logged "$out/tests.log" "$python" -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_triton_attention.py \
    tests/test_gpu_strategies.py -k "16_bit_gpu or strategies"}
bench() { "$python" -m lightning_oomb.cli bench --model qwen2.5-7b --grad-dtype bfloat16 --modes oomb --lora-rank 16 \
    --checkpoint-layers --repeats 1 --warmup 0 "$@"; }
logged "$out/lora-packed-30000.log" bench --lengths 64K,1M --document-length 30000 --out "$out/lora-packed-30000"
logged "$out/lora-packed-32k.log" bench --lengths 64K,1M --document-length 32K --out "$out/lora-packed-32k"
touch "$out/done"
