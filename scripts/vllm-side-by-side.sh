#!/usr/bin/env bash
# vLLM 0.22.0 beside Peregrine on the lent GPU machine (no network there, CPython 3.12 with torch
# 2.11.0): builds, here, the bundle ../shared/peers/README.md describes and splits it into parts the
# device tool can carry one call each (the repo's tracked files travel with every call, so a part is
# kept to 33 MB). docs/benchmarks.md ("Session 33") has the figures this produced.
#
#   scripts/vllm-side-by-side.sh pack      # here: .device-bin/vllm-p0 .. vllm-p3 (git-ignored)
#   bash scripts/vllm-side-by-side.sh setup   # there, after the parts' calls copied p0..p2 to /tmp
#   bash scripts/vllm-side-by-side.sh run base|lora|fp8 [vllm_bench.py args]   # there
#
# On the device, calls must follow each other within its idle window (30 s): carry .device-bin/vllm-p0
# and run `cp .device-bin/vllm-p0/p /tmp/vllm-p0`, the same for p1 and p2, then carry vllm-p3 and run
# `setup` (it joins /tmp/vllm-p0..2 with the carried p3), then `run MODE` once per mode.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers/vllm}
OUTDIR=$ROOT/.device-bin
WORK=${VLLM_PACK_WORK:-/tmp/vllm-pack}
# vLLM's direct dependencies the device lacks (put first on PYTHONPATH) ...
DEPS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions pyzmq msgspec
cbor2 pybase64 cachetools gguf openai==3.57.0 httpx2 httpcore2==2.16.2 jiter sniffio anyio distro idna truststore
openai-harmony partial-json-parser fastapi==0.121.0 starlette==0.49.1 annotated-doc xgrammar==0.2.7
apache-tvm-ffi==0.1.9 llguidance==1.6.1 setproctitle blake3 depyf==0.20.0 astor dill compressed-tensors==0.15.0.1
loguru outlines_core==0.2.14 lark==1.2.2 diskcache==5.6.3 lm-format-enforcer==0.11.3 interegular
python-json-logger ijson watchfiles py-cpuinfo prometheus_client cloudpickle einops h11 httpx httpcore"
# ... and ones the device may have: used only where it does not (`setup` checks each).
EXTRAS="aiohttp aiosignal frozenlist multidict yarl propcache attrs aiohappyeyeballs
prometheus-fastapi-instrumentator mistral_common pycountry jsonschema jsonschema-specifications referencing
rpds-py msgpack uvloop ninja"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"

pack() {
    rm -rf "$WORK" && mkdir -p "$WORK"/{wheel,deps,extras,d1,d2}
    echo "downloading vllm 0.22.0 (261 MB) ..."
    pip download --no-deps -q -d "$WORK/wheel" vllm==0.22.0
    # shellcheck disable=SC2086
    pip download --no-deps -q -d "$WORK/deps" --python-version 3.12 $PLATFORMS --only-binary=:all: $DEPS
    # shellcheck disable=SC2086
    pip download --no-deps -q -d "$WORK/extras" --python-version 3.12 $PLATFORMS --only-binary=:all: $EXTRAS
    unzip -q "$WORK"/wheel/vllm-*.whl -d "$WORK/d1"
    # Hopper needs _C, _C_stable_libtorch, the FA3 library, cumem_allocator and deep_gemm's cp312 build.
    rm -f "$WORK"/d1/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$WORK"/d1/vllm/_moe_C.abi3.so \
        "$WORK"/d1/vllm/_flashmla_C.abi3.so "$WORK"/d1/vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so
    for w in "$WORK"/deps/*.whl; do unzip -q -o "$w" -d "$WORK/d1"; done
    for w in "$WORK"/extras/*.whl; do unzip -q -o "$w" -d "$WORK/d2"; done
    cp "$PEERS/vllm_bench.py" "$PEERS/make_adapters.py" "$WORK/d1/"
    echo "compressing (about 2 minutes) ..."
    tar -C "$WORK" -cf - d1 d2 | xz -T2 -6 > "$WORK/vllm.txz"
    split -n 4 -d -a 1 "$WORK/vllm.txz" "$WORK/part"
    for i in 0 1 2 3; do rm -rf "$OUTDIR/vllm-p$i" && mkdir -p "$OUTDIR/vllm-p$i" && mv "$WORK/part$i" "$OUTDIR/vllm-p$i/p"; done
    md5sum "$WORK/vllm.txz"
    ls -l "$OUTDIR"/vllm-p*/p
}

setup() {
    if [ ! -d /tmp/vl/d1/vllm ]; then
        cat /tmp/vllm-p0 /tmp/vllm-p1 /tmp/vllm-p2 "$OUTDIR/vllm-p3/p" > /tmp/vllm.txz
        md5sum /tmp/vllm.txz
        rm -rf /tmp/vl && mkdir -p /tmp/vl && tar -C /tmp/vl -xJf /tmp/vllm.txz
        # Move each extra the device lacks (every top-level name of its RECORD unimportable) into d1.
        python3 - <<'PY'
import importlib.util, os, shutil
d1, d2 = "/tmp/vl/d1", "/tmp/vl/d2"
for di in sorted(x for x in os.listdir(d2) if x.endswith(".dist-info")):
    tops = {l.split(",")[0].split("/")[0] for l in open(os.path.join(d2, di, "RECORD"))}
    tops = {t for t in tops if t and not t.endswith(".dist-info") and t != ".."}
    mods = {t[:-3] if t.endswith(".py") else t.split(".")[0] for t in tops if not t.endswith((".libs", ".pth"))}
    if any(m and not m.startswith("__") and importlib.util.find_spec(m) for m in mods):
        continue
    for t in sorted(tops) + [di]:
        if os.path.exists(os.path.join(d2, t)) and not os.path.exists(os.path.join(d1, t)):
            shutil.move(os.path.join(d2, t), os.path.join(d1, t))
    print("carried:", di)
PY
    fi
    mkdir -p /tmp/model8b && cp "$ROOT/scripts/shapes/llama-3.1-8b.json" /tmp/model8b/config.json
    PYTHONPATH=/tmp/vl/d1 python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    [ -d /tmp/adapters/a3 ] || python3 /tmp/vl/d1/make_adapters.py /tmp/adapters 4 32 /tmp/model8b/config.json
}

run() {
    export PYTHONPATH=/tmp/vl/d1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    cd /tmp && python3 /tmp/vl/d1/vllm_bench.py --mode "$@"
}

case "${1:-}" in
    pack) pack ;;
    setup) setup ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 pack | setup | run base|lora|fp8 [vllm_bench.py args]" >&2; exit 2 ;;
esac
