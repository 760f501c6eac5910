#!/usr/bin/env bash
# Issue 29's GPU measurements in one lease of one H200 (nvidia-h200 kind), in order of what they settle:
# host K/V pages (host-kv-h200.sh), the longest full-training and LoRA steps (longest-context-h200.sh), then the
# GPU tests of host K/V pages. Host memory sampled every 5 s into OUT/free.log (a kill by the kernel's OOM
# killer leaves no traceback). Start it under setsid and read OUT back in later calls (device README):
#   setsid nohup bash docs/bench/issue29-h200.sh /root/i29 > /root/i29.log 2>&1 < /dev/null &
set -u
out=${1:-/root/i29}
mkdir -p "$out"
(while true; do echo "$(date +%s) $(free -m | awk '/Mem:/ {print $3, $7}')"; sleep 5; done) > "$out/free.log" &
sampler=$!
bash docs/bench/host-kv-h200.sh "$out/hostkv" > "$out/hostkv.log" 2>&1
bash docs/bench/longest-context-h200.sh "$out/longest" > "$out/longest.log" 2>&1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_host_kv.py > "$out/gpu-tests.log" 2>&1
echo "gpu tests: rc $?" >> "$out/gpu-tests.log"
kill $sampler
touch "$out/done"
