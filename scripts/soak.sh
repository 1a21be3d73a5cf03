#!/usr/bin/env bash
# Soak test: builds the agent, fetches the test model and runs scripts/soak.py against it with the
# fixture adapters (N streams for M minutes, client kills, adapter loads/unloads, final SIGTERM).
#   scripts/soak.sh                       # 16 streams, 3 minutes
#   STREAMS=32 MINUTES=10 scripts/soak.sh
# Extra arguments go to soak.py (see scripts/soak.py --help). Exits non-zero if a request was lost.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo build --locked -p peregrine-agent --bin peregrine-agent >&2
model="${PEREGRINE_TEST_MODEL:-$(scripts/fetch-model.sh)}"
lora="$root/tests/fixtures/smollm2/lora"
exec python3 scripts/soak.py --agent "${CARGO_TARGET_DIR:-$root/target}/debug/peregrine-agent" --model "$model" \
    --adapters "$lora/adapter-a" "$lora/adapter-b" \
    --streams "${STREAMS:-16}" --minutes "${MINUTES:-3}" --log "${SOAK_LOG:-/tmp/soak-agent.log}" "$@"
