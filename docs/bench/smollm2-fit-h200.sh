#!/usr/bin/env bash
# A small model's step as a user runs it: `lightning-oomb fit` on examples/smollm2-passkey-64k.yaml (bf16-mixed,
# AdamW, 64K tokens) with random weights of SmolLM2-135M's shape and the byte tokenizer written to MODEL_DIR
# (the step's speed does not depend on the weights), STEPS steps without validation, in the YAML's chunks of
# 16384 and then in chunks of 4096. Each run's step times come from its TensorBoard `train/tokens_per_s` (the
# batch's tokens over the batch's wall time, optimizer included); the plan printed at fit start is in its log.
# GPU and host memory are sampled every 5 s into OUT/monitor.txt.
#   bash docs/bench/smollm2-fit-h200.sh OUT [MODEL_DIR] [STEPS]
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
out=${1:?OUT}; model=${2:-/root/smollm2-random}; steps=${3:-12}
mkdir -p "$out/runs"
[ -f "$model/config.json" ] || "$python" -c "import sys; from pathlib import Path
from lightning_oomb.bench.cli_route import make_model, write_byte_tokenizer
from lightning_oomb.core.model_shape import load_config_dict
target = Path(sys.argv[1])
print(f'random smollm2-135m weights written in {make_model(\"smollm2-135m\", target):.1f} s')
write_byte_tokenizer(target, load_config_dict('smollm2-135m')['vocab_size'])" "$model"
( while sleep 5; do echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)" \
    "host used GiB $(free -g | awk '/Mem:/ {print $3}')"; done ) > "$out/monitor.txt" 2>&1 &
kill_at_exit $!
for chunk in 16384 4096; do
  logged "$out/fit-chunk$chunk.log" "$python" -m lightning_oomb.cli fit --config examples/smollm2-passkey-64k.yaml \
    --model.pretrained "$model" --model.gguf_file null --trainer.max_steps "$steps" --trainer.max_time null \
    --trainer.limit_val_batches 0 --trainer.callbacks '[]' --export false \
    --trainer.strategy.init_args.chunk_size "$chunk" \
    --trainer.logger.init_args.save_dir "$out/runs" --trainer.logger.init_args.name "chunk$chunk"
done
"$python" - "$out/runs" <<'EOF' | tee "$out/summary.txt"
import statistics, sys
from pathlib import Path
from lightning_oomb.bench.scalars import read_scalars
for run in sorted(Path(sys.argv[1]).iterdir()):
    points = read_scalars(run).get("train/tokens_per_s", [])
    seconds = [65536 / p.value for p in sorted(points, key=lambda p: p.step)]
    steady = seconds[2:] or seconds
    print(f"{run.name}: {len(seconds)} steps, median {statistics.median(steady):.3f} s from step 3 on, "
          f"all: {', '.join(f'{s:.2f}' for s in seconds)}")
EOF
touch "$out/done"
