#!/usr/bin/env python3
"""Probe (H200): do TMA tensor-descriptor loads, or Triton's automatic warp specialisation, speed up the
inner loops of the forward and of the KV-centric dK/dV kernel?

Both production kernels gather their tiles through pointer tensors (``[rows, D]`` int64 addresses held
in registers, cp.async copies). This script times stripped copies of the two loops (no documents,
dropout, sequence lengths or query-block map; the production tile shapes from ``plan``) in three load
modes, on the indices of ``scripts/bench_attention.py`` (64K, B=1, HQ=32, HKV=8):

* ``ptr``: pointer loads, as in production (calibrates the copy against the real kernel's time);
* ``tma``: the per-iteration tiles (K/V in the forward, q/dO slices in the KV-centric kernel) through
  host-built 4-D tensor descriptors (block ``[1, 1, rows, D]``);
* ``tma_ws``: ``tma`` with ``tl.range(..., warp_specialize=True)`` on the loop.

Every variant's output is compared with the ``ptr`` one (max |diff|), so a wrong descriptor cannot pass
as a fast one. The KV-centric copy runs the work items that hold a whole transposed row and skips the
chunked ones (sinks, popular blocks), in every mode alike: its times are those of the whole-row items. A variant that fails to compile is reported with its error. One JSON row per
(pattern, head dim, kernel, mode) on stdout and in ``--out``.

    python scripts/probe_tma_loads.py --out /tmp/probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import PATTERNS, build_index, make_index, timeit  # noqa: E402
from sparse_train.kernels._jit import (  # noqa: E402
    LN2,
    dot,
    index_row,
    load_rows,
    log2_lse,
    mask_scores,
    query_documents,
    query_tile,
    tile_pointers,
    tile_row_slice,
)
from sparse_train.kernels._launch import tma_descriptor  # noqa: E402
from sparse_train.plan import attention_schedule, kv_schedule, kv_schedule_capacity  # noqa: E402

# (name, TMA loads, warp specialisation, warps (None: production's), pipeline stages added to production's)
LOAD_MODES = (("ptr", False, False, None, 0), ("tma", True, False, None, 0), ("tma_stage+1", True, False, None, 1),
              ("tma_ws", True, True, None, 0), ("tma_ws_4warps", True, True, 4, 0))


@triton.jit
def _fwd_probe(
    Q, K, V, O, LSE, INDICES, COUNTS, desc_k, desc_v,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    N, HQ, HKV, NQB, scale_log2,
    GROUP: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    M: tl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q
    qb, b, hkv, head, qpos = query_tile(NQB, HKV, GROUP, HEADS_PER_PROGRAM, BLOCK_Q, True)  # head, qpos: [M]
    b64, hkv64, head64, qpos64 = b.to(tl.int64), hkv.to(tl.int64), head.to(tl.int64), qpos.to(tl.int64)
    row_ok = qpos < N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    q = load_rows(Q, b64, head64, qpos64, offs_d, stride_qb, stride_qh, stride_qn, stride_qd, row_ok)  # [M, D]
    selected, count = index_row(INDICES, COUNTS, b64, hkv64, qb.to(tl.int64), stride_ib, stride_ih, stride_iq,
                             stride_cb, stride_ch, stride_cq)
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    v_base = V + b64 * stride_kb + hkv64 * stride_kh
    q_first = qb * BLOCK_Q
    docs_row, doc_q, doc_q_last = query_documents(INDICES, b64, qpos, q_first, N, BLOCK_Q, False)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for t in tl.range(0, count, warp_specialize=WARP_SPECIALIZE):
        j = tl.load(selected + t * stride_ik)
        kpos = j * BLOCK_K + offs_k  # [BK]
        if TMA:
            k = desc_k.load([b, hkv, j * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM)  # [BK, D]
            v = desc_v.load([b, hkv, j * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM)  # [BK, D]
        else:
            kpos64 = kpos.to(tl.int64)
            kv_ok = kpos < N
            k = tl.load(tile_pointers(k_base, kpos64, offs_d, stride_kn, stride_kd), mask=kv_ok[:, None], other=0.0)
            v = tl.load(tile_pointers(v_base, kpos64, offs_d, stride_kn, stride_kd), mask=kv_ok[:, None], other=0.0)
        s = dot(q, tl.trans(k), False) * scale_log2  # [M, BK]
        s = mask_scores(s, qpos, kpos, N, j * BLOCK_K, q_first, docs_row, doc_q, doc_q_last, N, False, BLOCK_K)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])  # [M, BK]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc += dot(p.to(v.dtype), v, False)  # [M, D]
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    rows = (b64 * HQ + head64) * N + qpos64  # [M] (O and LSE contiguous [B, HQ, N(, D)])
    tl.store(O + rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def _dkdv_probe(
    Q, K, V, DO, LSE, DELTA, KV_QBLOCKS, ITEM_ROW, ITEM_T0, ITEM_T1, DK, DV, desc_q, desc_do,
    N, HQ, HKV, NKB, scale_log2,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # one head per step (production's default), q/dO taken in TILE_ROWS-row slices; whole rows only (the
    # probe skips chunk partials: items with a partial write nothing, in every mode alike)
    ROW_SLICES: tl.constexpr = BLOCK_Q // TILE_ROWS
    STEPS_PER_BLOCK: tl.constexpr = GROUP * ROW_SLICES
    item = tl.program_id(0)
    kv_row = tl.load(ITEM_ROW + item)
    if kv_row < 0:
        return
    t0 = tl.load(ITEM_T0 + item)
    t1 = tl.load(ITEM_T1 + item)
    j = kv_row % NKB
    batch_head = kv_row // NKB
    b = batch_head // HKV
    hkv = batch_head % HKV
    b64 = b.to(tl.int64)
    hkv64 = hkv.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM)
    kpos = j * BLOCK_K + offs_k
    kpos64 = kpos.to(tl.int64)
    kv_ok = kpos < N
    kv_base = (b64 * HKV + hkv64) * N * HEAD_DIM  # K, V, DK, DV contiguous [B, HKV, N, D]
    k = tl.load(K + kv_base + kpos64[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    v = tl.load(V + kv_base + kpos64[:, None] * HEAD_DIM + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    for u in tl.range(t0 * STEPS_PER_BLOCK, t1 * STEPS_PER_BLOCK, warp_specialize=WARP_SPECIALIZE):
        t = u // STEPS_PER_BLOCK
        head_in_group = (u % STEPS_PER_BLOCK) // ROW_SLICES
        first_row = (u % ROW_SLICES) * TILE_ROWS
        qb = tl.load(KV_QBLOCKS + t)
        head, qpos = tile_row_slice(qb, hkv, head_in_group, first_row, TILE_ROWS, GROUP, 1, BLOCK_Q)  # [M]
        head64 = head.to(tl.int64)
        qpos64 = qpos.to(tl.int64)
        q_ok = qpos < N
        if TMA:
            head_scalar = hkv * GROUP + head_in_group
            q = desc_q.load([b, head_scalar, qb * BLOCK_Q + first_row, 0]).reshape(TILE_ROWS, HEAD_DIM)  # [M, D]
            do = desc_do.load([b, head_scalar, qb * BLOCK_Q + first_row, 0]).reshape(TILE_ROWS, HEAD_DIM)  # [M, D]
        else:
            rows_qd = (b64 * HQ + head64) * N + qpos64  # [M] (Q, DO contiguous [B, HQ, N, D])
            q = tl.load(Q + rows_qd[:, None] * HEAD_DIM + offs_d[None, :], mask=q_ok[:, None], other=0.0)
            do = tl.load(DO + rows_qd[:, None] * HEAD_DIM + offs_d[None, :], mask=q_ok[:, None], other=0.0)
        row = (b64 * HQ + head64) * N + qpos64  # [M]
        lse2 = log2_lse(tl.load(LSE + row, mask=q_ok, other=float("-inf")))
        delta = tl.load(DELTA + row, mask=q_ok, other=0.0)
        st = dot(k, tl.trans(q), False) * scale_log2  # [BK, M]
        dpt = dot(v, tl.trans(do), False)  # [BK, M]
        if (j * BLOCK_K + BLOCK_K - 1 > qb * BLOCK_Q) | (j * BLOCK_K + BLOCK_K > N):
            ok = (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] < N)
            st = tl.where(ok, st, float("-inf"))
        pt = tl.exp2(st - lse2[None, :])  # [BK, M]
        dst = pt * (dpt - delta[None, :])  # [BK, M]
        dv += dot(pt.to(do.dtype), do, False)  # [BK, D]
        dk += dot(dst.to(q.dtype), q, False)  # [BK, D]
    tl.store(DK + kv_base + kpos64[:, None] * HEAD_DIM + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_ok[:, None])
    tl.store(DV + kv_base + kpos64[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_ok[:, None])


def _descriptor(x, rows):
    """The production launchers' descriptor of ``x`` (``[1, 1, rows, D]`` boxes); the probe's tensors always take
    one (contiguous, Hopper or the interpreter)."""
    desc = tma_descriptor(x, rows, True)
    assert desc is not None, f"no TMA descriptor for a tensor of strides {x.stride()}"
    return desc


def _probe_modes(results, base, kernel, default_warps, default_stages, modes, timed, prepare, production_diff,
                 **extra):
    """Run one probe kernel in every load mode of :data:`LOAD_MODES` (those of ``modes`` and ``ptr``, the
    reference): ``prepare(tma, warp_specialize, warps, stages)`` returns ``(run, outputs)``, ``run()`` launching into
    ``outputs`` and returning the compiled kernel; ``production_diff(outputs)`` is the ptr mode's distance to the
    production kernel. Appends (and prints) one row per mode; a mode that does not compile is a row with an error."""
    reference = None
    for mode, tma, ws, warps, more_stages in LOAD_MODES:
        if modes and mode not in modes and mode != "ptr":
            continue
        warps = warps or default_warps
        stages = default_stages + more_stages
        row = dict(base, kernel=kernel, mode=mode, warps=warps, stages=stages, **extra)
        try:
            run, outputs = prepare(tma, ws, warps, stages)
            compiled = run()
            if timed:
                torch.cuda.synchronize()
                row.update(regs=compiled.n_regs, spills=compiled.n_spills)
            if reference is None:
                reference = [x.clone() for x in outputs]
                row["max_diff_vs_production"] = production_diff(outputs)
            row["max_diff_vs_ptr"] = max(float((x.float() - r.float()).abs().max()) for x, r in zip(outputs, reference))
            if timed:
                row["ms"], row["p95_ms"], _ = timeit(run, busy=True)
        except Exception as exc:  # a mode that does not compile is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            traceback.print_exc()
        results.append(row)
        print(json.dumps(row), flush=True)


def probe(pattern, d, n, results, device="cuda", modes=None):
    """Append the rows of one (pattern, head dim); ``device='cpu'`` (TRITON_INTERPRET=1) checks the probe kernels
    against production on a small shape without timing."""
    timed = device == "cuda"
    dtype = torch.bfloat16 if timed else torch.float32
    from sparse_train.kernels.backward import sparse_attn_backward
    from sparse_train.kernels.forward import sparse_attn_forward

    pat = PATTERNS[pattern]
    bs = pat["block"]
    b, hq, hkv = 1, 32, 8
    group = hq // hkv
    torch.manual_seed(n)
    q = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    do = torch.randn(b, hq, n, d, device=device, dtype=dtype)
    idx, plan = build_index(make_index(n, pat, seed=n, device=device), n, pat)
    sched = attention_schedule(idx, group, d, q.device, {"plan": plan})
    fcfg, bcfg = sched.forward, sched.backward
    scale = d ** -0.5
    scale_log2 = scale * 1.4426950408889634
    nqb = idx.indices.shape[2]
    nkb = triton.cdiv(n, bs)
    base = dict(pattern=pattern, d=d, n=n)

    o_real, lse_real = sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs, block_k=bs, scale=scale,
                                           config=fcfg)
    if timed:
        t_real, t95_real, _ = timeit(lambda: sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=bs,
                                                                 block_k=bs, scale=scale, config=fcfg), busy=True)
        results.append(dict(base, kernel="fwd", mode="production", ms=t_real, p95_ms=t95_real))
        print(json.dumps(results[-1]), flush=True)
    desc_k, desc_v = _descriptor(k, bs), _descriptor(v, bs)

    def prepare_fwd(tma, ws, warps, stages):
        o = torch.empty_like(q)
        lse = torch.empty(b, hq, n, device=device, dtype=torch.float32)

        def run():
            return _fwd_probe[(nqb * (group // fcfg.heads_per_program), b * hkv)](
                q, k, v, o, lse, idx.indices, idx.counts, desc_k, desc_v, *q.stride(), *k.stride(),
                *idx.indices.stride(), *idx.counts.stride(), n, hq, hkv, nqb, scale_log2,
                GROUP=group, HEADS_PER_PROGRAM=fcfg.heads_per_program, BLOCK_Q=bs, BLOCK_K=bs, HEAD_DIM=d,
                TMA=tma, WARP_SPECIALIZE=ws, num_warps=warps, num_stages=stages)

        return run, (o,)

    _probe_modes(results, base, "fwd", fcfg.num_warps, fcfg.num_stages, modes, timed, prepare_fwd,
                 lambda out: float((out[0].float() - o_real.float()).abs().max()), heads=fcfg.heads_per_program)

    # KV-centric kernel: whole rows from the production schedule (chunked rows are skipped alike)
    lse = lse_real.contiguous()
    delta = (o_real.float() * do.float()).sum(-1).contiguous()
    num_items, num_parts = kv_schedule_capacity(plan.kv_indptr.numel() - 1, nqb, plan.kv_qblocks.numel(),
                                                bcfg.kv_chunk)
    work = kv_schedule(plan.kv_indptr[1:] - plan.kv_indptr[:-1], plan.kv_indptr, sched.slots, bcfg.kv_chunk,
                       num_items=num_items, num_parts=num_parts)
    item_row = torch.where(work.item_part < 0, work.item_row, -1).contiguous()
    tile_rows = bcfg.kv_tile_rows
    # production dK/dV on the key blocks the probe computes (rows in one work item)
    _, dk_real, dv_real = sparse_attn_backward(do, q, k, v, o_real, lse_real, idx.indices, idx.counts, plan.kv_indptr,
                                               plan.kv_qblocks, sched.slots, sched.cold_capacity, block_q=bs,
                                               block_k=bs, scale=scale, config=bcfg)
    whole = torch.zeros(b * hkv * nkb, dtype=torch.bool, device=device)
    whole[item_row[item_row >= 0].long()] = True
    whole = whole.view(b, hkv, nkb, 1).expand(b, hkv, nkb, bs).reshape(b, hkv, nkb * bs)[:, :, :n, None]
    if timed:
        t_bwd, t95_bwd, _ = timeit(lambda: sparse_attn_backward(
            do, q, k, v, o_real, lse_real, idx.indices, idx.counts, plan.kv_indptr, plan.kv_qblocks, sched.slots,
            sched.cold_capacity, block_q=bs, block_k=bs, scale=scale, config=bcfg), busy=True)
        results.append(dict(base, kernel="bwd (dQ + KV-centric + finish)", mode="production", ms=t_bwd, p95_ms=t95_bwd))
        print(json.dumps(results[-1]), flush=True)
    desc_q, desc_do = _descriptor(q, tile_rows), _descriptor(do, tile_rows)

    def prepare_kv(tma, ws, warps, stages):
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)

        def run():
            return _dkdv_probe[(item_row.numel(),)](
                q, k, v, do, lse, delta, plan.kv_qblocks, item_row, work.item_t0, work.item_t1, dk, dv, desc_q,
                desc_do, n, hq, hkv, nkb, scale_log2,
                GROUP=group, BLOCK_Q=bs, BLOCK_K=bs, HEAD_DIM=d, TILE_ROWS=tile_rows, TMA=tma,
                WARP_SPECIALIZE=ws, num_warps=warps, num_stages=stages)

        return run, (dk, dv)

    def kv_production_diff(out):
        dk, dv = out  # the probe's dK lacks the scale (production applies it at the store)
        return max(float(((dk.float() * scale - dk_real.float()) * whole).abs().max()),
                   float(((dv.float() - dv_real.float()) * whole).abs().max()))

    _probe_modes(results, base, "dkdv", bcfg.kv_num_warps, bcfg.kv_num_stages, modes, timed, prepare_kv,
                 kv_production_diff, tile_rows=tile_rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--patterns", nargs="*", default=["P128", "P64"], choices=list(PATTERNS))
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--modes", nargs="*", default=None, choices=[m[0] for m in LOAD_MODES],
                    help="load modes to time besides ptr (the reference of the comparison); default all")
    ap.add_argument("--device", default="cuda", help="cpu: interpreter check of the probe kernels (TRITON_INTERPRET=1)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__)
    for d in args.head_dims:
        for pattern in args.patterns:
            try:
                probe(pattern, d, args.n, results, args.device, args.modes)
            except Exception:
                traceback.print_exc()
            with open(args.out, "w") as f:
                json.dump(dict(meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
