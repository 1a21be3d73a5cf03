#!/usr/bin/env bash
# Runs every prebuilt test binary in .device-bin/tests on a GPU machine. PEREGRINE_REQUIRE_GPU=1 turns
# "skipped: no CUDA device" into a failure, so this can only pass where the GPU tests really ran.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-/usr/local/cuda/lib64:/usr/local/nvidia/lib64}"
export PEREGRINE_REQUIRE_GPU=1
# The fp8 KV cache tests need compute capability 8.9+; there they must run, not skip.
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)"
if [ -n "$cap" ] && awk -v c="$cap" 'BEGIN { exit !(c >= 8.9) }'; then export PEREGRINE_REQUIRE_FP8=1; fi
status=0
for t in "$here"/tests/*; do
  echo "=== $(basename "$t")"
  "$t" --test-threads=1 "$@" || status=1
done
exit $status
