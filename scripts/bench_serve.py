#!/usr/bin/env python3
"""Load generator for a running peregrine-agent (or any OpenAI-compatible server), in the manner of
vLLM's benchmark_serving.py: Poisson arrivals at --request-rate (inf: all at once), streaming
completions, and a report of throughput, TTFT, TPOT and ITL percentiles.

    scripts/bench_serve.py --url http://127.0.0.1:8000 --model smollm2 --request-rate 4 --num-prompts 64

Prompts: random words (--input-len words each) or one per line from --prompts-file.  Standard library only.
"""

import argparse
import http.client
import json
import random
import statistics
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain story dragon castle garden music").split()


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one_request(url, model, prompt, max_tokens, api_key):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0, "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    u = urllib.parse.urlsplit(url)
    start = time.perf_counter()
    ttft, times, usage, error = None, [], None, None
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                break
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                times.append(now)
        conn.close()
    except OSError as e:
        error = str(e)
    end = time.perf_counter()
    if error or ttft is None:
        return {"error": error or "no tokens"}
    out_tokens = usage["completion_tokens"] if usage else len(times)
    itl = [b - a for a, b in zip(times, times[1:])]
    tpot = (end - start - ttft) / (out_tokens - 1) if out_tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "latency": end - start, "out": out_tokens,
            "in": usage["prompt_tokens"] if usage else 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64, help="words per random prompt")
    ap.add_argument("--output-len", type=int, default=64, help="max_tokens (ignore_eos is set)")
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if args.prompts_file:
        pool = [l.rstrip("\n") for l in open(args.prompts_file) if l.strip()]
        prompts = [pool[i % len(pool)] for i in range(args.num_prompts)]
    else:
        prompts = [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_prompts)]
    # One thread per in-flight request: the client only waits on sockets.
    with ThreadPoolExecutor(max_workers=max(1, args.num_prompts)) as pool:
        t0 = time.perf_counter()
        futures = []
        for p in prompts:
            futures.append(pool.submit(one_request, args.url.rstrip("/"), args.model, p, args.output_len, args.api_key))
            if args.request_rate != float("inf"):
                time.sleep(rng.expovariate(args.request_rate))
        results = [f.result() for f in futures]
        duration = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out_tokens = sum(r["out"] for r in ok)
    in_tokens = sum(r["in"] for r in ok)
    ms = lambda xs, p: 1000 * percentile(xs, p)
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    print(f"{'Successful requests:':<40}{len(ok)}")
    print(f"{'Failed requests:':<40}{len(errors)}" + (f"  (first: {errors[0]})" if errors else ""))
    print(f"{'Benchmark duration (s):':<40}{duration:.2f}")
    print(f"{'Total input tokens:':<40}{in_tokens}")
    print(f"{'Total generated tokens:':<40}{out_tokens}")
    print(f"{'Request throughput (req/s):':<40}{len(ok) / duration:.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{out_tokens / duration:.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{(in_tokens + out_tokens) / duration:.2f}")
    for name, xs in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl)):
        mean = 1000 * statistics.mean(xs) if xs else float("nan")
        print(f"{name + ' (ms) mean/p50/p90/p99:':<40}{mean:.1f} / {ms(xs, 50):.1f} / {ms(xs, 90):.1f} / {ms(xs, 99):.1f}")


if __name__ == "__main__":
    main()
