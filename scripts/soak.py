#!/usr/bin/env python3
"""Soak test of peregrine-agent: starts the agent with LoRA on, runs --streams concurrent streaming
completions for --minutes (base model and adapters, some clients killed mid-stream), loads and
unloads adapters meanwhile, samples the agent's RSS, then sends SIGTERM with streams in flight and
waits for a clean exit. Prints requests sent / completed / refused / killed / unreachable / lost and
RSS over time; exits 1 if any request was lost or the agent did not exit 0.

Every request ends in exactly one class:
  completed    200, the stream ended with a finish_reason and [DONE]
  refused      an error answer: a non-200 status with an error body, or an SSE error event
  killed       this client closed the connection on purpose mid-stream (a "client kill")
  unreachable  no HTTP answer at all (connection refused: the agent stopped listening after SIGTERM)
  lost         accepted (200) but the stream ended with neither a finish nor an error: must be 0

    scripts/soak.sh                  # builds the agent, fetches the test model, runs 3 minutes
    scripts/soak.py --agent target/debug/peregrine-agent --model M --adapters DIR_A DIR_B --minutes 1

Standard library only.
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

PROMPTS = ["Tell me a story about a dragon.", "What is the capital of France?", "Write a haiku about rivers.",
           "List three colours.", "Explain gravity to a child.", "Hello"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {k: 0 for k in ("sent", "completed", "refused", "killed", "unreachable", "lost")}
        self.refusals = {}
        self.lost_examples = []

    def add(self, key, detail=None):
        with self.lock:
            self.c[key] += 1
            if key == "refused" and detail:
                self.refusals[detail] = self.refusals.get(detail, 0) + 1
            if key == "lost" and detail and len(self.lost_examples) < 5:
                self.lost_examples.append(detail)


def one_stream(port, model, kill_after, counts, timeout):
    """One streaming completion; `kill_after` tokens then close (None: read to the end). Returns
    False when the agent did not answer at all."""
    counts.add("sent")
    body = json.dumps({"model": model, "prompt": random.choice(PROMPTS), "max_tokens": random.randint(4, 48),
                       "temperature": 0.7, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError):
        counts.add("unreachable")
        conn.close()
        return False
    if resp.status != 200:
        try:
            code = json.loads(resp.read() or b"{}").get("error", {}).get("code", str(resp.status))
        except (ValueError, OSError, http.client.HTTPException):
            code = str(resp.status)
        counts.add("refused", f"{resp.status} {code}")
        conn.close()
        return
    tokens, finished, done = 0, False, False
    try:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                counts.add("refused", f"stream {event['error'].get('code')}")
                conn.close()
                return
            choice = (event.get("choices") or [{}])[0]
            tokens += 1
            if choice.get("finish_reason"):
                finished = True
            if kill_after is not None and tokens >= kill_after and not finished:
                # A client that goes away mid-stream: the server must abort and free the request.
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
                counts.add("killed")
                return
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError, ValueError) as e:
        counts.add("lost", f"{model}: {type(e).__name__} after {tokens} events")
        conn.close()
        return
    conn.close()
    if finished and done:
        counts.add("completed")
    else:
        counts.add("lost", f"{model}: ended after {tokens} events, finish={finished}, done={done}")


def admin(port, path, payload):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (ConnectionError, socket.timeout, http.client.HTTPException, OSError):
        return None
    finally:
        conn.close()


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def wait_ready(port, proc, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"the agent exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return
        except (ConnectionError, socket.timeout, http.client.HTTPException, OSError):
            pass
        time.sleep(0.2)
    sys.exit("the agent did not become ready in time")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", required=True, help="the peregrine-agent binary")
    p.add_argument("--model", required=True)
    p.add_argument("--adapters", nargs="+", required=True, help="PEFT adapter folders")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--kill-fraction", type=float, default=0.2, help="share of streams the client kills mid-stream")
    p.add_argument("--admin-every", type=float, default=2.0, help="seconds between adapter loads/unloads")
    p.add_argument("--rss-every", type=float, default=10.0)
    p.add_argument("--grace", type=int, default=20, help="the agent's --shutdown-grace-period seconds")
    p.add_argument("--threads", type=int, default=2, help="the CPU backend's threads")
    p.add_argument("--log", default="soak-agent.log")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    random.seed(args.seed)

    port = free_port()
    cmd = [args.agent, "serve", "--model", args.model, "--served-model-name", "base", "--host", "127.0.0.1",
           "--port", str(port), "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16",
           "--max-model-len", "1024", "--max-num-seqs", str(max(4, args.streams)), "--threads", str(args.threads),
           "--shutdown-grace-period", str(args.grace), "--log-format", "json"]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"agent pid {proc.pid} on port {port}; log in {args.log}", flush=True)
    wait_ready(port, proc, 300)

    names = [f"ad{i}" for i in range(len(args.adapters))]
    for name, path in zip(names, args.adapters):
        assert admin(port, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}) == 200, name
    counts = Counts()
    stop = threading.Event()
    terminated = threading.Event()
    admin_log = {"load": 0, "unload": 0, "failed": 0}

    def worker(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            model = rng.choice(["base"] + names + ["churn"])
            kill = rng.randint(1, 8) if rng.random() < args.kill_fraction else None
            if one_stream(port, model, kill, counts, timeout=120) is False:
                if terminated.is_set():
                    return  # the agent stopped listening after SIGTERM: this client is done
                time.sleep(0.1)  # not expected before SIGTERM; never spin

    def churn():
        # "churn" is loaded from a rotating adapter and unloaded again while requests name it
        # (those get 404 while it is absent); the other names are replaced in place now and then.
        rng = random.Random(args.seed + 1000)
        loaded = False
        while not stop.wait(args.admin_every) and not terminated.is_set():
            if loaded and rng.random() < 0.5:
                status = admin(port, "/v1/unload_lora_adapter", {"lora_name": "churn"})
                key = "unload"
                loaded = status != 200
            else:
                status = admin(port, "/v1/load_lora_adapter", {"lora_name": "churn", "lora_path": rng.choice(args.adapters)})
                key = "load"
                loaded = loaded or status == 200
            admin_log[key if status == 200 else "failed"] += 1

    rss = [(0.0, rss_kib(proc.pid))]
    t0 = time.time()
    threads = [threading.Thread(target=worker, args=(args.seed + i,), daemon=True) for i in range(args.streams)]
    threads.append(threading.Thread(target=churn, daemon=True))
    for t in threads:
        t.start()
    deadline = t0 + args.minutes * 60
    while time.time() < deadline:
        time.sleep(min(args.rss_every, max(0.0, deadline - time.time())))
        rss.append((time.time() - t0, rss_kib(proc.pid)))
        print(f"  t={rss[-1][0]:6.0f}s rss={rss[-1][1] / 1024:.0f} MiB {dict(counts.c)}", flush=True)

    # SIGTERM with streams in flight; the workers keep sending until the agent stops answering.
    print("SIGTERM", flush=True)
    terminated.set()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=args.grace + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed (did not exit in time)"
    stop.set()
    for t in threads:
        t.join(timeout=130)
    elapsed = time.time() - t0

    c = counts.c
    accounted = c["completed"] + c["refused"] + c["killed"] + c["unreachable"] + c["lost"]
    print()
    print(f"soak: {args.streams} streams, {elapsed:.0f} s, agent exit {code}")
    print(f"requests sent {c['sent']}  completed {c['completed']}  refused {c['refused']}  killed {c['killed']}  "
          f"unreachable {c['unreachable']}  lost {c['lost']}  (accounted {accounted})")
    print(f"refusals by kind: {json.dumps(counts.refusals, sort_keys=True)}")
    print(f"adapter admin: {admin_log}")
    print("RSS over time (s, MiB): " + ", ".join(f"{t:.0f}:{(r or 0) / 1024:.0f}" for t, r in rss))
    for example in counts.lost_examples:
        print(f"lost: {example}")
    ok = c["lost"] == 0 and code == 0 and accounted == c["sent"]
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
