#!/usr/bin/env python3
"""Probe (H200): how much of the benchmarked attention time is the GPU waiting for the host, and where.

``bench_attention.py`` times a call as flush, event, call, event: host work the GPU waits for counts. Per
(head dim, pattern) at 64K (its shapes: B=1, HQ=32, HKV=8, bf16) this probe times the public forward, the
backward alone (``autograd.grad`` on a kept graph) and forward + backward three ways: as the benchmark does,
with the GPU held busy by a sleep kernel queued first (device time only), and the host milliseconds per call
(``perf_counter``, GPU kept busy), split by an event between forward and backward, and after sleeps of
several lengths queued ahead (host work that outlasts the sleep shows). ``--host-profile DIR``: cProfile tables of
the host work (forward and backward threads). Then one forward + backward runs under ``torch.profiler``: the GPU's idle
gaps between kernels longer than ``--gap-us``, each with the host calls that ran during it, and every host
call that waits for the device (synchronize, blocking copies). One JSON row per case on stdout and in
``--out``; ``--trace DIR`` also writes the chrome traces.

    python scripts/probe_host_gaps.py --out /tmp/host_gaps.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import HKV, HQ, PATTERNS, build_index, make_index, timeit  # noqa: E402
from sparse_train.kernels.op import triton_sparse_attention  # noqa: E402

_WAITS = ("Synchronize", "cudaMemcpy(", "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaEventSynchronize")


def host_ms(fn, calls: int = 10) -> float:
    """Host milliseconds per call while the GPU is busy (no call waits for the device, unless it syncs)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return elapsed


def after_sleep_ms(fn, cycles: int, reps: int = 15) -> float:
    """Median ms from an event recorded behind a sleep kernel of ``cycles`` to the end of fn(): host work
    that outlasts the sleep shows as time; 0 cycles is the benchmark's timing."""
    _flush = __import__("bench_attention")._flush
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        _flush()
        if cycles:
            torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(torch.tensor(times).median())


def split_ms(fwd, bwd_of, reps: int = 15):
    """Medians (forward part, backward part) of forward + backward timed as the benchmark does, with an event
    recorded between the two calls."""
    _flush = __import__("bench_attention")._flush
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    parts = []
    for _ in range(reps):
        _flush()
        events[0].record()
        out = fwd()
        events[1].record()
        bwd_of(out)
        events[2].record()
        events[2].synchronize()
        parts.append((events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])))
    t = torch.tensor(parts)
    return float(t[:, 0].median()), float(t[:, 1].median())


# (module, attribute) of the host steps the timeline marks; Triton kernels are marked by their ``run``
_TIMELINE_FUNCTIONS = (
    ("sparse_train.kernels.op", "check_attention_args"), ("sparse_train.kernels.op", "attention_schedule"),
    ("sparse_train.kernels.op", "sparse_attn_forward"), ("sparse_train.kernels.op", "sparse_attn_backward"),
    ("sparse_train.kernels.forward", "gluon_fwd_supported"), ("sparse_train.kernels.forward", "launch_fwd_gluon"),
    ("sparse_train.kernels.forward", "tma_operands"), ("sparse_train.kernels.backward", "kv_schedule"),
    ("sparse_train.kernels.backward", "tma_operands"), ("sparse_train.kernels.backward", "tma_descriptor"),
    ("sparse_train.kernels.backward", "gluon_call_supported"), ("sparse_train.kernels.backward", "launch_dq_gluon"),
    ("sparse_train.kernels.backward", "launch_dkdv_gluon"),
)
_TIMELINE_KERNELS = (
    ("sparse_train.kernels.forward", "_fwd_kernel"), ("sparse_train.kernels.backward", "_delta_kernel"),
    ("sparse_train.kernels.backward", "_dq_kernel"), ("sparse_train.kernels.backward", "_dkdv_kernel"),
    ("sparse_train.kernels.backward", "_dkdv_finish_kernel"), ("sparse_train.kernels.schedule", "_kv_schedule_kernel"),
    ("sparse_train.kernels.backward_gluon", "_dq_gluon_kernel"),
    ("sparse_train.kernels.backward_gluon", "_dkdv_gluon_kernel"),
    ("sparse_train.kernels.forward_gluon", "_fwd_gluon_kernel"),
)


