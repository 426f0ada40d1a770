#!/usr/bin/env python3
"""Time the selector's sampled dense target (``distill="sampled"``) at long N on the GPU: the kernel
path (the per-row log-mass kernel, bf16 inputs) against the PyTorch reference body (fp32 inputs, the
path any unsupported input takes), plus the attention fwd+bwd it accompanies. Median of CUDA-event
timings after warm-up.

    python scripts/bench_sampled_target.py --n 65536 --blocks 8
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparse_train.kernels.reference_block_mass import reference_dense_block_mass
from sparse_train.selectors.distill import dense_block_mass


def median_ms(fn, repeats: int = 7) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--blocks", type=int, default=8, help="sampled query blocks (distill_query_blocks)")
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    hq, hkv = args.heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, args.n, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, hkv, args.n, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    picks = torch.randperm(-(-args.n // 64))[: args.blocks].sort().values
    scale = args.head_dim ** -0.5
    kernels = median_ms(lambda: dense_block_mass(q, k, block_q=64, block_k=64, scale=scale, query_blocks=picks))
    qf, kf = q.float(), k.float()
    reference = median_ms(lambda: reference_dense_block_mass(qf, kf, block_q=64, block_k=64, scale=scale,
                                                             query_blocks=picks))
    print(f"N={args.n} HQ={hq} HKV={hkv} D={args.head_dim} sampled query blocks={args.blocks}: "
          f"kernels {kernels:.2f} ms, PyTorch reference {reference:.2f} ms ({reference / kernels:.1f}x)")


if __name__ == "__main__":
    main()
