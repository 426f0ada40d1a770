"""Wall time of the PyTorch reference backend (forward + backward) on the CPU.

The reference is the module's CPU backend and the recipes' attention on machines without a GPU, so
its speed matters: it must run a training step at N = 8192, HQ = 8 in a few seconds on 2 cores.

    python -m scripts.bench.reference_cpu --seq-len 8192 --heads 8 --kv-heads 2 --density 0.10

Inputs (scripts/bench/inputs.py, seed 0): float32 q, k, v and the output gradient; a random top-k selection of
causal key blocks with a window of 2 blocks and 1 sink, its top-k chosen so that the selection covers about
``--density`` of the causal blocks. Timing (scripts/bench/harness.py, no warm-up: the reference compiles nothing):
median and p95 over ``--repeats`` calls of the forward and of the forward + backward.
"""

from __future__ import annotations

import argparse

import torch

from scripts.bench.harness import measure
from scripts.bench.inputs import benchmark_inputs, build_index, random_selection
from sparse_train.kernels.reference import reference_sparse_attention


def density_pattern(seq_len, block, density):
    """A pattern (inputs.PATTERNS' form) whose window 2 + sink 1 + top-k blocks cover about ``density`` of the
    causal blocks of a ``seq_len`` row."""
    nqb = -(-seq_len // block)
    return dict(block=block, sinks=1, window=2, topk=max(1, round(density * (nqb + 1) / 2) - 3))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--density", type=float, default=0.10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    pattern = density_pattern(args.seq_len, args.block, args.density)
    sel = random_selection(args.seq_len, pattern, seed=0, device="cpu", batch=args.batch, kv_heads=args.kv_heads)
    index, _ = build_index(sel, args.seq_len, pattern)
    q, k, v, do = benchmark_inputs(
        args.seq_len,
        args.head_dim,
        seed=0,
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        dtype=torch.float32,
        device="cpu",
        requires_grad=True,
    )

    def forward():
        return reference_sparse_attention(q, k, v, index)

    def forward_backward():
        o, _ = forward()
        torch.autograd.grad(o, (q, k, v), do)

    timings = {
        name: measure(fn, device="cpu", warmup=0, min_reps=args.repeats, max_reps=args.repeats)
        for name, fn in (("forward", forward), ("forward+backward", forward_backward))
    }
    print(f"{index}")
    print(
        f"threads={torch.get_num_threads()} "
        + ", ".join(
            f"{name} median {t.median_ms / 1e3:.2f} s (p95 {t.p95_ms / 1e3:.2f} s)" for name, t in timings.items()
        )
        + f" over {args.repeats} runs"
    )


if __name__ == "__main__":
    main()
