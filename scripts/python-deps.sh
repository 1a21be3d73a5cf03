#!/usr/bin/env bash
# Creates (once) a virtualenv in the cache folder with the Python packages the tests use, and prints
# its python. Pinned so that a fresh machine gets what the tests were written against.
set -euo pipefail
cache="${PEREGRINE_CACHE:-$HOME/.cache/peregrine}"
venv="$cache/venv"
requirements="$(cd "$(dirname "$0")" && pwd)/requirements-test.txt"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
