#!/usr/bin/env python3
"""What 8-bit weights (and per-token 8-bit activations) cost SmolLM2 in the reference library, with
no Peregrine code involved: transformers' float32 SmolLM2 (the test GGUF, dequantized by its GGUF
loader, the recipe of tests/fixtures/smollm2/reference.json), every decoder linear (q, k, v, o, gate,
up, down; not the embedding nor the LM head, as `--quantization` leaves them) replaced by its
quantize-dequantize in torch:

- fp8: e4m3 (torch.float8_e4m3fn, round to nearest even), one scale per output row (max |w| / 448)
  or one per tensor;
- int8: round(w / s) clamped to ±127, s = max |w| / 127 per output row;
- W8A8: each linear's input also quantized per token (one scale per row of activations), as issue
  17's recipe and `peregrine-agent eval --quantization fp8|int8` do;
- bf16 weights, for scale.

and, over the unquantized weights, the KV cache's rounding (the keys after RoPE and the values each
attention reads, rounded as the cache would hold them): bf16; e4m3 with scale 1 (`fp8-plain`); the
same after a Hadamard rotation of q and k (`fp8`, the default); one scale per token and KV head
(`fp8-scaled`, rotated); K in bf16 with V per-head e4m3; int8 per token and head (`int8`).

It prints, for each, what `peregrine-agent eval` prints against the unquantized model (the float32
run of this script): over the fixture prompts (every position) the mean and max |Δlogit| over the
reference's top-10 ids, top-1 agreement and KL(reference ‖ variant); over the eval text
(agent/src/eval/pride-and-prejudice-ch1.txt, the token ids of tests/fixtures/smollm2/perplexity.json)
perplexity, its change, greedy agreement and the mean KL. Issue 17's weight target (perplexity
within 1 % of bf16, top-1 ≥ 98 %) can then be read off the reference library's own arithmetic.

Run where torch, transformers and gguf are (the GPU machine's python plus the gguf wheel, or
scripts/torch-venv.sh's venv); CPU, float32:
    python3 scripts/w8-fidelity-reference.py SmolLM2-135M-Instruct.Q4_1.gguf [out.json]
"""
import json
import math
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "tests/fixtures/smollm2/reference.json"
PERPLEXITY = ROOT / "tests/fixtures/smollm2/perplexity.json"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0
INT8_MAX = 127.0


def quantize_dequantize(x, fmt, per_row=True):
    """x (2-D, float32) through `fmt` ("fp8" or "int8") and back, one scale per row or per tensor."""
    top = E4M3_MAX if fmt == "fp8" else INT8_MAX
    amax = x.abs().amax(dim=1, keepdim=True) if per_row else x.abs().amax()
    scale = amax / top
    # A zero row keeps zeros (scale 0 would divide by zero).
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = (x / safe).clamp(-top, top)
    codes = y.to(torch.float8_e4m3fn).to(torch.float32) if fmt == "fp8" else torch.round(y)
    return codes * scale


def linears(model):
    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name in LINEARS:
                if hasattr(module, name):
                    yield getattr(module, name)


def apply_variant(model, original, variant):
    """Sets every decoder linear's weight for `variant` from `original` (id(linear) -> float32 weight) and
    returns the activation hooks it registered (to remove afterwards)."""
    weights, per_row, acts = variant["weights"], variant.get("per_row", True), variant.get("acts")
    hooks = []
    for lin in linears(model):
        w = original[id(lin)]
        if weights == "f32":
            q = w
        elif weights == "bf16":
            q = w.to(torch.bfloat16).to(torch.float32)
        else:
            q = quantize_dequantize(w, weights, per_row)
        lin.weight.data.copy_(q)
        if acts:
            def pre_hook(_module, args, fmt=acts):
                x = args[0]
                return (quantize_dequantize(x.reshape(-1, x.shape[-1]), fmt).reshape(x.shape),)
            hooks.append(lin.register_forward_pre_hook(pre_hook))
    return hooks


