"""How the benchmarks time a call: repeat loops and their statistics over :mod:`sparse_train.timing`'s stamps
(CUDA events on a GPU, ``perf_counter`` elsewhere), the one timer of the project.

* :func:`measure`: warm-up, then repeats of ``fn()`` until a count or time budget is reached, each repeat between
  two stamps; on a GPU the L2 cache is flushed before each repeat, and ``busy=True`` queues a sleep kernel before
  the start stamp so that host work the GPU would wait for is not counted (device time only). Median and p95.
* :func:`sustained`: ``fn()`` back to back for seconds, with nvidia-smi sampling power and SM clock
  (:class:`SmiSampler`): the card at its power and clock limits, as through a training run.
* :func:`graph_replay`: ``fn()`` captured once in a CUDA graph and replayed (no host work in the timed call).
* :func:`ceilings`: the device's copy bandwidth and bf16 matmul throughput, measured in the same process, the
  ceilings the benchmarks report their fraction of.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from typing import NamedTuple

import torch

from sparse_train.cuda_graphs import capture_cuda_graph
from sparse_train.timing import elapsed_ms, stamp

BUSY_CYCLES = 20_000_000
"""GPU clock cycles of the sleep kernel queued before a busy repeat: longer than the host part of any call timed."""

_FLUSH: torch.Tensor | None = None


class Timing(NamedTuple):
    """A timed call: median and p95 milliseconds over ``repeats`` repeats, and the fastest one."""

    median_ms: float
    p95_ms: float
    repeats: int
    min_ms: float


def quantile(samples, q):
    """The ``q`` quantile of ``samples``, linearly interpolated between the two nearest ranks (``torch.quantile``'s
    default)."""
    ordered = sorted(samples)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples) -> Timing:
    """Median, p95, count and minimum of millisecond samples."""
    return Timing(quantile(samples, 0.5), quantile(samples, 0.95), len(samples), min(samples))


def flush_l2():
    """Overwrite 256 MB of device memory, so the next call finds none of its data in the L2 cache."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    _FLUSH.zero_()


