#!/usr/bin/env bash
# The token cache on the CPU (docs/benchmarks.md, "Token cache"): writes 2 GiB of generated text in 64 files to
# /tmp/tokcache-corpus (kept for a rerun), tokenizes it with the byte tokenizer into an empty cache folder
# OUT/cache, starts again from that cache, and reads 200 sequences of 64K tokens after each start; one JSON line
# per start in OUT/token-cache-cpu.txt, all of it in OUT/result.json. The cache (8 GiB) stays in OUT/cache.
# From the repository's root (PYTHON=... picks the interpreter: docs/bench/lib.sh):
#   bash docs/bench/token-cache-cpu.sh OUT
source "$(dirname "$0")/lib.sh"
out=${1:?usage: bash docs/bench/token-cache-cpu.sh OUT}; mkdir -p "$out"
{ echo "# commit $(git rev-parse --short HEAD), $(date -u +%F), $(nproc) CPU cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM"
  nice -n 10 "$python" -m lightning_oomb.bench.token_cache --corpus /tmp/tokcache-corpus --cache_dir "$out/cache" \
    --gib 2 --files 64 --seq_len 65536 --samples 200 --out "$out/result.json"
} 2>&1 | tee "$out/token-cache-cpu.txt"
