#!/usr/bin/env python3
"""An encoder on torch + transformers on the GPU, measured like `encoder_bench --device cuda`.

Run (on the GPU machine, where torch and transformers are installed):
    python3 scripts/bench_torch_encoder_gpu.py <encoder folder> [float32|bfloat16|float16]

Sentence-Transformers' MiniLM recipe without needing the package: AutoModel, mean pooling over the
attention mask, L2 normalisation (what all-MiniLM-L6-v2's modules.json asks for). float32 runs with
TF32 off (the reference precision of Peregrine's f32 path). For input lengths 16/128/512 tokens
(texts of repeated words) prints, at concurrency 1, one request after another (latency p50/p99,
sequences/s), and as batch throughput, batches of 64 equal texts (all the same length, so padding
wastes nothing): sequences/s and tokens/s. Each timed call ends with a synchronize (the embeddings
are copied to the host, as a server must).
"""
import sys
import time

import torch
from transformers import AutoModel, AutoTokenizer

folder = sys.argv[1]
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
device = torch.device("cuda")
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval()


@torch.inference_mode()
def embed(texts):
    batch = tokenizer(texts, padding=True, truncation=True, max_length=512, return_tensors="pt").to(device)
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()


print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}, dtype {dtype}, TF32 off")
print(f"{'len':>6} {'mode':>9} {'reqs':>6} {'seq/s':>10} {'tok/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
for length in (16, 128, 512):
    text = "hello " * (length - 2)
    assert len(tokenizer(text)["input_ids"]) == length
    for _ in range(3):
        embed([text])
        embed([text] * 64)
    n1 = 16 * max(1024 // length, 4)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n1):
        s = time.perf_counter()
        embed([text])
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    lat.sort()
    p = lambda q: lat[min(len(lat) - 1, round((len(lat) - 1) * q))] * 1e3
    print(f"{length:>6} {'conc 1':>9} {n1:>6} {n1 / wall:>10.1f} {n1 * length / wall:>10.0f} {p(0.5):>9.2f} {p(0.99):>9.2f}")
    batches = 16 * max(128 // length, 1)
    t0 = time.perf_counter()
    for _ in range(batches):
        embed([text] * 64)
    wall = time.perf_counter() - t0
    nb = 64 * batches
    print(f"{length:>6} {'batch 64':>9} {nb:>6} {nb / wall:>10.1f} {nb * length / wall:>10.0f} {'':>9} {'':>9}")
