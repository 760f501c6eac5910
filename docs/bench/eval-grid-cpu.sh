#!/usr/bin/env bash
# The CPU corpus demo (examples/corpus_cpu.yaml) with a LongContextEvalCallback, as its header says: RULER's offline
# tasks at 1K, 2K and 4K bytes before the first step and after the last, and the two grids side by side in PNG (default
# OUT/grids.png; docs/eval-grid-cpu.png is this script's). From the repository's root (PYTHON=... picks the
# interpreter: docs/bench/lib.sh):
#   bash docs/bench/eval-grid-cpu.sh OUT [PNG]
source "$(dirname "$0")/lib.sh"
out=${1:?usage: bash docs/bench/eval-grid-cpu.sh OUT [PNG]}; png=${2:-$out/grids.png}; mkdir -p "$out"
nproc > "$out/machine.txt"; lscpu | grep -i "model name" >> "$out/machine.txt" || true
echo "training examples/corpus_cpu.yaml with its grid at steps 0 and 60, log $out/fit.log"
SECONDS=0
logged "$out/fit.log" "$python" -m lightning_oomb.cli fit --config examples/corpus_cpu.yaml \
  --trainer.callbacks+=lightning_oomb.LongContextEvalCallback --trainer.callbacks.lengths '[1024,2048,4096]' \
  --trainer.callbacks.at_start true --trainer.callbacks.every_n_steps 60 \
  --trainer.logger.init_args.save_dir "$out/runs" --trainer.enable_progress_bar false --export false
echo "fit took $SECONDS s" | tee -a "$out/machine.txt"
"$python" -m lightning_oomb.bench.eval_grids "$out/runs/corpus_cpu/main" --out "$png" | tee "$out/grids.txt"