def hadamard(n):
    """The orthonormal Walsh-Hadamard matrix of order n (a power of two), Sylvester's construction."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def round_cache(x, how):
    """x [..., head_dim] as a KV cache of type `how` would hold it."""
    if how == "f32":
        return x
    if how == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if how == "fp8":  # scale 1, saturating
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    fmt = how.split("/")[0]  # "fp8/head", "int8/head": one scale per token and KV head
    return quantize_dequantize(x.reshape(-1, x.shape[-1]).float(), fmt).reshape(x.shape).to(x.dtype)


class CacheRounding:
    """Wraps transformers' eager attention so that the keys (after RoPE) and values it reads are
    rounded as `variant`'s cache holds them; `rotate`: the keys are rounded in the Hadamard basis
    (q and k rotated alike leave q·k unchanged, so rotating the rounded key back is the same)."""

    def __init__(self):
        self.original = modeling_llama.eager_attention_forward
        self.variant, self.calls = None, 0
        modeling_llama.eager_attention_forward = self

    def __call__(self, module, query, key, value, *args, **kwargs):
        self.calls += 1
        v = self.variant
        if v is not None:
            if v.get("rotate"):
                h = hadamard(key.shape[-1]).to(key.dtype)
                key = round_cache(key @ h, v["k"]) @ h.T
            else:
                key = round_cache(key, v["k"])
            value = round_cache(value, v["v"])
        return self.original(module, query, key, value, *args, **kwargs)


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(torch.float64)


def kl(p_logits, q_logits):
    """Mean over rows of KL(softmax p ‖ softmax q), in nats."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).mean())


def run(model, prompts, text):
    return [logits_of(model, ids) for ids in prompts], logits_of(model, text)


def compare(ref, got, text):
    (ref_prompts, ref_text), (got_prompts, got_text) = ref, got
    diffs, top1, positions, kls = [], 0, 0, []
    for r, g in zip(ref_prompts, got_prompts):
        ids = torch.topk(r, 10, dim=-1).indices
        diffs.append((r.gather(-1, ids) - g.gather(-1, ids)).abs())
        top1 += int((g.argmax(-1) == ids[:, 0]).sum())
        positions += r.shape[0]
        kls.append(kl(r, g) * r.shape[0])
    d = torch.cat([x.flatten() for x in diffs])
    logp = torch.log_softmax(got_text, -1)
    nll = -logp[torch.arange(len(text) - 1), torch.tensor(text[1:])]
    return {
        "mean_abs": float(d.mean()), "max_abs": float(d.max()), "top1": top1, "positions": positions,
        "kl_mean": sum(kls) / positions, "perplexity": math.exp(float(nll.mean())),
        # Positions that predict a token of the text (the last one predicts past it), as eval counts.
        "text_top1": int((got_text[:-1].argmax(-1) == ref_text[:-1].argmax(-1)).sum()), "text_positions": len(text) - 1,
        "text_kl": kl(ref_text[:-1], got_text[:-1]),
    }


VARIANTS = [
    {"name": "bf16 weights", "weights": "bf16"},
    {"name": "fp8 e4m3 W8A16, per row", "weights": "fp8"},
    {"name": "fp8 e4m3 W8A16, per tensor", "weights": "fp8", "per_row": False},
    {"name": "fp8 e4m3 W8A8, per row x per token (--quantization fp8)", "weights": "fp8", "acts": "fp8"},
    {"name": "int8 W8A16, per row", "weights": "int8"},
    {"name": "int8 W8A8, per row x per token (--quantization int8)", "weights": "int8", "acts": "int8"},
]


KV_VARIANTS = [
    {"name": "KV bf16", "k": "bf16", "v": "bf16"},
    {"name": "KV fp8, scale 1 (`fp8-plain`)", "k": "fp8", "v": "fp8"},
    {"name": "KV fp8, scale 1, Hadamard q/k (`fp8`)", "k": "fp8", "v": "fp8", "rotate": True},
    {"name": "KV fp8 per token and head, Hadamard q/k (`fp8-scaled`)", "k": "fp8/head", "v": "fp8/head", "rotate": True},
    {"name": "KV k bf16 / v fp8 per token and head", "k": "bf16", "v": "fp8/head"},
    {"name": "KV int8 per token and head (`int8`)", "k": "int8/head", "v": "int8/head"},
]

