#!/usr/bin/env bash
# The chat fine-tuning YAML as a user runs it, on one GPU: examples/smollm2-chat-64k.yaml (SmolLM2-135M-Instruct
# from its GGUF file in MODEL_DIR, YaRN x8, assistant-only loss, conversations packed into 65,536 tokens).
#   data      CONVERSATIONS long conversations (default 300) by `examples/make_chat_set.py --long`, rendered
#             with the model's own chat template to 8,000-60,000 tokens each: a secret letter stated in the first
#             user turn and asked for again after turns of other words, last at the conversation's end;
#   before    `lightning-oomb validate` on the held-out conversations (2%, the YAML's val_fraction);
#   fit       MINUTES of training (default 10), validating every VAL_EVERY steps (default 20);
#   summary   held-out loss before and at each validation, step times (TensorBoard's train/tokens_per_s), the
#             plan printed at fit start, and GPU and host memory sampled every 5 s (OUT/monitor.txt).
#   bash docs/bench/smollm2-chat-64k-h200.sh MODEL_DIR OUT [MINUTES]
# TOKENS=MIN:MAX sets the conversations' lengths, and EXTRA="--opt value ..." adds overrides to both commands (a
# small check on the CPU: EXTRA="--trainer.accelerator cpu --data.init_args.seq_len 4096 ..." TOKENS=1000:3500).
# MODEL_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf (examples/smollm2-passkey-64k.yaml's header says how to get it).
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
model=${1:?MODEL_DIR}; out=${2:?OUT}; minutes=${3:-10}
gguf=SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f "$model/$gguf" ]] || { echo "$0: no $gguf in $model" >&2; exit 2; }
yaml=examples/smollm2-chat-64k.yaml
mkdir -p "$out/runs"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
( while sleep 5; do echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)" \
    "host used GiB $(free -g | awk '/Mem:/ {print $3}')"; done ) > "$out/monitor.txt" 2>&1 &
kill_at_exit $!
logged "$out/data.log" "$python" examples/make_chat_set.py "$out/data" --long --tokenizer "$model" --gguf-file "$gguf" \
  --conversations "${CONVERSATIONS:-300}" --tokens "${TOKENS:-8000:60000}"
cat "$out/data.log"
common=(--config "$yaml" --model.pretrained "$model" --data.init_args.paths "[$out/data]"
        --trainer.logger.init_args.save_dir "$out/runs")
read -r -a extra <<< "${EXTRA:-}"
common+=("${extra[@]}")
logged "$out/before.log" "$python" -m lightning_oomb.cli validate "${common[@]}" \
  --trainer.logger.init_args.version before
logged "$out/fit.log" "$python" -m lightning_oomb.cli fit "${common[@]}" --trainer.logger.init_args.version fit \
  --trainer.max_time "$(printf "00:00:%02d:00" "$minutes")" --trainer.val_check_interval "${VAL_EVERY:-20}" \
  --export false
"$python" - "$out/runs" "$out/fit.log" <<'EOF' | tee "$out/summary.txt"
import re, statistics, sys
from pathlib import Path
from lightning_oomb.bench.scalars import read_scalars

runs = {p.name: read_scalars(p) for p in Path(sys.argv[1]).rglob("*") if p.is_dir() and p.name in ("before", "fit")}
before = runs["before"].get("val/loss", [])
after = runs["fit"].get("val/loss", [])
print(f"held-out loss before: {before[-1].value:.4f}" if before else "held-out loss before: not logged")
print("held-out loss in fit: " + ", ".join(f"step {e.step}: {e.value:.4f}" for e in after))
log = Path(sys.argv[2]).read_text()
seq_len = int(re.search(r"sequences of ([\d,]+) tokens", log).group(1).replace(",", ""))
seconds = [seq_len / e.value for e in runs["fit"].get("train/tokens_per_s", [])]
if seconds:
    steady, since = (seconds[2:], "from step 3 on") if len(seconds) > 2 else (seconds, "over every step")
    print(f"steps: {len(seconds)}, median {statistics.median(steady):.3f} s {since}")
for line in log.splitlines():
    if line.startswith(("chat:", "Plan:", "Step time", "FITS", "held-out:")):
        print(line)
EOF
touch "$out/done"
