#!/usr/bin/env bash
# Where a packed dense step's time goes (issue 31: 1M tokens of 32K documents took 1.40x 32 separate 32K steps,
# docs/benchmarks.md "Packed documents"), on one H200 (nvidia-h200 kind): the profile of a 128K dense step,
# unpacked and packed from 32K-token documents, every chunk's attention recomputed in stage 2 in both (no
# outputs or graphs kept), so that the kernel groups compare one for one; about 3 minutes.
#   bash docs/bench/packed-profile-h200.sh OUT
set -u
out=${1:-/root/packed-profile}
mkdir -p "$out"
common=(--model qwen2.5-7b --context 128k --keep-attention 0 --keep-graphs 0 --top 30)
python3 -m lightning_oomb.bench.profile_step "${common[@]}" > "$out/unpacked.txt" 2>&1
python3 -m lightning_oomb.bench.profile_step "${common[@]}" --document-length 32k > "$out/packed.txt" 2>&1
touch "$out/done"