def measure(fn, *, device="cuda", warmup=2, min_reps=5, max_reps=50, budget_ms=400.0, flush=True, busy=False) -> Timing:
    """Time ``fn()`` on ``device``: ``warmup`` untimed calls, then repeats until ``max_reps`` or until both
    ``min_reps`` and ``budget_ms`` of measured time are reached. On CUDA, ``flush`` clears the L2 cache before each
    repeat and ``busy`` keeps the GPU occupied by a sleep kernel while the host issues ``fn()``."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < budget_ms):
        if cuda and flush:
            flush_l2()
        if cuda and busy:
            torch.cuda._sleep(BUSY_CYCLES)
        start = stamp(device)
        fn()
        times.append(elapsed_ms(start, stamp(device)))
    return summarize(times)


def parse_smi_samples(text):
    """``nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits`` lines -> [(watts, MHz)];
    lines that are not two numbers (a driver's "[N/A]", a cut last line) are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return samples


class SmiSampler:
    """Power draw and SM clock of the benchmark's GPU, sampled by nvidia-smi every 100 ms while the with-block
    runs; ``samples`` is empty where nvidia-smi is missing."""

    def __enter__(self):
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        try:
            self._proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "-i",
                    gpu,
                    "--query-gpu=power.draw,clocks.sm",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "100",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self._proc = None
        self.samples = []
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate(timeout=10)
            self.samples = parse_smi_samples(out)
        return False


def sustained(fn, seconds):
    """``fn()`` back to back for ``seconds`` with no flush and no idle GPU between calls, so the card settles at
    its power and clock limits as it does through a training run (:func:`measure` starts each call on a cool, idle
    GPU). Each call lies between two stamps; the host waits for call i - 1 before it issues call i + 1, so one call
    is always queued behind the running one and no more. Returns a dict: median / p95 ms and count of the calls
    that started in the second half, and the mean power draw (W) and SM clock (MHz) of the second half of
    nvidia-smi's samples (None without nvidia-smi)."""
    fn()
    torch.cuda.synchronize()
    calls = []
    with SmiSampler() as smi:
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds:
            began = time.perf_counter() - begin
            start = stamp("cuda")
            fn()
            calls.append((start, stamp("cuda"), began))
            if len(calls) > 1:
                elapsed_ms(*calls[-2][:2])  # waits for the previous call to finish
        torch.cuda.synchronize()
    late_calls = [(start, stop) for start, stop, began in calls if began >= seconds / 2] or [calls[-1][:2]]
    timing = summarize([elapsed_ms(start, stop) for start, stop in late_calls])
    late = smi.samples[len(smi.samples) // 2 :]
    return dict(
        ms=timing.median_ms,
        p95_ms=timing.p95_ms,
        calls=timing.repeats,
        watts=sum(w for w, _ in late) / len(late) if late else None,
        sm_mhz=sum(m for _, m in late) / len(late) if late else None,
    )


def record_sustained(row, fn, seconds, key="fwdbwd"):
    """``row[key + "_sustained_ms"]`` (p95, calls, W, MHz alike) of :func:`sustained`, and how much the allocator's
    reserve grew over it (GB); nothing when seconds is 0. A failure (out of memory) is reported in
    ``row[key + "_sustained_error"]``, the rest of the row still measured."""
    if seconds <= 0:
        return
    reserved = torch.cuda.memory_reserved()
    try:
        for name, value in sustained(fn, seconds).items():
            row[f"{key}_sustained_{name}"] = value
    except Exception as exc:  # report, don't crash the run
        row[f"{key}_sustained_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row[f"{key}_sustained_reserve_growth_GB"] = (torch.cuda.memory_reserved() - reserved) / 2**30
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def graph_replay(fn) -> Timing:
    """:func:`measure` (L2 flushed per repeat) of ``fn()`` replayed from a CUDA graph: fn is warmed up twice on a
    side stream and captured once (:func:`sparse_train.cuda_graphs.capture_cuda_graph`), then replayed, so no host
    work is left in the timed call (how a training step that graphs its layers runs it). Raises what the capture
    raises."""
    graph, _ = capture_cuda_graph(fn, warmup=2)
    try:
        return measure(graph.replay)
    finally:
        del graph
        torch.cuda.synchronize()


def record_graph_time(row, fn, key="fwdbwd", attempts=2):
    """``row[key + "_graph_ms"]`` (and p95) of fn() replayed from a CUDA graph, or ``row[key + "_graph_error"]``.
    A failed capture is tried again once and its error kept as ``key + "_graph_first_error"``."""
    for attempt in range(attempts):
        try:
            timing = graph_replay(fn)
            row[f"{key}_graph_ms"], row[f"{key}_graph_p95_ms"] = timing.median_ms, timing.p95_ms
            row.pop(f"{key}_graph_error", None)
            return
        except Exception as exc:  # report, don't crash the run
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
            row[f"{key}_graph_error" if attempt == attempts - 1 else f"{key}_graph_first_error"] = error
            torch.cuda.synchronize()


def peak_extra_mb(fn):
    """Peak device memory allocated by one ``fn()`` beyond what was allocated before it (MB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _copy_tbps():
    """Device copy bandwidth in TB/s: bytes read + bytes written by a 1 GiB copy, per second."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=3, min_reps=10, budget_ms=200).median_ms
    return 2 * n / (t * 1e-3) / 1e12


def ceilings(sustained_seconds=0.0):
    """Device copy bandwidth (TB/s, 1 GiB copied) and bf16 matmul throughput (TFLOP/s, 8192^3), each call on a cool
    GPU; with ``sustained_seconds`` also the matmul back to back that long (:func:`sustained`: the card at its power
    limit), the ceiling sustained timings are set against."""
    out = {"copy_TBps": _copy_tbps()}
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = measure(lambda: x @ y, warmup=3, min_reps=10, budget_ms=300).median_ms
    out["bf16_matmul_TFLOPs"] = 2 * m**3 / (t * 1e-3) / 1e12
    if sustained_seconds > 0:
        held = sustained(lambda: x @ y, sustained_seconds)
        out.update(
            bf16_matmul_sustained_TFLOPs=2 * m**3 / (held["ms"] * 1e-3) / 1e12,
            matmul_sustained_watts=held["watts"],
            matmul_sustained_sm_mhz=held["sm_mhz"],
        )
    return out
