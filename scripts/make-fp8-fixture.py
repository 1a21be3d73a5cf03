#!/usr/bin/env python3
"""Makes tests/fixtures/fp8_tiny: a tiny random Llama checkpoint in the FP8 layout vLLM reads
(config.json quantization_config {"quant_method": "fp8"}, F8_E4M3 linear weights with a
`weight_scale` beside each), and the reference dequantization of every quantized weight.

The e4m3 conversion and decoding are ml_dtypes' (`float8_e4m3fn`, round to nearest even), never
Peregrine's. Layer 0 has per-row scales ([out, 1], as vLLM's per-channel checkpoints), layer 1 one
per-tensor scale ([] scalar), so the loader's two cases are both covered. The embedding is bf16, the
LM head f32 and untied (FP8 checkpoints keep the LM head unquantized).

Run with a venv holding scripts/requirements-fixtures.txt:
    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install -r scripts/requirements-fixtures.txt
    /tmp/fx/bin/python scripts/make-fp8-fixture.py tests/fixtures/fp8_tiny
Deterministic: the same seed gives the same bytes.
"""
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from tiny_llama_fixture import BASE_CONFIG, build, f32, write_safetensors

SEED = 17
CONFIG = {**BASE_CONFIG, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
E4M3_MAX = 448.0


def quantize(w, per_row):
    """Returns (codes as float8_e4m3fn, scale as float32 array of shape [out, 1] or [])."""
    amax = np.abs(w).max(axis=1, keepdims=True) if per_row else np.abs(w).max()
    scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    # A zero row keeps scale 0 and zero codes.
    divisor = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(w / divisor, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def write_e4m3_cases(path, rng):
    """f32 inputs (as bit patterns) and ml_dtypes' e4m3fn codes for them: every code's value, the
    midpoints between neighbours (ties) and one f32 step either side, and random values over the
    whole range. Only |x| <= 448: beyond it ml_dtypes gives NaN where Peregrine saturates."""
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(values[np.isfinite(values) & (values >= 0)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1000))])
    rand = (np.exp(rng.uniform(np.log(1e-4), np.log(448.0), 4000))).astype(np.float32)
    xs = np.concatenate([finite, near, rand])
    xs = xs[np.abs(xs) <= 448]
    xs = np.concatenate([xs, -xs]).astype(np.float32)
    out = xs.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    cases = {"library": f"ml_dtypes {ml_dtypes.__version__} float8_e4m3fn",
             "f32_bits": [int(b) for b in xs.view(np.uint32)], "codes": [int(c) for c in out]}
    path.write_text(json.dumps(cases, separators=(",", ":")) + "\n")


def main(out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)

    def linear(layer, key, w):
        codes, scale = quantize(w, per_row=(layer == 0))
        stored = {key: ("F8_E4M3", codes.shape, codes.view(np.uint8).tobytes()), key + "_scale": f32(scale)}
        # ml_dtypes decodes; the product is one float32 multiply per element.
        return stored, codes.astype(np.float32) * scale

    model, reference = build(rng, CONFIG, lambda x: x.astype(ml_dtypes.bfloat16).view(np.uint16), linear)
    write_safetensors(out / "model.safetensors", model)
    write_safetensors(out / "dequantized.safetensors", reference)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    write_e4m3_cases(out / "e4m3_cases.json", rng)
    print(f"wrote {out} (ml_dtypes {ml_dtypes.__version__}, numpy {np.__version__}, seed {SEED})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/fp8_tiny")
