#!/usr/bin/env bash
# Where a packed dense step's time goes (issue 31), on one H200 (nvidia-h200 kind): the profile of a 128K dense
# step, unpacked and then packed from documents of each DOC tokens given (default 32k), every chunk's attention
# recomputed in stage 2 (no outputs or graphs kept), so that the kernel groups compare one for one; about a
# minute and a half each. 1M tokens of 30,000-token documents (starts mid-page) ran at the portable kernels'
# rate where 32K-token ones did not (docs/benchmarks.md, "Packed documents"): compare `OUT 32k 30000`.
# CONTEXT=256k profiles longer steps (twice the time each); UNPACKED=0 leaves out the unpacked step, whose
# attention grows with the square of the context.
#   [CONTEXT=128k] [UNPACKED=1] bash docs/bench/packed-profile-h200.sh OUT [DOC ...]
set -u
out=${1:-/root/packed-profile}
shift || true
mkdir -p "$out"
common=(--model qwen2.5-7b --context "${CONTEXT:-128k}" --keep-attention 0 --keep-graphs 0 --top 30)
if [ "${UNPACKED:-1}" = 1 ]; then
    python3 -m lightning_oomb.bench.profile_step "${common[@]}" > "$out/unpacked.txt" 2>&1
fi
for doc in "${@:-32k}"; do
    python3 -m lightning_oomb.bench.profile_step "${common[@]}" --document-length "$doc" > "$out/packed-$doc.txt" 2>&1
done
touch "$out/done"
