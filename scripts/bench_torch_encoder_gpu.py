#!/usr/bin/env python3
"""An encoder on torch + transformers on the GPU, measured like `encoder_bench --device cuda`.

Run (on the GPU machine, where torch and transformers are installed):
    python3 scripts/bench_torch_encoder_gpu.py <encoder folder> [float32|bfloat16|float16] [--model-only]

Sentence-Transformers' MiniLM recipe without needing the package: AutoModel, mean pooling over the
attention mask, L2 normalisation (what all-MiniLM-L6-v2's modules.json asks for). float32 runs with
TF32 off (the reference precision of Peregrine's f32 path). For input lengths 16/128/512 tokens
(texts of repeated words) prints, at concurrency 1, one request after another (latency p50/p99,
sequences/s), and as batch throughput, batches of 64 equal texts (all the same length, so padding
wastes nothing): sequences/s and tokens/s. Each timed call ends with a synchronize (the embeddings
are copied to the host, as a server must).

`--model-only` times the model alone, as `encoder_bench --forward-only` does: batches of 8192 tokens
(512 sequences of 16, 64 of 128, 16 of 512), tokenized once before the clock starts; each timed call
runs the model, the pooling and normalisation, and copies the embeddings to the host.
"""
import sys
import time

import torch
from transformers import AutoModel, AutoTokenizer

args = [a for a in sys.argv[1:] if not a.startswith("--")]
model_only = "--model-only" in sys.argv[1:]
folder = args[0]
dtype = getattr(torch, args[1] if len(args) > 1 else "float32")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
device = torch.device("cuda")
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval()


@torch.inference_mode()
def embed(texts):
    return embed_tokens(tokenizer(texts, padding=True, truncation=True, max_length=512, return_tensors="pt"))


@torch.inference_mode()
def embed_tokens(batch):
    batch = batch.to(device)
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()


def timed(call, times):
    """Runs `call` `times` times; returns (wall seconds, sorted per-call seconds)."""
    per_call = []
    start = time.perf_counter()
    for _ in range(times):
        began = time.perf_counter()
        call()
        per_call.append(time.perf_counter() - began)
    return time.perf_counter() - start, sorted(per_call)


def percentile_ms(sorted_seconds, q):
    return sorted_seconds[min(len(sorted_seconds) - 1, round((len(sorted_seconds) - 1) * q))] * 1e3


print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}, dtype {dtype}, TF32 off, "
      f"attention {model.config._attn_implementation}")
if model_only:
    print(f"{'len':>6} {'seqs':>5} {'forwards':>9} {'seq/s':>10} {'tok/s':>11} {'ms/fwd':>9}")
    for length in (16, 128, 512):
        seqs = 8192 // length
        batch = tokenizer(["hello " * (length - 2)] * seqs, padding=True, return_tensors="pt")
        assert batch["input_ids"].shape == (seqs, length)
        for _ in range(3):
            embed_tokens(batch)
        forwards = 8 * 16
        wall, _ = timed(lambda: embed_tokens(batch), forwards)
        print(f"{length:>6} {seqs:>5} {forwards:>9} {forwards * seqs / wall:>10.1f} "
              f"{forwards * seqs * length / wall:>11.0f} {wall * 1e3 / forwards:>9.3f}")
    sys.exit(0)
print(f"{'len':>6} {'mode':>9} {'reqs':>6} {'seq/s':>10} {'tok/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
for length in (16, 128, 512):
    text = "hello " * (length - 2)
    assert len(tokenizer(text)["input_ids"]) == length
    for _ in range(3):
        embed([text])
        embed([text] * 64)
    singles = 16 * max(1024 // length, 4)
    wall, lat = timed(lambda: embed([text]), singles)
    print(f"{length:>6} {'conc 1':>9} {singles:>6} {singles / wall:>10.1f} {singles * length / wall:>10.0f} "
          f"{percentile_ms(lat, 0.5):>9.2f} {percentile_ms(lat, 0.99):>9.2f}")
    batches = 16 * max(128 // length, 1)
    wall, _ = timed(lambda: embed([text] * 64), batches)
    seqs = 64 * batches
    print(f"{length:>6} {'batch 64':>9} {seqs:>6} {seqs / wall:>10.1f} {seqs * length / wall:>10.0f} {'':>9} {'':>9}")
