"""How much of a timed attention call is host work: the forward through the public op and through its launcher
alone, each timed as ``bench_attention.py`` times it (L2 flush, event, call, event: host work the GPU waits
for counts) and with the GPU held busy by a sleep kernel queued before the start event (the call is queued
before the GPU reaches it: device time only), plus the host time of one call (perf_counter, GPU kept busy).

    python scripts/bench_host_overhead.py --out docs/benchmarks/speed_round2/h200_host_overhead.json

Shapes: bench_attention's (B = 1, HQ = 32, HKV = 8, bf16, 64K), head dims 64 and 128, P64 and P128.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

_SPEC = importlib.util.spec_from_file_location("bench_attention", Path(__file__).with_name("bench_attention.py"))
ba = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ba)


def host_ms(fn, calls: int = 20) -> float:
    """Host milliseconds per call while the GPU is busy (no call waits for the device)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from sparse_train.kernels import forward as kf
    from sparse_train.kernels.op import triton_sparse_attention
    from sparse_train.plan import forward_config

    rows = []
    for head_dim in (64, 128):
        ba.D = head_dim
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(ba.B, ba.HQ, args.n, head_dim, device="cuda", dtype=ba.DT, generator=g)
        k = torch.randn(ba.B, ba.HKV, args.n, head_dim, device="cuda", dtype=ba.DT, generator=g)
        v = torch.randn(ba.B, ba.HKV, args.n, head_dim, device="cuda", dtype=ba.DT, generator=g)
        for name, pat in ba.PATTERNS.items():
            idx, plan = ba.build_index(ba.make_index(args.n, pat, seed=args.n), args.n, pat)
            bs = pat["block"]
            config = forward_config(ba.HQ // ba.HKV, bs, bs, head_dim)

            def public():
                return triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan})

            def launcher():
                return kf.sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs,
                                              scale=1 / math.sqrt(head_dim), config=config)

            row = dict(head_dim=head_dim, pattern=name, config=list(config))
            for label, fn in (("public", public), ("launcher", launcher)):
                for suffix, busy in (("_ms", False), ("_busy_ms", True)):
                    row[f"{label}{suffix}"] = ba.timeit(fn, warmup=3, min_reps=30, max_reps=30, busy=busy)[0]
                row[f"{label}_host_ms"] = host_ms(fn)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  n=args.n, rows=rows), indent=1))


if __name__ == "__main__":
    main()
