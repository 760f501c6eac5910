#!/usr/bin/env bash
# RULER's offline tasks on the real SmolLM2-135M-Instruct (8K native context), pretrained and context-extended,
# from 4K to 1M tokens on one GPU, each prompt in the model's chat template, SAMPLES prompts per task and length:
#   pretrained   the GGUF model with the RoPE the extension trains with (YaRN factor 8 over the native 8K) and
#                max_position_embeddings raised to 1M, untrained;
#   exact-64k    examples/smollm2-passkey-64k.yaml fine-tuned for MINUTES (its LongContextEvalCallback logs the
#                8K/32K/64K grid at each validation: OUT/passkey-grids.png), exported;
#   extended     that export, its RoPE as trained, max_position_embeddings raised to 1M.
# Each model: `lightning-oomb evaluate` at 4K, 16K and 64K densely, then at 256K and 1M with sparse attention (64
# pages of 128 per query tile): OUT/ruler-<model>-{dense,sparse}/results.json and heatmap.png; GPU and host
# memory sampled every 10 s in OUT/monitor.txt. Run it under setsid and read OUT back (device README).
#   bash docs/bench/ruler-smollm2-h200.sh MODEL_DIR OUT [MINUTES]
# MODEL_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf (examples/smollm2-passkey-64k.yaml's header says how to get
# it). TASKS=a,b,... and SAMPLES=N change the grid (default six tasks, 4 samples), DENSE_LENGTHS and SPARSE_LENGTHS
# its lengths (default 4K,16K,64K and 256K,1M); GRIDS=a,b,... runs only some of pretrained-dense,
# pretrained-sparse, extended-dense, extended-sparse (the fine-tuning runs when an extended one is named).
# STEPS=N stops the fine-tuning at N optimizer steps instead of after MINUTES (then only a bound: 15 minutes) and
# validates at step N; CALLBACK_GRIDS=0 leaves the YAML's LongContextEvalCallback out of it (its two grids take
# about 6 of the stage's 8 minutes on an H100; no passkey-grids.png then).
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
model=${1:?MODEL_DIR}; out=${2:?OUT}; minutes=${3:-4}
gguf=SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f "$model/$gguf" ]] || { echo "$0: no $gguf in $model" >&2; exit 2; }
tasks=${TASKS:-niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,vt,fwe}
samples=${SAMPLES:-4}
grids=,${GRIDS:-pretrained-dense,pretrained-sparse,extended-dense,extended-sparse},
for g in ${grids//,/ }; do
  [[ $g =~ ^(pretrained|extended)-(dense|sparse)$ ]] || { echo "$0: GRIDS: unknown grid $g" >&2; exit 2; }
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(free -g; nvidia-smi --query-gpu=name,memory.total --format=csv || echo "no nvidia-smi") > "$out/machine.txt" 2>&1
( while sleep 10; do echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)" \
    "host used GiB $(free -g | awk '/Mem:/ {print $3}')"; done ) > "$out/monitor.txt" 2>&1 &
kill_at_exit $!
yarn8='{"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 100000.0,
        "original_max_position_embeddings": 8192}, "max_position_embeddings": 1048576}'
grid() {  # NAME MODEL_ARGS...: the dense and the sparse grid of one model, as GRIDS names them
  local name=$1; shift
  local common=(-m lightning_oomb.cli evaluate "$@" --tasks "$tasks" --samples "$samples" --apply-chat-template)
  if [[ $grids == *,$name-dense,* ]]; then
    logged "$out/ruler-$name-dense.log" "$python" "${common[@]}" --lengths "${DENSE_LENGTHS:-4K,16K,64K}" \
      --out "$out/ruler-$name-dense"
  fi
  if [[ $grids == *,$name-sparse,* ]]; then
    logged "$out/ruler-$name-sparse.log" "$python" "${common[@]}" --lengths "${SPARSE_LENGTHS:-256K,1M}" \
      --budget-pages 64 --out "$out/ruler-$name-sparse"
  fi
}
grid pretrained --model "$model" --gguf-file "$gguf" --config-overrides "$yarn8"
[[ $grids == *,extended-* ]] || { touch "$out/done"; exit 0; }
fit_args=()
[[ -z ${STEPS:-} ]] || { minutes=15; fit_args+=(--trainer.max_steps "$STEPS" --trainer.val_check_interval "$STEPS"); }
[[ ${CALLBACK_GRIDS:-1} != 0 ]] || fit_args+=(--trainer.callbacks "[]")
logged "$out/exact-64k.log" "$python" -m lightning_oomb.cli fit --config examples/smollm2-passkey-64k.yaml \
  --model.pretrained "$model" --trainer.logger.init_args.save_dir "$out/runs" \
  --trainer.max_time "$(printf "00:00:%02d:00" "$minutes")" --export_dir "$out/export-64k" "${fit_args[@]}"
if [[ ${CALLBACK_GRIDS:-1} != 0 ]]; then
  "$python" -m lightning_oomb.bench.eval_grids "$out/runs" --out "$out/passkey-grids.png" | tee "$out/passkey-grids.txt"
fi
grid extended --model "$out/export-64k" --config-overrides '{"max_position_embeddings": 1048576}'
touch "$out/done"
