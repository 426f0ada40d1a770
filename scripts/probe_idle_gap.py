#!/usr/bin/env python3
"""Probe (H200): how much slower GPU work runs after the GPU idled for a while, as it does while the host prepares
a call.

The benchmark times a call as flush, start event, call, end event. When the host needs time before the call's first
kernel, the GPU idles that long; this probe asks what the idle costs beyond its own length. A fixed workload (a
chain of bf16 matmuls, ``--work-ms`` long) is timed with an event recorded before a host delay of each length
(``time.sleep`` between the start event and the launches) and one recorded right before the launches: the second
interval is the workload's own time after that much idle. With the GPU busy (a sleep kernel queued first) the same
delays cost nothing. One JSON row per delay on stdout and in ``--out``.

    python scripts/probe_idle_gap.py --out /tmp/idle_gap.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6])
    ap.add_argument("--work-ms", type=float, default=3.5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = 4096
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def work(count):
        for _ in range(count):
            torch.mm(a, b)

    # matmuls per workload from one warm timing
    work(20)
    torch.cuda.synchronize()
    events[0].record()
    work(50)
    events[1].record()
    events[1].synchronize()
    count = max(1, round(args.work_ms / (events[0].elapsed_time(events[1]) / 50)))
    rows = []
    for delay in args.delays_ms:
        for busy in (False, True):
            gaps, times = [], []
            for _ in range(args.reps):
                flush.zero_()
                if busy:
                    torch.cuda._sleep(20_000_000)
                events[0].record()
                if delay:
                    time.sleep(delay * 1e-3)
                events[1].record()
                work(count)
                events[2].record()
                events[2].synchronize()
                gaps.append(events[0].elapsed_time(events[1]))
                times.append(events[1].elapsed_time(events[2]))
            row = dict(delay_ms=delay, busy=busy, matmuls=count, idle_ms=float(torch.tensor(gaps).median()),
                       work_ms=float(torch.tensor(times).median()), work_p95_ms=float(torch.tensor(times).quantile(0.95)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
