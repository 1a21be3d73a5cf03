#!/usr/bin/env python3
"""Makes tests/fixtures/int8_tiny: a tiny random Llama checkpoint in compressed-tensors' W8A8 int8
layout (what llm-compressor writes for `scheme="W8A8"`, GPTQ's output included, and vLLM reads):
config.json's quantization_config {"quant_method": "compressed-tensors", "format":
"int-quantized", ...}, I8 linear weights with a `weight_scale` [out, 1] beside each, the LM head left
unquantized (`ignore`); and the reference dequantization of every quantized weight.

Quantization as compressed-tensors does it for symmetric int8 (numpy here, not Peregrine): scale =
max |w| of the row / 127.5, code = clamp(round-half-even(w / scale), -128, 127), so a row's most
negative element lands on -128 where it has the row's largest magnitude. Layer 0 stores its scales
as bf16 (the model's dtype, as llm-compressor does), layer 1 as f16; each has an all-zero row (its
scale clamped to float32's eps, as compressed-tensors clamps it; codes 0). The reference is code x scale (the stored scale, as f32) in float32.

Run with a venv holding scripts/requirements-fixtures.txt:
    python3 -m venv /tmp/fx && /tmp/fx/bin/pip install -r scripts/requirements-fixtures.txt
    /tmp/fx/bin/python scripts/make-int8-fixture.py tests/fixtures/int8_tiny
Deterministic: the same seed gives the same bytes. scripts/make-fp8-fixture-logits.py then adds
transformers' logits of the dequantized model (it reads any fixture folder of this shape).
"""
import json
import sys
from pathlib import Path

import numpy as np

from tiny_llama_fixture import BASE_CONFIG, build, write_safetensors

SEED = 23
ARGS_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "actorder": None,
             "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
CONFIG = {
    **BASE_CONFIG,
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**ARGS_INT8, "strategy": "channel", "dynamic": False},
                "input_activations": {**ARGS_INT8, "strategy": "token", "dynamic": True, "observer": None},
                "output_activations": None,
            }
        },
    },
}


def to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns, round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def quantize(w, scale_dtype):
    """Returns (int8 codes, stored scale as (dtype string, raw bytes), scale as float32 [out, 1])."""
    amax = np.abs(w).max(axis=1, keepdims=True).astype(np.float32)
    scale = np.maximum(amax / np.float32(127.5), np.finfo(np.float32).eps).astype(np.float32)
    if scale_dtype == "BF16":
        bits = to_bf16_bits(scale)
        stored, scale = ("BF16", bits.astype("<u2").tobytes()), bf16_bits_to_f32(bits).reshape(scale.shape)
    else:
        half = scale.astype(np.float16)
        stored, scale = ("F16", half.astype("<f2").tobytes()), half.astype(np.float32)
    # The codes from the stored scale, as the checkpoint's reader sees them.
    codes = np.clip(np.round(w / scale), -128, 127).astype(np.int8)
    return codes, stored, scale


def main(out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)

    def linear(layer, key, w):
        codes, (scale_dtype, scale_raw), scale = quantize(w, "BF16" if layer == 0 else "F16")
        stored = {key: ("I8", codes.shape, codes.tobytes()), key + "_scale": (scale_dtype, scale.shape, scale_raw)}
        # One float32 multiply per element.
        return stored, codes.astype(np.float32) * scale

    model, reference = build(rng, CONFIG, lambda x: to_bf16_bits(x.astype(np.float32)), linear)
    write_safetensors(out / "model.safetensors", model)
    write_safetensors(out / "dequantized.safetensors", reference)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    print(f"wrote {out} (numpy {np.__version__}, seed {SEED})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/int8_tiny")
