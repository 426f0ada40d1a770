#!/usr/bin/env python3
"""Probe (H200): why the 1.1B step's attention backward (``attn_bwd`` of ``bench_step --profile``: ~8.5-8.7 ms per
layer at 64K, head dim 64) is slower than ``bench_attention``'s backward for the same geometry (P64: block 64, top-k
16, window 8, one sink; ~7.0 ms as benchmarked, ~6.3 ms of device time).

The ``attn_bwd`` window holds only the attention's backward op (an op log of the module's backward on the CPU showed
no selector or distillation op inside it), so the difference is in what the op is given. This probe times the
op's backward alone (``autograd.grad`` on a kept graph, device time: the GPU held busy while the host launches, as
in a step) on the step's shapes (B = 1, HQ = 32, HKV = 8, bf16) with each step-like input swapped in one at a time:

- ``bench``: ``bench_attention``'s P64 index (uniform random top-k) and contiguous ``[B, H, N, D]`` q/k/v/dO;
- ``projection_layout``: the same index, q/k/v/dO as the model hands them over: transposed views of
  ``[B, N, H, D]`` projections (``Attention.forward`` in ``sparse_train/lightning/model.py``);
- ``module_selection``: contiguous inputs, the index a freshly initialised ``SparseAttention`` selector picks on
  random q/k (the step's selection at its first steps: mean + max pooling, distance bias, RoPE off);
- ``step_like``: both.

Each row also has the index's density and plan statistics (hot / cold key blocks, maximum reuse), which decide the
KV-centric kernel's work. ``--trace-dir DIR`` also runs a few backwards of each case under ``torch.profiler`` and
adds the per-kernel medians (``scripts/trace_attention_windows.py``), to set beside the same kernels' times inside a
step (``bench_step.py --kernel-table``). ``--check`` (any device; the CPU runs the kernels through the Triton interpreter) runs one
forward + backward per case at a small N without timing and asserts that the two layouts give bitwise equal
outputs and gradients.

    python scripts/probe_step_backward.py --out /tmp/step_backward.json
    TRITON_INTERPRET=1 python scripts/probe_step_backward.py --check --n 512 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import HKV, HQ, PATTERNS, build_index, make_index, timeit  # noqa: E402
from trace_attention_windows import load_kernels, summarize, windows  # noqa: E402

import sparse_train as st  # noqa: E402

CASES = ("bench", "projection_layout", "module_selection", "step_like")


def inputs(n: int, d: int, projection_layout: bool, device: str, dtype: torch.dtype):
    """q, k, v, dO ``[1, H, N, D]``: contiguous, or transposed views of ``[1, N, H, D]`` tensors (same values)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    tensors = [torch.randn(1, h, n, d, generator=g).to(device=device, dtype=dtype) for h in (HQ, HKV, HKV, HQ)]
    if projection_layout:
        tensors = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
    return tensors


def module_index(n: int, d: int, pat: dict, device: str, dtype: torch.dtype) -> st.BlockIndex:
    """The selection of a freshly initialised ``SparseAttention`` (the step's geometry) on random q/k."""
    cfg = st.SparseAttentionConfig(block_q=pat["block"], block_k=pat["block"], top_k=pat["topk"], window=pat["window"],
                                   sinks=pat["sinks"], dense_warmup_steps=0, dense_fallback=False, distill="off")
    torch.manual_seed(0)
    module = st.SparseAttention(cfg, HQ, HKV, d).to(device).eval()
    q, k, v, _ = inputs(n, d, False, device, dtype)
    with torch.no_grad():
        module(q, k, v)
    return module.last_selection


def case_index(name: str, n: int, d: int, pat: dict, device: str, dtype: torch.dtype):
    if name in ("module_selection", "step_like"):
        idx = module_index(n, d, pat, device, dtype)
        return idx, idx.plan()
    return build_index(make_index(n, pat, device=device), n, pat)


def kernel_windows(backward, trace_path: str, repeats: int = 5) -> dict:
    """``repeats`` calls of ``backward`` under ``torch.profiler``; their attention windows' medians."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            backward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    return summarize(windows(load_kernels(trace_path)))


def run_case(name: str, n: int, d: int, pattern: str, device: str, dtype: torch.dtype, time_it: bool,
             trace_dir: str | None = None) -> dict:
    from sparse_train.kernels.op import triton_sparse_attention

    pat = PATTERNS[pattern]
    idx, plan = case_index(name, n, d, pat, device, dtype)
    q, k, v, do = inputs(n, d, name in ("projection_layout", "step_like"), device, dtype)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    options = {"plan": plan}
    kept, _ = triton_sparse_attention(qg, kg, vg, idx, kernel_options=options)
    row = dict(case=name, N=n, D=d, pattern=pattern, density=idx.density(), num_hot=plan.num_hot,
               num_cold=plan.num_cold, max_reuse=plan.max_reuse,
               q_strides=list(q.stride()), do_strides=list(do.stride()))
    if time_it:
        row["fwd_device_ms"], _, _ = timeit(lambda: triton_sparse_attention(q, k, v, idx, kernel_options=options),
                                            busy=True)
        row["bwd_device_ms"], row["bwd_device_p95_ms"], _ = timeit(
            lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True), busy=True)
        row["bwd_ms"], _, _ = timeit(lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True))
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            row["windows"] = kernel_windows(lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True),
                                            os.path.join(trace_dir, f"trace_{name}.json"))
    grads = torch.autograd.grad(kept, (qg, kg, vg), do)
    row["_outputs"] = (kept.detach(), *grads)
    return row


def check_layouts(rows: list[dict]) -> None:
    """The projection layout changes addresses, never values: bitwise the contiguous case's results."""
    by_case = {row["case"]: row["_outputs"] for row in rows}
    for contiguous, strided in (("bench", "projection_layout"), ("module_selection", "step_like")):
        if contiguous in by_case and strided in by_case:
            for label, a, b in zip(("o", "dq", "dk", "dv"), by_case[contiguous], by_case[strided]):
                assert torch.equal(a, b), f"{strided}: {label} differs from {contiguous}"
            print(f"[probe] {strided} == {contiguous} bitwise (o, dq, dk, dv)")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--head-dim", type=int, default=64, help="the 1.1B model's head dim (bench_step's default)")
    ap.add_argument("--pattern", default="P64", choices=list(PATTERNS))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check", action="store_true", help="no timing: one forward + backward per case, layouts compared")
    ap.add_argument("--trace-dir", default=None, help="also profile each case's backward (Chrome traces go here)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    if not args.check and args.device != "cuda":
        ap.error("timing needs a CUDA device; use --check elsewhere")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    for name in args.cases:
        row = run_case(name, args.n, args.head_dim, args.pattern, args.device, dtype, time_it=not args.check,
                       trace_dir=args.trace_dir)
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if not k.startswith("_")}), flush=True)
    check_layouts(rows)
    for row in rows:
        del row["_outputs"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
