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
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

SEED = 17
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
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}
E4M3_MAX = 448.0


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
    c = CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    model, reference = {}, {}

    def f32(x):
        return ("F32", x.shape, np.ascontiguousarray(x, dtype="<f4").tobytes())

    embed = (rng.standard_normal((v, h)) * 0.5).astype(ml_dtypes.bfloat16)
    model["model.embed_tokens.weight"] = ("BF16", embed.shape, embed.view(np.uint16).astype("<u2").tobytes())
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
            codes, scale = quantize(w, per_row=(layer == 0))
            key = p + name + ".weight"
            model[key] = ("F8_E4M3", codes.shape, codes.view(np.uint8).tobytes())
            model[key + "_scale"] = f32(scale)
            # ml_dtypes decodes; the product is one float32 multiply per element.
            reference[key] = f32((codes.astype(np.float32) * scale).astype(np.float32))
    write_safetensors(out / "model.safetensors", model)
    write_safetensors(out / "dequantized.safetensors", reference)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    write_e4m3_cases(out / "e4m3_cases.json", rng)
    print(f"wrote {out} (ml_dtypes {ml_dtypes.__version__}, numpy {np.__version__}, seed {SEED})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/fp8_tiny")
