#!/usr/bin/env bash
# Fetches NVRTC (the CUDA runtime compiler, from NVIDIA's PyPI wheel nvidia-cuda-nvrtc) into the cache
# folder and prints the folder holding libnvrtc.so.13, so the kernel sources compile in the test run on
# machines without CUDA (kernels/tests/nvrtc_compile.rs). NVRTC needs no GPU. Prints nothing and fails
# when the wheel cannot be had; the test then skips, saying so.
set -euo pipefail
cache="${PEREGRINE_CACHE:-$HOME/.cache/peregrine}"
version=13.0.88
dir="$cache/nvrtc-$version"
if [ ! -f "$dir/libnvrtc.so.13" ]; then
    wheel_dir="$cache/nvrtc-wheel"
    rm -rf "$wheel_dir" && mkdir -p "$wheel_dir"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check "nvidia-cuda-nvrtc==$version" -d "$wheel_dir" >&2
    python3 - "$wheel_dir" "$dir.part" <<'PY'
import glob, os, shutil, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "nvidia_cuda_nvrtc-*.whl"))[0]
out = sys.argv[2]
shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if "/lib/" in name and base.startswith("libnvrtc") and ".alt." not in base:
            with z.open(name) as src, open(os.path.join(out, base), "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
    rm -rf "$dir" && mv "$dir.part" "$dir"
    rm -rf "$wheel_dir"
fi
echo "$dir"
