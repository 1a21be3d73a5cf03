#!/usr/bin/env bash
# Creates (once) a separate virtualenv with torch, transformers and sentence-transformers
# (scripts/requirements-torch.txt) for the reference scripts; prints its python. The test suite never
# uses it: it only reads what those scripts committed.
set -euo pipefail
cache="${PEREGRINE_CACHE:-$HOME/.cache/peregrine}"
venv="$cache/venv-torch"
requirements="$(cd "$(dirname "$0")" && pwd)/requirements-torch.txt"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
