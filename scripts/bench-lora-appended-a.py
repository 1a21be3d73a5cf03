#!/usr/bin/env python3
"""What a LoRA shrink inside the base GEMM would cost (issue 16's fusion plan, docs/benchmarks.md
session 29): every slot's A rows appended to a projection's weight, so that one cuBLAS GEMM computes
y = x · Wᵀ and u = x · Aᵀ together. Times torch's bf16 matmul (cuBLAS) for the Llama-3.1-8B
projection groups with and without the extra rows, on a GPU machine (torch only, no Rust):

    python3 scripts/bench-lora-appended-a.py [adapters=4] [rank=32]

Prints µs per GEMM for each group and token count, the difference, and the difference over a
32-layer step (ms); and beside it the expand as one batched cuBLAS GEMM added in place (tokens
grouped by adapter, `y[slot] += t[slot] · B[slot]`, B of rank × the group's whole output: the bytes
of B the real expand reads), what a serial expand launched on its own would cost at cuBLAS's
efficiency. Each figure is the median of 20 replays of a CUDA graph of 50 back-to-back launches."""
import sys

import torch

adapters = int(sys.argv[1]) if len(sys.argv) > 1 else 4
rank = int(sys.argv[2]) if len(sys.argv) > 2 else 32
h, q, kv, inter, layers = 4096, 4096, 1024, 14336, 32
# (name, fan-in, fan-out, modules in the group)
groups = [("q|k|v", h, q + 2 * kv, 3), ("o", q, h, 1), ("gate|up", h, 2 * inter, 2), ("down", inter, h, 1)]


def time_us(fn, reps=20, inner=50):
    # The launches are captured in a CUDA graph and replayed: GPU time, not torch's host overhead
    # (about 10-16 µs a call, more than these small GEMMs take).
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    times.sort()
    return times[len(times) // 2]


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {adapters} adapters of rank {rank}")
print(f"{'group':<8} {'tokens':>6} {'base us':>9} {'+A rows us':>11} {'extra us':>9} {'x32 layers ms':>14} {'expand us':>10} {'x32 ms':>7}")
for m in (64, 256):
    total, total_expand = 0.0, 0.0
    for name, k, n, modules in groups:
        extra = modules * adapters * rank
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n + extra, k, device="cuda", dtype=torch.bfloat16) * 0.02
        y_base = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        y_both = torch.empty(m, n + extra, device="cuda", dtype=torch.bfloat16)
        w_base = w[:n]
        base = time_us(lambda: torch.matmul(x, w_base.t(), out=y_base))
        both = time_us(lambda: torch.matmul(x, w.t(), out=y_both))
        total += both - base
        t = torch.randn(adapters, m // adapters, rank, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(adapters, rank, n, device="cuda", dtype=torch.bfloat16) * 0.02
        y3 = torch.zeros(adapters, m // adapters, n, device="cuda", dtype=torch.bfloat16)
        expand = time_us(lambda: y3.baddbmm_(t, b))
        total_expand += expand
        print(f"{name:<8} {m:>6} {base:>9.1f} {both:>11.1f} {both - base:>9.1f} {(both - base) * layers / 1e3:>14.3f} {expand:>10.1f} {expand * layers / 1e3:>7.3f}")
    print(f"{'all':<8} {m:>6} {'':>9} {'':>11} {total:>9.1f} {total * layers / 1e3:>14.3f} {total_expand:>10.1f} {total_expand * layers / 1e3:>7.3f}")
