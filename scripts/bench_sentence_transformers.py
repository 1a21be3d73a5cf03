#!/usr/bin/env python3
"""Sentence-Transformers on the CPU, measured like `encoder_bench` measures Peregrine.

Run: $(scripts/torch-venv.sh) scripts/bench_sentence_transformers.py "$(scripts/fetch-encoder.sh)" [threads]

For input lengths 16/128/512 tokens (texts of repeated words) prints, at concurrency 1, one
`encode([text])` call after another (latency p50/p99, sequences/s), and as batch throughput,
`encode(texts, batch_size=64)` over 64·k equal texts (Sentence-Transformers' own batching; each batch is
padded to its longest text, here all equal so no padding is wasted): sequences/s and tokens/s.
"""
import statistics
import sys
import time

import torch
from sentence_transformers import SentenceTransformer

folder = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(threads)
model = SentenceTransformer(folder, device="cpu")
model.max_seq_length = 512
print(f"load average {open('/proc/loadavg').read().split()[0]}; sentence-transformers torch {torch.__version__} threads {torch.get_num_threads()}")
print(f"{'len':>6} {'mode':>9} {'reqs':>6} {'seq/s':>10} {'tok/s':>10} {'p50 ms':>9} {'p99 ms':>9}")
for length in (16, 128, 512):
    text = "hello " * (length - 2)
    assert len(model.tokenizer(text)["input_ids"]) == length
    model.encode([text])
    n1 = max(1024 // length, 4)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n1):
        s = time.perf_counter()
        model.encode([text], normalize_embeddings=True)
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    lat.sort()
    p = lambda q: lat[min(len(lat) - 1, round((len(lat) - 1) * q))] * 1e3
    print(f"{length:>6} {'conc 1':>9} {n1:>6} {n1 / wall:>10.1f} {n1 * length / wall:>10.0f} {p(0.5):>9.1f} {p(0.99):>9.1f}")
    nb = 64 * max(128 // length, 1)
    t0 = time.perf_counter()
    model.encode([text] * nb, batch_size=64, normalize_embeddings=True)
    wall = time.perf_counter() - t0
    print(f"{length:>6} {'batch 64':>9} {nb:>6} {nb / wall:>10.1f} {nb * length / wall:>10.0f} {'':>9} {'':>9}")
