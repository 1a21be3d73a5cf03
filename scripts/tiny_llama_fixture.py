"""Shared by the scripts that make the tiny pre-quantized Llama fixtures (make-fp8-fixture.py,
make-int8-fixture.py): the model's shape, a safetensors writer, and the random weights, drawn in one
fixed order from the caller's generator so that each fixture's bytes follow from its seed alone.
"""
import json
import struct

import numpy as np

BASE_CONFIG = {
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


def f32(x):
    return ("F32", x.shape, np.ascontiguousarray(x, dtype="<f4").tobytes())


def build(rng, config, embed_bf16_bits, quantize_linear):
    """The tiny model's tensors: a bf16 embedding (`embed_bf16_bits` turns the float64 draw into
    bf16 bit patterns), an f32 LM head and norms, and every decoder linear as `quantize_linear(layer,
    name, w)` stores it (w: float32, rows of very different magnitude, row 3 all zero). That returns
    (the tensors to store for it, its dequantized float32 values). Returns (model tensors,
    reference tensors: name -> float32 dequantized linear)."""
    c = config
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    model, reference = {}, {}
    embed = embed_bf16_bits(rng.standard_normal((v, h)) * 0.5)
    model["model.embed_tokens.weight"] = ("BF16", embed.shape, embed.astype("<u2").tobytes())
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
            w = rng.standard_normal((rows, cols)) / np.sqrt(cols)
            w *= np.exp(rng.uniform(-2, 2, size=(rows, 1)))
            w[3] = 0.0
            key = p + name + ".weight"
            stored, dequantized = quantize_linear(layer, key, w.astype(np.float32))
            model.update(stored)
            reference[key] = f32(dequantized.astype(np.float32))
    return model, reference