def host_timeline(fn, calls: int = 7) -> list[dict]:
    """When, in host milliseconds from the start of fn(), each marked step of the call begins and ends (GPU kept
    busy, so no launch waits): the medians over ``calls`` calls, in order of their start. A kernel launch that
    comes late in the host's work is GPU time lost whenever the GPU has nothing queued before it."""
    import importlib

    marks: list[tuple[str, float, float]] = []
    clock = time.perf_counter

    def wrap(name, inner):
        def timed(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                marks.append((name, start, clock()))
        return timed

    restore = []
    for module_name, attr in _TIMELINE_FUNCTIONS:
        module = importlib.import_module(module_name)
        if hasattr(module, attr):
            restore.append((module, attr, getattr(module, attr)))
            setattr(module, attr, wrap(attr, getattr(module, attr)))
    for module_name, attr in _TIMELINE_KERNELS:
        kernel = getattr(importlib.import_module(module_name), attr, None)
        if kernel is not None:
            restore.append((kernel, "run", None))
            kernel.run = wrap(attr, kernel.run)
    runs = []
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        for _ in range(calls):
            marks.clear()
            t0 = clock()
            fn()
            runs.append([(name, (a - t0) * 1e3, (b - t0) * 1e3) for name, a, b in marks] + [("end", 0.0, (clock() - t0) * 1e3)])
        torch.cuda.synchronize()
    finally:
        for owner, attr, original in reversed(restore):
            if original is None:
                del owner.run
            else:
                setattr(owner, attr, original)
    steps = []
    for i, (name, _, _) in enumerate(runs[0]):
        starts = sorted(run[i][1] for run in runs)
        ends = sorted(run[i][2] for run in runs)
        steps.append(dict(step=name, start_ms=round(starts[len(starts) // 2], 3), end_ms=round(ends[len(ends) // 2], 3)))
    return sorted(steps, key=lambda s: s["start_ms"])


def device_timeline(fn, busy: bool, reps: int = 9) -> list[dict]:
    """When, in GPU milliseconds from a start event recorded before fn(), each marked kernel starts and ends: a
    CUDA event is recorded right before and right after every launch of a kernel of ``_TIMELINE_KERNELS``
    (medians over ``reps`` calls, L2 flushed before each as the benchmark does; ``busy``: a sleep kernel queued
    first, as for device time). A kernel whose start lies after the previous one's end waited for the host; a
    kernel that takes longer here than with ``busy`` ran slower (clocks)."""
    import importlib

    _flush = __import__("bench_attention")._flush
    pending: list[tuple[str, object, object]] = []

    def wrap(name, inner):
        def timed(*args, **kwargs):
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            try:
                return inner(*args, **kwargs)
            finally:
                after.record()
                pending.append((name, before, after))
        return timed

    kernels = []
    for module_name, attr in _TIMELINE_KERNELS:
        kernel = getattr(importlib.import_module(module_name), attr, None)
        if kernel is not None:
            kernels.append(kernel)
            kernel.run = wrap(attr, kernel.run)
    runs = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        fn()
        torch.cuda.synchronize()
        for _ in range(reps):
            pending.clear()
            _flush()
            if busy:
                torch.cuda._sleep(20_000_000)
            start.record()
            fn()
            end.record()
            end.synchronize()
            runs.append([(name, start.elapsed_time(a), start.elapsed_time(b)) for name, a, b in pending]
                        + [("end", start.elapsed_time(end), start.elapsed_time(end))])
    finally:
        for kernel in kernels:
            del kernel.run
    steps = []
    for i, (name, _, _) in enumerate(runs[0]):
        starts = sorted(run[i][1] for run in runs)
        ends = sorted(run[i][2] for run in runs)
        steps.append(dict(kernel=name, start_ms=round(starts[len(starts) // 2], 3),
                          end_ms=round(ends[len(ends) // 2], 3)))
    return steps


def host_profile(fn, calls: int = 20, top: int = 35) -> str:
    """cProfile of ``calls`` calls of fn() with the GPU busy (Python 3.12's profiler sees every thread, so the
    backward launcher on autograd's device thread is in the same table as the forward)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    text.write(f"==== {calls} calls\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
    return text.getvalue()


def gaps(prof, gap_us: float):
    """GPU idle gaps between consecutive kernels/copies/memsets and the host calls overlapping each."""
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    device = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    found, busy_us = [], 0.0
    for prev, nxt in zip(device, device[1:]):
        busy_us += prev.time_range.end - prev.time_range.start
        idle = nxt.time_range.start - prev.time_range.end
        if idle < gap_us:
            continue
        lo, hi = prev.time_range.end, nxt.time_range.start
        during = sorted({e.name for e in host if e.time_range.start < hi and e.time_range.end > lo
                         and e.time_range.end - e.time_range.start < 5 * (hi - lo)})
        found.append(dict(after=prev.name[:60], before=nxt.name[:60], idle_us=round(idle, 1),
                          host_calls=during[:25]))
    span = device[-1].time_range.end - device[0].time_range.start if device else 0.0
    waits = [dict(name=e.name, us=round(e.time_range.end - e.time_range.start, 1))
             for e in host if any(w in e.name for w in _WAITS)]
    kernels = [dict(name=e.name[:60], us=round(e.time_range.end - e.time_range.start, 1)) for e in device]
    return dict(gpu_span_us=round(span, 1), gpu_busy_us=round(busy_us, 1), gaps=found, host_waits=waits,
                device_ops=kernels)


def case(d: int, pattern: str, n: int, args, results):
    pat = PATTERNS[pattern]
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for h in (HQ, HKV, HKV, HQ))
    idx, plan = build_index(make_index(n, pat, device="cuda"), n, pat)
    options = {"plan": plan}
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd():
        return triton_sparse_attention(q, k, v, idx, kernel_options=options)

    kept, _ = triton_sparse_attention(qg, kg, vg, idx, kernel_options=options)

    def bwd():
        torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True)

    def fwd_bwd():
        out, _ = triton_sparse_attention(qg, kg, vg, idx, kernel_options=options)
        torch.autograd.grad(out, (qg, kg, vg), do)

    row = dict(N=n, D=d, pattern=pattern)
    for name, fn in (("fwd", fwd), ("bwd", bwd), ("fwdbwd", fwd_bwd)):
        row[f"{name}_ms"], row[f"{name}_p95_ms"], _ = timeit(fn)
        row[f"{name}_device_ms"], _, _ = timeit(fn, busy=True)
        row[f"{name}_host_ms"] = host_ms(fn)
    row["split_fwd_ms"], row["split_bwd_ms"] = split_ms(
        lambda: triton_sparse_attention(qg, kg, vg, idx, kernel_options=options)[0],
        lambda out: torch.autograd.grad(out, (qg, kg, vg), do))
    # ~1.9 GHz: 2e6 cycles ~ 1 ms of sleep ahead of the call
    row["fwdbwd_after_sleep_ms"] = {str(c): after_sleep_ms(fwd_bwd, c) for c in
                                    (0, 500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000)}
    row["timeline"] = host_timeline(fwd_bwd)
    for step in row["timeline"]:
        print("  host", json.dumps(step), flush=True)
    for busy in (False, True):
        row[f"device_timeline_{'busy' if busy else 'benchmark'}"] = steps = device_timeline(fwd_bwd, busy)
        for step in steps:
            print(f"  gpu ({'busy' if busy else 'as benchmarked'})", json.dumps(step), flush=True)
    if args.host_profile:
        os.makedirs(args.host_profile, exist_ok=True)
        with open(os.path.join(args.host_profile, f"host_profile_d{d}_{pattern}.txt"), "w") as f:
            f.write(host_profile(fwd_bwd))
    fwd_bwd()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    if args.no_profiler:
        results.append(row)
        print(json.dumps(row), flush=True)
        return
    with torch.profiler.profile(activities=activities) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    row.update(gaps(prof, args.gap_us))
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, f"host_gaps_d{d}_{pattern}.json"))
    results.append(row)
    brief = {key: (round(val, 3) if isinstance(val, float) else val) for key, val in row.items()
             if key not in ("gaps", "host_waits", "device_ops", "timeline", "device_timeline_busy",
                            "device_timeline_benchmark")}
    print(json.dumps(brief), flush=True)
    for gap in row["gaps"]:
        print("  gap", json.dumps(gap), flush=True)
    for wait in row["host_waits"]:
        print("  wait", json.dumps(wait), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--trace", default=None, help="directory for the chrome traces")
    ap.add_argument("--host-profile", default=None, help="directory for cProfile tables of the host work")
    ap.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []
    for d in args.head_dims:
        for pattern in args.patterns:
            case(d, pattern, args.n, args, results)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
