#!/usr/bin/env bash
# Context extension of SmolLM2-135M-Instruct past 64K on one H200, one run at a time (so step times are the
# run's own):
#   exact-64k    examples/smollm2-passkey-64k.yaml for MINUTES of training, exported;
#   64k-longer   that export validated at 128K and 256K tokens (dense attention, its RoPE unchanged);
#   exact-256k   that export fine-tuned at 256K tokens (YaRN factor 32 over the native 8K, dense attention) for
#                MINUTES of training, validated at 64K, 128K and 256K, exported;
#   256k-sparse  that export validated at 256K, 512K and 1M tokens with sparse attention (each query tile of 128
#                tokens attends to 64 pages of 128 tokens of its past, chosen by the query and each page's mean key).
# Held out: VAL_SIZE sequences per length (the same ones for every run). Then the summary
# (lightning_oomb/bench/context_extension.py) in OUT/summary. With GPU_SUITE=1 the GPU tests run beside the
# validation and the 256K run (their step times are then shared ones).
#   bash docs/bench/context-extension-further-h200.sh MODEL_DIR OUT [MINUTES [MINUTES_256K]]
# STAGES="exact-64k exact-256k 256k-sparse" runs only those (exact-64k is needed by the others), and
# EXTRA="--opt value ..." adds overrides to every command (a GPU shared with another run:
# EXTRA="--trainer.strategy.init_args.gpu_memory 50GiB").
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
model=${1:?MODEL_DIR}; out=${2:?OUT}; minutes=${3:-5}; minutes_256k=${4:-$minutes}
stages=" ${STAGES:-exact-64k 64k-longer exact-256k 256k-sparse} "
wants() { [[ $stages == *" $1 "* ]]; }
yaml=examples/smollm2-passkey-64k.yaml
val_size=${VAL_SIZE:-10}
mkdir -p "$out/runs"
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
max_time=$(printf "00:00:%02d:00" "$minutes")
runs=(--trainer.logger.init_args.save_dir "$out/runs")
read -r -a extra <<< "${EXTRA:-}"
runs+=("${extra[@]}")
exported=(--model.gguf_file null --model.config_overrides null)
yarn32='{rope_parameters: {rope_type: yarn, factor: 32.0, rope_theta: 100000.0, original_max_position_embeddings: 8192}, max_position_embeddings: 262144}'
(free -g; nvidia-smi --query-gpu=name,memory.total --format=csv) > "$out/machine.txt" 2>&1
( while sleep 20; do echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)" \
    "host used GiB $(free -g | awk '/Mem:/ {print $3}')"; done ) > "$out/monitor.txt" 2>&1 &
kill_at_exit $!
stage() { echo "$(date +%T) $1" >> "$out/stages.txt"; }

stage exact-64k
wants exact-64k && logged "$out/exact-64k.log" "$python" -m lightning_oomb.cli fit --config "$yaml" --model.pretrained "$model" "${runs[@]}" \
  --trainer.logger.init_args.name exact-64k --trainer.max_time "$max_time" --data.init_args.val_size "$val_size" \
  --export_dir "$out/export-64k"

if [ "${GPU_SUITE:-0}" = 1 ]; then
  ( "$python" -m pytest -q -p no:cacheprovider -m gpu tests/ > "$out/gpu-suite.txt" 2>&1; stage gpu-suite-done ) &
  suite=$!
  kill_at_exit $suite
fi
stage 64k-longer
wants 64k-longer && logged "$out/64k-longer.log" "$python" -m lightning_oomb.cli validate --config "$yaml" --model.pretrained "$out/export-64k" \
  "${exported[@]}" "${runs[@]}" --trainer.logger.init_args.name 64k-longer \
  --data.init_args.val_lengths '[131072, 262144]' --data.init_args.val_size "$val_size"

stage exact-256k
wants exact-256k && logged "$out/exact-256k.log" "$python" -m lightning_oomb.cli fit --config "$yaml" --model.pretrained "$out/export-64k" \
  --model.gguf_file null \
  --model.config_overrides "$yarn32" "${runs[@]}" --trainer.logger.init_args.name exact-256k \
  --trainer.max_time "$(printf "00:00:%02d:00" "$minutes_256k")" --data.init_args.seq_len 262144 \
  --data.init_args.val_lengths '[65536, 131072, 262144]' --data.init_args.val_size "$val_size" \
  --export_dir "$out/export-256k"

stage 256k-sparse
wants 256k-sparse && logged "$out/256k-sparse.log" "$python" -m lightning_oomb.cli validate --config "$yaml" \
  --model.pretrained "$out/export-256k" "${exported[@]}" \
  "${runs[@]}" --trainer.logger.init_args.name 256k-sparse --trainer.strategy.init_args.sparse '{budget_pages: 64}' \
  --data.init_args.val_lengths '[262144, 524288, 1048576]' --data.init_args.val_size "$val_size"

stage summary
[[ -z ${suite:-} ]] || waited "$suite" "$out/gpu-suite.txt"
logged "$out/summary.log" "$python" -m lightning_oomb.bench.context_extension "$out/runs" --out "$out/summary"
stage done
touch "$out/done"
