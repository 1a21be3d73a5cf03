#!/usr/bin/env bash
# Builds the GPU test binaries, the CUDA bench and the agent (for `throughput`/`bench` on the GPU) where Rust is, into .device-bin/ (git-ignored), with
# the script that runs them: copy that folder to a GPU machine (no Rust needed there) and run
# `bash .device-bin/test-gpu.sh` (what `make test-gpu` does).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device-bin
rm -rf "$out" && mkdir -p "$out/tests"
cargo test --no-run --message-format=json -p peregrine-kernels -p peregrine-engine 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])
' | while read -r exe; do cp "$exe" "$out/tests/"; done
cargo build --example cuda_bench -p peregrine-engine
cargo build --example encoder_bench -p peregrine-engine
cargo build --example micro -p peregrine-kernels
cargo build -p peregrine-agent
cp target/debug/examples/micro "$out/"
cp target/debug/peregrine-agent "$out/"
cp target/debug/examples/cuda_bench "$out/"
cp target/debug/examples/encoder_bench "$out/"
cp scripts/test-gpu.sh "$out/"
strip "$out"/tests/* "$out/cuda_bench" "$out/encoder_bench" "$out/micro" "$out/peregrine-agent" 2>/dev/null || true
ls -la "$out" "$out/tests"
