"""Wall time of the PyTorch reference backend (forward + backward) on the CPU.

The reference is the module's CPU backend and the recipes' attention on machines without a GPU, so
its speed matters: it must run a training step at N = 8192, HQ = 8 in a few seconds on 2 cores.

    python scripts/bench_reference_cpu.py --seq-len 8192 --heads 8 --kv-heads 2 --density 0.10
"""

import argparse
import statistics
import time

import torch

import sparse_train as st
from sparse_train.kernels.reference import reference_sparse_attention


def build_index(batch, kv_heads, seq_len, block, density, seed):
    """Random causal selection whose density is close to ``density`` (window 2 + sink + random top-k)."""
    nqb = -(-seq_len // block)
    gen = torch.Generator().manual_seed(seed)
    top_k = max(1, round(density * (nqb + 1) / 2) - 3)
    last = torch.arange(nqb).view(1, 1, nqb, 1)
    sel = (torch.rand(batch, kv_heads, nqb, top_k, generator=gen) * (last + 1)).long()
    return st.BlockIndex.from_selection(sel, seq_len=seq_len, block_q=block, block_k=block, window=2, sinks=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--density", type=float, default=0.10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    index = build_index(args.batch, args.kv_heads, args.seq_len, args.block, args.density, seed=0)
    shape_q = (args.batch, args.heads, args.seq_len, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, args.seq_len, args.head_dim)
    q = torch.randn(shape_q, requires_grad=True)
    k = torch.randn(shape_kv, requires_grad=True)
    v = torch.randn(shape_kv, requires_grad=True)
    fwd, total = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        o, _ = reference_sparse_attention(q, k, v, index)
        mid = time.perf_counter()
        o.square().sum().backward()
        end = time.perf_counter()
        fwd.append(mid - start)
        total.append(end - start)
    print(f"{index}")
    print(f"threads={torch.get_num_threads()} forward median {statistics.median(fwd):.2f} s, "
          f"forward+backward median {statistics.median(total):.2f} s over {args.repeats} runs")


if __name__ == "__main__":
    main()
