#!/usr/bin/env python3
"""Probe (H200): the forward hand-scheduled in Gluon (``kernel_options.fwd_gluon``) against the Triton one, on the
indices of ``scripts/bench_attention.py`` (B=1, HQ=32, HKV=8, bf16).

Per (pattern, head dim): the Triton forward (the reference row), then the variants of :data:`VARIANTS`
(ForwardConfig overrides: rows per program, ring depth; the session-15 file also has an "early scores" schedule,
since dropped from the kernel: it measured 1.2-1.5x slower). Before each checked run the allocator's
free memory is filled with NaN (an output row a kernel leaves unwritten cannot pass). Each variant's o and lse are
compared with the Triton forward's (max |diff|, bitwise), and at ``--check-n`` both with a float64 evaluation of
the same attention (the error ratio of DESIGN.md). Times are device times (median, p95; the GPU kept busy while
the host launches). One JSON row each on stdout and in ``--out``.

    python scripts/probe_gluon_forward.py --out /tmp/probe_gluon_forward.json
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

from bench_attention import PATTERNS, timeit  # noqa: E402
from probe_gluon_backward import PACKED, _inputs, _poison_free_memory, _POISON  # noqa: E402
from sparse_train.kernels import forward as forward_module  # noqa: E402
from sparse_train.kernels.forward import sparse_attn_forward  # noqa: E402
from sparse_train.plan import attention_schedule  # noqa: E402

TRITON = {"gluon": 0}
# name -> ForwardConfig overrides (heads per program: rows = heads x BQ)
VARIANTS = {
    "gluon 64 rows, ring 2": {"gluon": 1, "gluon_rows": 64, "gluon_stages": 2},
    "gluon 64 rows, ring 3": {"gluon": 1, "gluon_rows": 64, "gluon_stages": 3},
    "gluon 128 rows, ring 2": {"gluon": 1, "gluon_rows": 128, "gluon_stages": 2},
    "gluon 256 rows, ring 2": {"gluon": 1, "gluon_rows": 256, "gluon_stages": 2},
}


def _forward(q, k, v, idx, plan, bs, overrides, docs=None):
    """The forward's launcher under ``plan.forward_config`` with ``overrides`` (``gluon_rows``: heads x BQ)."""
    sched = attention_schedule(idx, q.shape[1] // k.shape[1], q.shape[-1], q.device, {"plan": plan})
    overrides = dict(overrides)
    rows = overrides.pop("gluon_rows", None)
    config = sched.forward._replace(**overrides)
    if rows is not None:
        config = config._replace(gluon_heads_per_program=max(1, rows // bs))

    def run():
        _poison_free_memory()
        return sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs,
                                   scale=q.shape[-1] ** -0.5, num_splits=sched.num_splits, config=config,
                                   document_ids=docs)
    return run, config


def _kernel_ran():
    compiled = forward_module.LAST_COMPILED.get("fwd")
    return str(getattr(getattr(compiled, "metadata", None), "name", "") or getattr(compiled, "name", ""))


def check_small(pattern, d, n, results):
    q, k, v, _, idx, plan, bs, docs = _inputs(n, d, pattern, "cuda", torch.bfloat16, seed=1)
    from sparse_train.kernels.reference import reference_sparse_attention
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx, scale=d ** -0.5,
                                            document_ids=docs)
    o_t, lse_t = _forward(q, k, v, idx, plan, bs, TRITON, docs)[0]()
    err_t = [float((o_t.double() - o64).abs().max()), float((lse_t.double() - lse64).abs().max())]
    for name, overrides in VARIANTS.items():
        row = dict(check_n=n, pattern=pattern, d=d, variant=name, err_triton_o_lse=err_t)
        try:
            o_g, lse_g = _forward(q, k, v, idx, plan, bs, overrides, docs)[0]()
            torch.cuda.synchronize()
            row["kernel"] = _kernel_ran()
            row["err_variant_o_lse"] = [float((o_g.double() - o64).abs().max()),
                                        float((lse_g.double() - lse64).abs().max())]
            row["ratio_o_lse"] = [row["err_variant_o_lse"][i] / max(err_t[i], 1e-30) for i in range(2)]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            traceback.print_exc()
        results.append(row)
        print(json.dumps(row), flush=True)


def probe(pattern, d, n, results):
    q, k, v, _, idx, plan, bs, docs = _inputs(n, d, pattern, "cuda", torch.bfloat16, seed=n)
    base = dict(pattern=pattern, d=d, n=n, packed=PACKED["range"])
    run, config = _forward(q, k, v, idx, plan, bs, TRITON, docs)
    o_t, lse_t = (x.clone() for x in run())
    _POISON["on"] = False
    ms, p95, _ = timeit(run, busy=True)
    _POISON["on"] = True
    row = dict(base, variant="triton", ms=ms, p95_ms=p95, config=list(config))
    results.append(row)
    print(json.dumps(row), flush=True)
    for name, overrides in VARIANTS.items():
        row = dict(base, variant=name)
        try:
            run, config = _forward(q, k, v, idx, plan, bs, overrides, docs)
            o_g, lse_g = run()
            torch.cuda.synchronize()
            row["kernel"] = _kernel_ran()
            row["config"] = list(config)
            row["max_diff_o_lse"] = [float((o_g.float() - o_t.float()).abs().max()),
                                     float((lse_g - lse_t).abs().max())]
            row["bitwise_o_lse"] = [torch.equal(o_g, o_t), torch.equal(lse_g, lse_t)]
            del o_g, lse_g
            _POISON["on"] = False
            row["ms"], row["p95_ms"], _ = timeit(run, busy=True)
            _POISON["on"] = True
            compiled = forward_module.LAST_COMPILED.get("fwd")
            row["regs_spills"] = (getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None))
        except Exception as exc:
            _POISON["on"] = True
            row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            traceback.print_exc()
        results.append(row)
        print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--check-n", type=int, default=2048)
    ap.add_argument("--patterns", nargs="*", default=["P64", "P128"], choices=list(PATTERNS))
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--packed", default=None, metavar="LOW:HIGH", help="packed documents (probe_gluon_backward)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.packed:
        PACKED["range"] = tuple(int(x) for x in args.packed.split(":"))
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
