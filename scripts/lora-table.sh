#!/usr/bin/env bash
# Issue 16's table: LoRA decode throughput relative to the base model over adapter ranks and counts,
# one `peregrine-agent bench --lora N --lora-rank R` per cell (random adapters on all seven
# projections, requests spread uniformly over the N adapters), on the GPU machine:
#   AGENT=.device-bin/peregrine-agent bash scripts/lora-table.sh
# RANKS, COUNTS, BATCHES and MODEL override the defaults below. Prints a markdown table of
# "LoRA / base" per batch size; the raw bench output goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
AGENT="${AGENT:-target/release/peregrine-agent}"
MODEL="${MODEL:-scripts/shapes/llama-3.1-8b.json}"
RANKS="${RANKS:-8 16 32 64}"
COUNTS="${COUNTS:-1 4 16 64}"
BATCHES="${BATCHES:-64,256}"
header="| rank | adapters |"
sep="| --- | --- |"
for b in ${BATCHES//,/ }; do header="$header batch $b |"; sep="$sep --- |"; done
echo "$header"
echo "$sep"
for r in $RANKS; do
  for n in $COUNTS; do
    out="$("$AGENT" bench --model "$MODEL" --load-format dummy --device cuda --lora "$n" --lora-rank "$r" \
      --max-lora-rank "$r" --zipf-s 0 --batch-sizes "$BATCHES" --context-len 128 --decode-tokens 64 --repeat 2 \
      --max-model-len 2048 2>&1)" || { echo "| $r | $n | failed: $(echo "$out" | tail -1) |"; continue; }
    echo "$out" >&2
    # "+ LoRA ... (0.798 x base; ...)" lines, one per batch size, in order.
    ratios="$(echo "$out" | sed -n 's/.*+ LoRA.*(\([0-9.]*\) x base.*/\1/p' | tr '\n' ' ')"
    row="| $r | $n |"
    for x in $ratios; do row="$row $x |"; done
    echo "$row"
  done
done
