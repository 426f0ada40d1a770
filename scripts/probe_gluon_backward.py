#!/usr/bin/env python3
"""Probe (H200): the backward kernels hand-scheduled in Gluon (``kernel_options.kv_gluon`` for dK/dV,
``dq_gluon`` for dQ) against the Triton ones, inside the whole backward (delta, dQ, KV-centric, finish), on the
indices of ``scripts/bench_attention.py`` (B=1, HQ=32, HKV=8, bf16).

Per (pattern, head dim): the backward with both Triton kernels (the reference row), then the variants of
:data:`VARIANTS` (BackwardConfig overrides: which kernels run Gluon, their ring depths). Before each run the
allocator's free memory is filled with NaN, so an output a kernel leaves unwritten cannot pass. Each variant's
dQ/dK/dV are compared with the all-Triton backward's (max |diff|, bitwise equality), and at ``--check-n``
(small) both are compared with a float64 evaluation of the same backward (the error ratio of DESIGN.md): a
wrong kernel cannot pass as a fast one. Backward times are device times (median, p95; the GPU kept busy while
the host launches). A variant that does not compile is a row with its error. One JSON row each on stdout and
in ``--out``.

    python scripts/probe_gluon_backward.py --out /tmp/probe_gluon.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import PATTERNS, build_index, make_index, packed_document_ids, timeit  # noqa: E402
from sparse_train.kernels import backward as backward_module  # noqa: E402
from sparse_train.kernels.backward import sparse_attn_backward  # noqa: E402
from sparse_train.kernels.forward import sparse_attn_forward  # noqa: E402
from sparse_train.plan import attention_schedule  # noqa: E402

# name -> BackwardConfig overrides (the rest: plan.backward_config's defaults for the device)
TRITON = {"kv_gluon": 0, "dq_gluon": 0}
VARIANTS = {
    "gluon kv": {"kv_gluon": 1, "dq_gluon": 0},
    "gluon kv + dq": {"kv_gluon": 1, "dq_gluon": 1},
    # a 128-key block as one 8-warp program (the default since the nineteenth session: two 64-key-row programs)
    "gluon kv + dq, one 128-key-row kv program": {"kv_gluon": 1, "dq_gluon": 1, "gluon_key_rows": 128},
    "gluon kv + dq, dq ring 3": {"kv_gluon": 1, "dq_gluon": 1, "dq_gluon_stages": 3},
    # two heads per Gluon dQ program (128 rows at BQ = 64, 8 warps; the default takes one head, 64 rows)
    "gluon kv + dq, two heads per dq program": {"kv_gluon": 1, "dq_gluon": 1, "dq_gluon_heads_per_program": 2},
    "triton kv + dq, 1 head per dq program": {"kv_gluon": 0, "dq_gluon": 0, "dq_heads_per_program": 1},
}
PACKED = {"range": None}
"""``--packed LOW:HIGH``: packed documents of lengths in [LOW, HIGH] (bench_attention's), the selection without
the blocks that share no document with their query block, and the document mask in every kernel."""


def _inputs(n, d, pattern, device, dtype, seed):
    pat = PATTERNS[pattern]
    torch.manual_seed(seed)
    b, hq, hkv = 1, 32, 8
    q = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    do = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    docs = None
    if PACKED["range"] is not None:
        docs, _ = packed_document_ids(n, *PACKED["range"], seed, device=device)
    idx, plan = build_index(make_index(n, pat, seed=seed, device=device), n, pat, docs=docs)
    return q, k, v, do, idx, plan, pat["block"], docs


def _backward(q, k, v, do, o, lse, idx, plan, bs, overrides, docs=None):
    """The backward's launcher on these inputs under ``plan.backward_config`` with ``overrides``."""
    sched = attention_schedule(idx, q.shape[1] // k.shape[1], q.shape[-1], q.device, {"plan": plan})
    config = sched.backward._replace(**overrides)

    def run():
        _poison_free_memory()
        return sparse_attn_backward(do, q, k, v, o, lse, idx.indices, idx.counts, plan.kv_indptr, plan.kv_qblocks,
                                    sched.slots, sched.cold_capacity, block_q=bs, block_k=bs,
                                    scale=q.shape[-1] ** -0.5, config=config, document_ids=docs)
    return run


_POISON = {"on": True}


def _poison_free_memory():
    """Fill what the caching allocator holds free with NaN (outputs are carved from it)."""
    if not _POISON["on"]:
        return
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(int(free * 0.5) // 4, device="cuda", dtype=torch.float32).fill_(float("nan"))
    del filler


def check_small(pattern, d, n, results):
    """Float64 error ratio at a small N (both kernels against the same float64 backward)."""
    q, k, v, do, idx, plan, bs, docs = _inputs(n, d, pattern, "cuda", torch.bfloat16, seed=1)
    scale = d ** -0.5
    o, lse = sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs, scale=scale,
                                 document_ids=docs)
    # float64 reference of the same backward: the PyTorch reference on the bf16 inputs, in float64
    from sparse_train.kernels.reference import reference_sparse_attention
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64, _ = reference_sparse_attention(q64, k64, v64, idx, scale=scale, document_ids=docs)
    out64.backward(do.double())
    ref = (q64.grad, k64.grad, v64.grad)
    all_triton = _backward(q, k, v, do, o, lse, idx, plan, bs, TRITON, docs)()
    err_prod = [float((x.double() - r).abs().max()) for x, r in zip(all_triton, ref)]
    for name, overrides in VARIANTS.items():
        row = dict(check_n=n, pattern=pattern, d=d, variant=name, err_triton=err_prod)
        try:
            got = _backward(q, k, v, do, o, lse, idx, plan, bs, overrides, docs)()
            torch.cuda.synchronize()
            row["kernels"] = _kernels_ran()
            row["err_variant"] = [float((x.double() - r).abs().max()) for x, r in zip(got, ref)]
            row["ratio_dq_dk_dv"] = [row["err_variant"][i] / max(err_prod[i], 1e-30) for i in range(3)]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[-800:]}"
            traceback.print_exc()
        results.append(row)
        print(json.dumps(row), flush=True)


def _kernels_ran():
    """Names of the dQ and dK/dV kernels the last backward launched."""
    names = {}
    for part in ("dq", "dkdv"):
        compiled = backward_module.LAST_COMPILED.get(part)
        names[part] = str(getattr(getattr(compiled, "metadata", None), "name", "") or getattr(compiled, "name", ""))
    return names


def probe(pattern, d, n, results):
    q, k, v, do, idx, plan, bs, docs = _inputs(n, d, pattern, "cuda", torch.bfloat16, seed=n)
    scale = d ** -0.5
    o, lse = sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs, scale=scale,
                                 document_ids=docs)
    base = dict(pattern=pattern, d=d, n=n, packed=PACKED["range"])
    run = _backward(q, k, v, do, o, lse, idx, plan, bs, TRITON, docs)
    all_triton = [x.clone() for x in run()]
    _POISON["on"] = False  # not inside the timed calls
    ms, p95, _ = timeit(run, busy=True)
    _POISON["on"] = True
    row = dict(base, variant="triton (dq and dk/dv)", ms=ms, p95_ms=p95)
    results.append(row)
    print(json.dumps(row), flush=True)
    for name, overrides in VARIANTS.items():
        row = dict(base, variant=name)
        try:
            run = _backward(q, k, v, do, o, lse, idx, plan, bs, overrides, docs)
            got = run()
            torch.cuda.synchronize()
            row["kernels"] = _kernels_ran()
            row["max_diff_vs_triton"] = [float((x.float() - p.float()).abs().max()) for x, p in zip(got, all_triton)]
            row["bitwise_equal_dq_dk_dv"] = [torch.equal(x, p) for x, p in zip(got, all_triton)]
            row["max_abs_triton"] = [float(p.float().abs().max()) for p in all_triton]
            del got
            _POISON["on"] = False
            row["ms"], row["p95_ms"], _ = timeit(run, busy=True)
            _POISON["on"] = True
            row["regs_spills"] = {part: (getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None))
                                  for part, compiled in backward_module.LAST_COMPILED.items()}
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[-800:]}"
            traceback.print_exc()
        results.append(row)
        print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--check-n", type=int, default=2048)
    ap.add_argument("--patterns", nargs="*", default=["P64", "P128"], choices=list(PATTERNS))
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--variants", nargs="*", default=None, help="names of VARIANTS to run (default: all)")
    ap.add_argument("--packed", default=None, metavar="LOW:HIGH", help="packed documents (see PACKED)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.packed:
        PACKED["range"] = tuple(int(x) for x in args.packed.split(":"))
    if args.variants is not None:
        unknown = set(args.variants) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
        for name in list(VARIANTS):
            if name not in args.variants:
                del VARIANTS[name]
    results = []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    for d in args.head_dims:
        for pattern in args.patterns:
            for fn, n in ((check_small, args.check_n), (probe, args.n)):
                try:
                    fn(pattern, d, n, results)
                except Exception:
                    traceback.print_exc()
                with open(args.out, "w") as f:
                    json.dump(dict(meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
