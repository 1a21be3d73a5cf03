#!/usr/bin/env bash
# The figures issues 16 (multi-LoRA) and 17 (8-bit inference) are judged on, in the shapes and
# flags docs/benchmarks.md records them with, for a GPU machine (Llama-3.1-8B shape, dummy weights):
#   AGENT=.device-bin/peregrine-agent bash scripts/issue-figures.sh PHASE
# PHASE (each fits one 10-minute device call on an H100/H200):
#   lora-decode      bench --lora: 4 adapters of rank 32, uniform and Zipf(1), batch 1/16/64/256
#   lora-throughput  throughput 1000 x 128/128 with 16 adapters (Zipf(1), uniform), prefill-heavy
#                    1000 x 1000 -> 100 with 4 adapters
#   w8               fp8 and int8 weights: decode batch 1/64/256, 1000 x 128/128, 1000 x 1000/1000 with
#                    the fp8 KV cache, and rank-32 LoRA over fp8 at batch 64/256
# Each run prints its own base and LoRA (or 8-bit) figures; warnings go to stderr. MODEL overrides
# the shape; EXTRA adds flags to every run (e.g. EXTRA="--gpu-memory-utilization 0.85").
set -euo pipefail
cd "$(dirname "$0")/.."
AGENT="${AGENT:-target/release/peregrine-agent}"
MODEL="${MODEL:-scripts/shapes/llama-3.1-8b.json}"
EXTRA="${EXTRA:-}"
phase="${1:-}"

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
echo "agent $AGENT, model $MODEL, $(date -u +%FT%TZ)"

common=(--model "$MODEL" --load-format dummy --device cuda --max-model-len 2048)
# shellcheck disable=SC2086 # EXTRA is a list of flags
# A failed run says so and the phase goes on.
bench() {
  echo "== bench $*"
  "$AGENT" bench "${common[@]}" --context-len 128 --decode-tokens 128 --repeat 3 $EXTRA "$@" || echo "== failed: exit $?"
}
# shellcheck disable=SC2086
throughput() {
  echo "== throughput $*"
  "$AGENT" throughput "${common[@]}" --num-prompts 1000 --max-num-seqs 1024 --max-num-batched-tokens 16384 $EXTRA "$@" || echo "== failed: exit $?"
}
lora32=(--lora-rank 32 --max-lora-rank 32)

case "$phase" in
  lora-decode)
    for s in 0 1; do bench --batch-sizes 1,16,64,256 --lora 4 "${lora32[@]}" --zipf-s "$s"; done
    ;;
  lora-throughput)
    for dist in zipf:1 uniform; do throughput --input-len 128 --output-len 128 --lora 16 --max-loras 16 "${lora32[@]}" --lora-dist "$dist"; done
    throughput --input-len 1000 --output-len 100 --lora 4 --max-loras 4 "${lora32[@]}" --lora-dist zipf:1
    ;;
  w8)
    for q in fp8 int8; do bench --batch-sizes 1,64,256 --quantization "$q"; done
    for q in fp8 int8; do throughput --input-len 128 --output-len 128 --quantization "$q"; done
    throughput --input-len 1000 --output-len 1000 --quantization fp8 --kv-cache-dtype fp8
    bench --batch-sizes 64,256 --quantization fp8 --lora 4 "${lora32[@]}" --zipf-s 0
    ;;
  *)
    echo "usage: AGENT=... bash scripts/issue-figures.sh lora-decode|lora-throughput|w8" >&2
    exit 2
    ;;
esac