TABLE_HEAD = ("| {} (against float32, same weights) | mean \\|Δ\\| | max \\|Δ\\| | top-1 | KL mean | perplexity | Δppl | text top-1 | text KL |{}\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |{}")


def print_row(got, extra=""):
    print(f"| {got['name']} | {got['mean_abs']:.4f} | {got['max_abs']:.3f} | {got['top1']}/{got['positions']} | "
          f"{got['kl_mean']:.5f} | {got['perplexity']:.3f} | {got['dppl_pct']:+.2f} % | "
          f"{got['text_top1']}/{got['text_positions']} | {got['text_kl']:.5f} |{extra}")


def main(gguf, out=None):
    gguf = Path(gguf)
    torch.set_num_threads(min(16, torch.get_num_threads()))
    # transformers 5 names the argument `dtype`, 4.x `torch_dtype`.
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    # Eager attention: its keys and values are what a KV cache would hold (CacheRounding).
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, attn_implementation="eager", **{dtype_arg: torch.float32}).eval()
    rounding = CacheRounding()
    # The GGUF has no output.weight: the LM head is the embedding (as the fixture scripts tie it).
    model.lm_head.weight = model.model.embed_tokens.weight
    reference = json.loads(REFERENCE.read_text())
    prompts = [p["input_ids"] for p in reference["prompts"]]
    text = json.loads(PERPLEXITY.read_text())["input_ids"]
    original = {id(lin): lin.weight.data.clone() for lin in linears(model)}

    base = run(model, prompts, text)
    # Sanity: the float32 run is the fixtures' (top-10 logits, perplexity).
    worst = max(
        float((torch.tensor(pos["top10_logits"], dtype=torch.float64) - base[0][i][j][pos["top10_ids"]]).abs().max())
        for i, p in enumerate(reference["prompts"]) for j, pos in enumerate(p["positions"])
    )
    f32 = compare(base, base, text)
    fixture_ppl = json.loads(PERPLEXITY.read_text())["perplexity"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU float32, {len(text)} text tokens")
    print(f"float32 run vs tests/fixtures/smollm2/reference.json: max |Δ| {worst:.2e} over the top-10 logits; "
          f"perplexity {f32['perplexity']:.4f} (perplexity.json: {fixture_ppl})")
    print()
    print(TABLE_HEAD.format("weights", "", ""))
    rows = []
    for variant in VARIANTS:
        hooks = apply_variant(model, original, variant)
        got = compare(base, run(model, prompts, text), text)
        for h in hooks:
            h.remove()
        got["name"] = variant["name"]
        got["dppl_pct"] = 100 * (got["perplexity"] / f32["perplexity"] - 1)
        rows.append(got)
        print_row(got)
    apply_variant(model, original, {"weights": "f32"})

    kv_rows = []
    if rounding.calls == 0:
        print("\nKV table skipped: this transformers does not call modeling_llama.eager_attention_forward")
    else:
        print()
        print(TABLE_HEAD.format("KV cache", " × bf16's mean \\|Δ\\| |", " --- |"))
        for variant in KV_VARIANTS:
            rounding.variant = variant
            got = compare(base, run(model, prompts, text), text)
            got["name"] = variant["name"]
            got["dppl_pct"] = 100 * (got["perplexity"] / f32["perplexity"] - 1)
            kv_rows.append(got)
            print_row(got, f" {got['mean_abs'] / kv_rows[0]['mean_abs']:.2f} |")
        rounding.variant = None
    if out:
        Path(out).write_text(json.dumps({
            "generated_by": {"script": "scripts/w8-fidelity-reference.py", "torch": torch.__version__,
                             "transformers": transformers.__version__, "dtype": "float32", "device": "cpu"},
            "float32": f32, "fixture_max_abs": worst, "variants": rows, "kv_variants": kv_rows,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
