#!/usr/bin/env bash
# The CPU demo (examples/passkey_cpu.yaml) over seeds 0, 1, 2: the exact run and the ablation without gradients
# across chunk borders, two runs at a time on one thread each; each run's held-out line in OUT/<arm>-<seed>.log.
# From the repository's root (PYTHON=... picks the interpreter: docs/bench/lib.sh):
#   bash docs/bench/passkey-cpu-seeds.sh OUT
source "$(dirname "$0")/lib.sh"
out=${1:?usage: bash docs/bench/passkey-cpu-seeds.sh OUT}; mkdir -p "$out"
for seed in 0 1 2; do
  seeds=(--seed_everything "$seed" --model.seed "$seed" --data.init_args.seed "$seed" --trainer.logger false
         --trainer.enable_progress_bar false --export false)
  echo "seed $seed: training the exact run and the ablation, logs $out/exact-$seed.log and $out/nocross-$seed.log"
  OMP_NUM_THREADS=1 "$python" -m lightning_oomb.cli fit --config examples/passkey_cpu.yaml "${seeds[@]}" \
    --trainer.default_root_dir "$out/exact-$seed" > "$out/exact-$seed.log" 2>&1 &
  exact=$!
  OMP_NUM_THREADS=1 "$python" -m lightning_oomb.cli fit --config examples/passkey_cpu.yaml "${seeds[@]}" \
    --trainer.default_root_dir "$out/nocross-$seed" --trainer.strategy.init_args.cross_chunk_gradients false \
    > "$out/nocross-$seed.log" 2>&1 &
  nocross=$!
  kill_at_exit "$exact" "$nocross"
  waited "$exact" "$out/exact-$seed.log"
  waited "$nocross" "$out/nocross-$seed.log"
done
grep -H "held-out" "$out"/*.log
