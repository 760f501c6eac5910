#!/usr/bin/env bash
# How long each task x length of a `lightning-oomb evaluate` grid took against its plan: the plan's prefill per
# prompt plus its time a new token times the tokens each prompt generated (its prediction in results.json,
# tokenized again with the model's tokenizer), beside the time the log reports for the task.
#   bash docs/bench/ruler-times.sh RESULTS_JSON LOG MODEL_DIR [GGUF_FILE]
# `lightning-oomb evaluate` on a GPU prints the range of these ratios itself from each prompt's recorded seconds
# and new tokens; this script is for results.json files whose samples lack them.
# e.g. docs/bench/h100-ruler-smollm2-5877097/pretrained-sparse.{json,log} with the SmolLM2 GGUF's folder.
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python (PYTHON=...)
"$python" - "${1:?RESULTS_JSON}" "${2:?LOG}" "${3:?MODEL_DIR}" "${4:-}" <<'PY'
import json, re, sys
from transformers import AutoTokenizer

results, log, model, gguf = sys.argv[1:5]
tokenizer = AutoTokenizer.from_pretrained(model, **({"gguf_file": gguf} if gguf else {}))
grid = json.load(open(results))
times = {(m[1], m[2]): float(m[3]) for m in re.finditer(r"\] (\S+) at (\S+): [\d.]+ \(\d+ samples?, ([\d.]+) s\)",
                                                         open(log).read())}
ratios = []
print(f"{'task':16s} {'length':>6s} {'new tokens':>18s} {'seconds':>8s} {'plan':>6s} {'ratio':>6s}")
for task, by_length in grid["details"].items():
    for length, samples in by_length.items():
        new = [len(tokenizer(s["prediction"], add_special_tokens=False)["input_ids"]) for s in samples]
        plan = grid["plan"]["seconds"][length]
        planned = sum(plan["prefill"] + n * plan["per_new_token"] for n in new)
        took = times[(task, length)]
        ratios.append(took / planned)
        print(f"{task:16s} {length:>6s} {str(new):>18s} {took:8.1f} {planned:6.1f} {took / planned:6.2f}")
print(f"time / plan: {min(ratios):.2f} to {max(ratios):.2f}")
PY
