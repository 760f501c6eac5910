#!/usr/bin/env bash
# Context extension of SmolLM2-135M-Instruct from 8K to 64K (examples/smollm2-passkey-64k.yaml) on one H200,
# all runs at once on the one GPU: the pretrained model's held-out accuracy ("before"), then 3 seeds each of
# the exact run at 64K ("exact"), the same without gradients across chunk borders ("nocross") and training at
# 8K only ("short8k"), each stopped after MINUTES of training; then the first exact run's export at 128K and 256K
# ("longer"), and the summary (lightning_oomb/bench/context_extension.py) in OUT/summary.
#   [SEEDS="0 1 2"] bash docs/bench/context-extension-h200.sh MODEL_DIR OUT [MINUTES] [extra lightning-oomb options...]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
model=${1:?MODEL_DIR}; out=${2:?OUT}; minutes=${3:-10}; shift 3 || shift $#
yaml=examples/smollm2-passkey-64k.yaml
mkdir -p "$out/runs"
export OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
seeds=${SEEDS:-0 1 2}; first=${seeds%% *}
common=(--config "$yaml" --model.pretrained "$model" --trainer.logger.init_args.save_dir "$out/runs")
# launch NAME ARGS...: `lightning-oomb ARGS` in the background, its output in OUT/NAME.log; runs=(name:pid ...).
runs=()
launch() { local name=$1; shift; "$python" -m lightning_oomb.cli "$@" > "$out/$name.log" 2>&1 & runs+=("$name:$!"); kill_at_exit $!; }
(free -g; nvidia-smi --query-gpu=name,memory.total --format=csv) > "$out/machine.txt" 2>&1
launch before validate "${common[@]}" --trainer.logger.init_args.name before "$@"
for seed in $seeds; do
  run=("${common[@]}" --seed_everything "$seed" --data.init_args.seed "$seed" --trainer.max_time "$(printf "00:00:%02d:00" "$minutes")")
  launch "exact-$seed" fit "${run[@]}" --trainer.logger.init_args.name "exact-$seed" \
    --export_dir "$out/export-exact-$seed" "$@"
  launch "nocross-$seed" fit "${run[@]}" --trainer.logger.init_args.name "nocross-$seed" \
    --trainer.strategy.init_args.cross_chunk_gradients false --export false "$@"
  launch "short8k-$seed" fit "${run[@]}" --trainer.logger.init_args.name "short8k-$seed" \
    --data.init_args.seq_len 8192 --export false "$@"
done
( while sleep 30; do date +%T; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; free -g | sed -n 2p; done ) > "$out/monitor.txt" 2>&1 &
kill_at_exit $!
for run in "${runs[@]}"; do waited "${run#*:}" "$out/${run%%:*}.log"; done
logged "$out/longer.log" "$python" -m lightning_oomb.cli validate --config "$yaml" --model.pretrained "$out/export-exact-$first" \
  --model.gguf_file null --model.config_overrides null --trainer.logger.init_args.save_dir "$out/runs" \
  --trainer.logger.init_args.name longer --data.init_args.val_lengths "${LONGER:-[131072,262144]}" \
  --data.init_args.val_size "${LONGER_SIZE:-20}" "$@"
logged "$out/summary.log" "$python" -m lightning_oomb.bench.context_extension "$out/runs" --out "$out/summary"
touch "$out/done"
