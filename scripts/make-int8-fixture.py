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
import struct
import sys
from pathlib import Path

import numpy as np

SEED = 23
ARGS_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "actorder": None,
             "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
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


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string, shape, raw bytes). The format: u64 header length, JSON
    header (sorted names, offsets into the data), data."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


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
    c = CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    model, reference = {}, {}

    def f32(x):
        return ("F32", x.shape, np.ascontiguousarray(x, dtype="<f4").tobytes())

    embed = (rng.standard_normal((v, h)) * 0.5).astype(np.float32)
    model["model.embed_tokens.weight"] = ("BF16", embed.shape, to_bf16_bits(embed).astype("<u2").tobytes())
    model["lm_head.weight"] = f32((rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32))
    model["model.norm.weight"] = f32((1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    shapes = {
        "self_attn.q_proj": (q_dim, h),
        "self_attn.k_proj": (kv_dim, h),
        "self_attn.v_proj": (kv_dim, h),
        "self_attn.o_proj": (h, q_dim),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        model[p + "input_layernorm.weight"] = f32((1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        model[p + "post_attention_layernorm.weight"] = f32((1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        for name, (rows, cols) in shapes.items():
            # Rows of very different magnitude, so per-row scales differ; one all-zero row.
            w = rng.standard_normal((rows, cols)) / np.sqrt(cols)
            w *= np.exp(rng.uniform(-2, 2, size=(rows, 1)))
            w[3] = 0.0
            w = w.astype(np.float32)
            codes, (scale_dtype, scale_raw), scale = quantize(w, "BF16" if layer == 0 else "F16")
            key = p + name + ".weight"
            model[key] = ("I8", codes.shape, codes.tobytes())
            model[key + "_scale"] = (scale_dtype, (rows, 1), scale_raw)
            # One float32 multiply per element.
            reference[key] = f32((codes.astype(np.float32) * scale).astype(np.float32))
    write_safetensors(out / "model.safetensors", model)
    write_safetensors(out / "dequantized.safetensors", reference)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    print(f"wrote {out} (numpy {np.__version__}, seed {SEED})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/int8_tiny")
