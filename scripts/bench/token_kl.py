"""The token-level distillation loss (``selector_distill="token"``) on the GPU: the streaming kernels
(kernels/triton/token_kl.py) against their PyTorch reference (kernels/reference/token_kl.py), which the module runs
off CUDA.

Times, in one process, forward + backward of the per-row KL for the sampled query blocks of one layer at the headline
shape (default N = 65536, B = 1, H = 8 KV heads, G = 4, D = 128, E = 1, S = 32, block 64, 8 sampled blocks, bf16),
through ``scripts.bench.harness.measure`` (CUDA events, warm-up, L2 flushed before each repeat), median and p95;
the kernels also at other key spans per program (``--spans``), and each variant's forward alone; effective TFLOP/s
counts one pass of the products (every head's logits and the index logits over the causal keys of
each sampled row) per forward + backward, the same count for both variants (the kernels make three passes, the
reference one for the target and two for the index logits), so the rates compare the variants. Correctness:
the kernel's KL and gradients against the reference on the float64 copies of the same inputs (largest error relative
to the largest value).

Usage::

    python -m scripts.bench.token_kl --out token_kl.json
    python -m scripts.bench.token_kl --spans 1024 4096 --out token_kl.json   # other key spans too
    python -m scripts.bench.token_kl --n 2048 --device cpu --out /tmp/t.json   # smoke (reference only)
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from scripts.bench.harness import measure
from sparse_train.kernels import triton_kernels
from sparse_train.kernels.reference.token_kl import reference_token_kl


def sampled_blocks(args) -> torch.Tensor:
    """int64 ``[blocks]``: the sampled query blocks, spread evenly over the sequence (the last one included)."""
    return torch.linspace(0, (args.n - 1) // args.block, args.blocks).round().to(torch.int64)


def inputs(args, device, dtype):
    """(u, w, q_rows, k, temperature, query_blocks) of the benchmark shape, seed 0, at :func:`sampled_blocks`."""
    g = torch.Generator().manual_seed(0)
    n, h, grp, d, e, s, bq = args.n, args.heads, args.group, args.d, args.index_heads, args.index_dim, args.block
    blocks = sampled_blocks(args)
    rows = (blocks.view(-1, 1) * bq + torch.arange(bq)).reshape(-1).clamp(max=n - 1)
    k = torch.randn(1, h, n, d, generator=g)
    q_rows = torch.randn(1, h * grp, rows.numel(), d, generator=g)
    w = torch.randn(1, h, n, s, generator=g) / s**0.25
    u = torch.randn(1, h, rows.numel(), e, s, generator=g) / s**0.25
    temperature = torch.rand(h, generator=g) + 0.5
    tensors = [t.to(device, dtype) for t in (u, w, q_rows, k)]
    return (*tensors, temperature.to(device), blocks.to(device))


def run(fn, u, w, q_rows, k, temperature, blocks, args):
    """Forward + backward of ``fn``; the KL and the three gradients."""
    leaves = [t.detach().requires_grad_() for t in (u, w, temperature)]
    kl = fn(*leaves[:2], q_rows, k, leaves[2], blocks, block_q=args.block, scale=args.d**-0.5)
    kl.sum().backward()
    return kl.detach(), *(leaf.grad for leaf in leaves)


def causal_flops(args) -> float:
    """Multiply-adds x 2 of one pass over the sampled rows' causal keys: every head's logits and the index logits."""
    keys = float(((sampled_blocks(args) + 1) * args.block).clamp(max=args.n).sum()) * args.block  # (row, key) pairs
    return 2.0 * keys * args.heads * (args.group * args.d + args.index_heads * args.index_dim)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--index-heads", type=int, default=1)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--blocks", type=int, default=8, help="sampled query blocks")
    p.add_argument(
        "--spans",
        type=int,
        nargs="*",
        default=[],
        help="more key spans per program (token_kl.SPAN) to time the kernels at, besides the default",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    data = inputs(args, device, dtype)
    variants = {"reference": (reference_token_kl, None)}
    if cuda:
        kernels = triton_kernels().token_kl
        variants["kernel"] = (kernels.token_kl, kernels.SPAN)
        variants.update({f"kernel[span={span}]": (kernels.token_kl, span) for span in args.spans})
    result = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "shape": {k: v for k, v in vars(args).items() if k not in ("out", "device", "spans")},
        "results": [],
    }
    flops = causal_flops(args)
    default_span = kernels.SPAN if cuda else None
    for name, (fn, span) in variants.items():
        if span is not None:
            kernels.SPAN = span
        phases = {
            "forward + backward": lambda fn=fn: run(fn, *data, args),
            "forward": lambda fn=fn: fn(*data[:4], data[4], data[5], block_q=args.block, scale=args.d**-0.5),
        }
        for phase, call in phases.items():
            timing = measure(call, device=device, warmup=2, min_reps=5, max_reps=20)
            result["results"].append(
                {
                    "variant": name,
                    "phase": phase,
                    "median_ms": timing.median_ms,
                    "p95_ms": timing.p95_ms,
                    "repeats": timing.repeats,
                    "effective_tflops": flops / timing.median_ms / 1e9,
                }
            )
            print(f"{name:18s} {phase:20s} {timing.median_ms:8.2f} ms (p95 {timing.p95_ms:.2f})")
        if span is not None:
            kernels.SPAN = default_span  # the correctness check below runs the default
    if cuda:
        wide = [t.double() if t.is_floating_point() else t for t in data]
        want = run(reference_token_kl, *wide, args)
        got = run(variants["kernel"][0], *data, args)
        errors = {
            name: float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30))
            for name, a, b in zip(("kl", "du", "dw", "dtemperature"), got, want)
        }
        result["errors_vs_float64"] = errors
        print("kernel vs float64 reference, largest error / largest value:", errors)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
