#!/usr/bin/env bash
# Every CPU figure in docs/benchmarks.md in one run: offline engine bench, LoRA overhead, and the same
# batch sizes over HTTP. Usage: scripts/bench-cpu.sh [threads]  (needs `cargo build --release -p peregrine-agent`)
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-2}"
agent=target/release/peregrine-agent
model="$(scripts/fetch-model.sh)"
echo "## machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
echo "## offline: $agent bench --model \$MODEL --threads $threads"
"$agent" bench --model "$model" --threads "$threads"
echo "## LoRA: $agent bench --model \$MODEL --threads $threads --lora 4 --lora-rank 16 --batch-sizes 32"
"$agent" bench --model "$model" --threads "$threads" --lora 4 --lora-rank 16 --batch-sizes 32
port=18123
source scripts/bench-server.sh
trap '[ -n "${server:-}" ] && kill "$server" 2>/dev/null || true' EXIT
start_bench_server "$agent" "$model" "$port" "$threads" /dev/null
# The load generator is the agent's own `bench serve` (one thread, little CPU): on 2 cores a heavier
# client (scripts/bench_serve.py takes ~0.25 ms of CPU per token) would be measured as server cost.
for batch in 1 8 32; do
    echo "## HTTP: $agent bench serve --num-prompts $batch --input-len 64 --output-len 64 (all at once)"
    "$agent" bench serve --url "http://127.0.0.1:$port" --model smollm2 \
        --num-prompts "$batch" --input-len 64 --output-len 64
done
