#!/usr/bin/env bash
# HTTP cost against the offline bench at one batch size, robust to a shared machine: ROUNDS pairs of
# (offline decode, server paused) then (HTTP via `bench serve`), each pair's cost = TPOT p50 / ms per
# step - 1, plus the server's async-thread CPU and wakeups per token and the client's CPU per token.
# Usage: scripts/bench-http-overhead.sh BATCH ROUNDS [agent binary]  (needs a release build and perf)
set -euo pipefail
cd "$(dirname "$0")/.."
batch="$1"; rounds="$2"; agent="${3:-target/release/peregrine-agent}"
model="$(scripts/fetch-model.sh)"
port=18400
scratch="$(mktemp -d)"
source scripts/bench-server.sh
trap '[ -n "${server:-}" ] && kill -CONT "$server" 2>/dev/null && kill "$server" 2>/dev/null; rm -rf "$scratch"' EXIT
start_bench_server "$agent" "$model" "$port" 2 "$scratch/server.log"
tokens=$((64 * batch))
for _ in $(seq 1 "$rounds"); do
    kill -STOP "$server"
    offline=$("$agent" bench --model "$model" --threads 2 --batch-sizes "$batch" --prompt-len 16 --repeat 1 \
        | sed -n 's/^decode .*, \([0-9.]*\) ms\/step.*/\1/p')
    kill -CONT "$server"
    scripts/thread_cpu.py "$server" snap "$scratch/before.json"
    http=$(perf stat -x, -e task-clock -o "$scratch/client.stat" "$agent" bench serve --url "http://127.0.0.1:$port" \
        --model smollm2 --num-prompts "$batch" --input-len 64 --output-len 64 --json)
    tpot=$(echo "$http" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tpot"]["p50_ms"])')
    client=$(awk -F, -v n="$tokens" '/task-clock/ {printf "%.3f", $1 / n}' "$scratch/client.stat")
    server_cpu=$(scripts/thread_cpu.py "$server" diff "$scratch/before.json" "$tokens" \
        | awk '/tokio|peregrine-agent/ {c += $3; w += $4} END {printf "%.3f ms CPU/token, %.2f wakeups/token", c, w}')
    awk -v b="$batch" -v o="$offline" -v h="$tpot" -v c="$client" -v s="$server_cpu" 'BEGIN {
        printf "batch %s: offline %.1f ms/step, HTTP TPOT p50 %.1f ms (%+.1f%%); client %s ms CPU/token; server async %s\n",
            b, o, h, 100 * (h / o - 1), c, s }'
done
