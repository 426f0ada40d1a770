"""Memory traffic of the backward's kernels, to be read by Nsight Compute (GPU only).

Runs the forward + backward of the 64K benchmark shape (``bench_attention.py``: B = 1, HQ = 32, HKV = 8, random
top-k plus window and sinks) twice per backward mode (the first call compiles the kernels), and prints the
bytes each kernel must stream if nothing is served from L2 (q/dO slices of the KV-centric kernel, K/V tiles of
the dQ kernel, dS tiles of the stored-dS mode), so that the DRAM bytes Nsight Compute measures can be set
against them. Usage on the GPU machine (``--modes`` picks the backward modes; Nsight Compute flushes the caches
before each measured launch):

    ncu --clock-control none --kernel-name regex:"_dkdv_kernel|_dq_kernel|_dq_from_ds_kernel" --metrics \\
        gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \\
        python3 scripts/probe_backward_traffic.py --head-dim 128 --pattern P64
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as bench  # noqa: E402
from sparse_train.kernels.op import triton_sparse_attention  # noqa: E402

MODES = {"default": {}, "stored": {"stored_ds": True}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pattern", default="P64", choices=list(bench.PATTERNS))
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    n, d, pat = args.n, args.head_dim, bench.PATTERNS[args.pattern]
    q, k, v, do = bench.benchmark_inputs(n, d, seed=n, requires_grad=True)
    idx, plan = bench.build_index(bench.make_index(n, pat, seed=n), n, pat)
    bs = pat["block"]
    pair_heads = float(idx.counts.sum()) * (bench.HQ // bench.HKV)  # (query block, key block, query head) triples
    slice_bytes = bs * d * q.element_size()
    print(f"N={n} D={d} {args.pattern}: {pair_heads:.0f} (pair, head) triples; if nothing came from L2: "
          f"KV-centric q+dO {2 * pair_heads * slice_bytes / 1e9:.2f} GB, dQ kernel K+V "
          f"{2 * pair_heads * slice_bytes / 1e9:.2f} GB (a KV head's tiles shared by its query heads in L2 at best: "
          f"{2 * pair_heads * slice_bytes / (bench.HQ // bench.HKV) / 1e9:.2f} GB), stored dS "
          f"{pair_heads * bs * bs * q.element_size() / 1e9:.2f} GB each way", flush=True)
    for mode in args.modes:
        for _ in range(2):  # the first call compiles (and is skipped by --launch-skip)
            o, _ = triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan, **MODES[mode]})
            torch.autograd.grad(o, (q, k, v), do)
        torch.cuda.synchronize()
        print(f"mode {mode}: done", flush=True)


if __name__ == "__main__":
    main()
