#!/usr/bin/env bash
# The route a user takes, on one H200 (nvidia-h200 kind): random Qwen2.5-7B weights written to a local
# directory, then `lightning-oomb fit` on each GPU example YAML for 3 steps with a checkpoint at step 2: the
# LoRA and 128K YAMLs resumed from it for the third step again, then train_step + AdamW in the same process
# for the ratio. The 1M sparse YAML runs first (its checkpoint only when the disk holds it), so a lease that ends
# early still has the headline.
# Results: docs/benchmarks.md, "The CLI route".
#   bash docs/bench/cli-route-h200.sh WORKDIR MODEL_DIR
set -u
work=${1:-/root/job}
model=${2:-/root/qwen2.5-7b}
mkdir -p "$work"
route() { python3 -m lightning_oomb.bench.cli_route --model-dir "$model" --steps 3 --delete-checkpoints "$@"; }
[ -f "$model/config.json" ] || python3 -c "import sys; from pathlib import Path
from lightning_oomb.bench.cli_route import make_model
print(f'random qwen2.5-7b weights written in {make_model(\"qwen2.5-7b\", Path(sys.argv[1])):.1f} s')" "$model"
free_gb=$(df --output=avail -B1G "$work" | tail -1)
every=2; [ "$free_gb" -lt 50 ] && every=0  # a 7B AdamW checkpoint is 46 GB
echo "disk free ${free_gb} GB: 1M checkpoint every ${every}"
route --config examples/qwen2.5-7b-1m-sparse.yaml --checkpoint-every "$every" --out "$work/1m"
route --config examples/lora.yaml --checkpoint-every 2 --resume --baseline --out "$work/lora"
route --config examples/qwen2.5-7b-128k.yaml --checkpoint-every 2 --resume --baseline --out "$work/128k"
touch "$work/done"
