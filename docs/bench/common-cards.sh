#!/usr/bin/env bash
# The longest context per step on the GPUs people have: `lightning-oomb plan --max-context` for Qwen2.5-7B and
# Llama-3.1-8B on GPUs of 24, 48, 80 and 140 GiB with host budgets of 64 and 128 GiB (bf16 KV-gradients),
# printed as the markdown tables of docs/planner.md, "On the GPUs people have". Rows: full training with AdamW
# (bf16-true) and with 8-bit AdamW, LoRA rank 16, QLoRA nf4 rank 16, each dense and sparse (64 pages); a cell is
# the longest context in K tokens (1K = 1024), "-" where not one chunk fits. A plan, nothing is run on a GPU.
#
#   bash docs/bench/common-cards.sh          (from the repository; PYTHON=... picks the interpreter: lib.sh)
source "$(dirname "$0")/lib.sh"  # stops at a failing command and says which; $python

gpus=(24 48 80 140)
hosts=(64 128)
rows=("full training, adamw, dense" "full training, adamw, sparse 64 pages"
      "full training, adamw8bit, dense" "full training, adamw8bit, sparse 64 pages"
      "LoRA rank 16, dense" "LoRA rank 16, sparse 64 pages"
      "QLoRA rank 16, nf4, dense" "QLoRA rank 16, nf4, sparse 64 pages")

# The table rows of one `plan --max-context` as "case<TAB>longest context" lines.
cases() {
  "$python" -m lightning_oomb.cli plan --max-context --grad-dtype bfloat16 "$@" \
    | awk -F '  +' '/^(full training|LoRA|QLoRA)/ { gsub(",", "", $2); print $1 "\t" $2 }'
}

for model in qwen2.5-7b llama-3.1-8b; do
  declare -A cell=()
  header="| $model: GPU / host GiB |"
  rule="| --- |"
  for gpu in "${gpus[@]}"; do
    for host in "${hosts[@]}"; do
      column="$gpu / $host"
      header+=" $column |"
      rule+=" ---: |"
      machine=(--model "$model" --gpu-memory "${gpu}GiB" --host-memory "${host}GiB")
      # Into a variable first: a failing plan stops the script here (in a process substitution it would not).
      planned=$(cases "${machine[@]}" --lora-rank 16 --quantization nf4; cases "${machine[@]}" --optimizer adamw8bit)
      while IFS=$'\t' read -r name tokens; do
        if [[ $tokens == none ]]; then cell["$name|$column"]="-"; else cell["$name|$column"]="$((tokens / 1024))K"; fi
      done <<< "$planned"
    done
  done
  echo "$header"
  echo "$rule"
  for row in "${rows[@]}"; do
    line="| $row |"
    for gpu in "${gpus[@]}"; do
      for host in "${hosts[@]}"; do line+=" ${cell["$row|$gpu / $host"]} |"; done
    done
    echo "$line"
  done
  echo
  unset cell
done
