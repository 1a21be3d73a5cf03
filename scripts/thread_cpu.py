#!/usr/bin/env python3
"""Per-thread CPU time and voluntary context switches of a process between two moments, per token.

    scripts/thread_cpu.py PID snap FILE          # remember the counters
    scripts/thread_cpu.py PID diff FILE TOKENS   # print what each kind of thread used since, per token

CPU time comes from /proc/PID/task/*/schedstat (nanoseconds); tokio's workers are summed as one row.
"""
import json
import os
import sys


def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            run_ns = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
            status = open(f"/proc/{pid}/task/{tid}/status").read()
            switches = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
            out[tid] = (name, run_ns, switches)
        except (OSError, IndexError, ValueError):
            pass  # the thread ended meanwhile
    return out


def main():
    pid, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "snap":
        json.dump(snap(pid), open(path, "w"))
        return
    tokens = float(sys.argv[4])
    before = json.load(open(path))
    rows = {}
    for tid, (name, run_ns, switches) in snap(pid).items():
        _, run0, sw0 = before.get(tid, (name, 0, 0))
        key = "tokio-rt-worker" if name.startswith("tokio") else name
        row = rows.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += run_ns - run0
        row[2] += switches - sw0
    print(f"{'thread':<22}{'n':>3}{'CPU ms/token':>14}{'wakeups/token':>15}")
    for key, (n, ns, sw) in sorted(rows.items()):
        print(f"{key:<22}{n:>3}{ns / 1e6 / tokens:>14.3f}{sw / tokens:>15.2f}")


if __name__ == "__main__":
    main()
