"""Triton backward kernels for exact block-sparse attention: dQ query-centric, dK/dV hybrid.

Math (P recomputed from the saved lse; Z = keep/(1-p) * P is what multiplied V in the forward):
    delta_q = sum_d dO_qd O_qd;   dP_qk = keep_qk/(1-p) * <dO_q, V_k>;   dS_qk = P_qk (dP_qk - delta_q)
    dQ_q = scale * sum_k dS_qk K_k;   dK_k = scale * sum_{h in group} sum_q dS_qk Q_q;   dV_k = sum_{h,q} Z_qk dO_q
(delta = rowsum(dO * O) equals rowsum(P * dP) also with dropout, because O = Z V.)

Notation: as in forward.py (B, HQ, HKV, G, N, D, BQ, BK, NQB, NKB, HPP, M = HPP*BQ); "hot" KV block:
reuse (query blocks that selected it) >= r0; "cold": 0 < reuse < r0; cold slot: position of a cold
block in the compact fp32 atomic workspace [num_cold, BK, D] (-1 for hot or unselected blocks).

Layers: (1) @triton.jit kernels `_delta_kernel` (delta, minus dLSE when lse is differentiated),
`_dq_kernel` (query-centric dQ; for cold blocks also their dK/dV contributions by tl.atomic_add into a
compact fp32 workspace), `_dkdv_kernel` (KV-centric dK/dV: one work item = one KV block and a chunk of
at most KV_CHUNK query blocks of its transposed row, so popular blocks such as sinks are not one long
program; single-chunk rows are written directly, multi-chunk rows write fp32 partials),
`_dkdv_finish_kernel` (per KV block: convert the cold workspace, or sum the partials in chunk order, or
write zeros for unselected blocks); (2) launchers `kv_schedule` (work items; one host sync per backward)
and `sparse_attn_backward`.  The autograd op lives in op.py.

Deterministic mode: no block is cold, so no atomics run; every dK/dV element is produced by one program
or by the fixed-order sum of chunk partials, dQ by one program per tile: gradients are bitwise
identical run to run.  On the H200 at 64K it is also the fastest routing (r0 = 1, see
docs/benchmarks/2026-11-30_h200_attention.md), so its overhead over the default is <= 0.

Known limits: same dtypes/head dims/block sizes as forward.py; workspaces: atomic 2 * num_cold * BK * D * 4
bytes, chunk partials 2 * num_parts * BK * D * 4 bytes (num_parts = chunks of rows with reuse > KV_CHUNK);
the KV-centric kernel recomputes S and dP (7 tile products per (block, head) pair counting the dQ kernel,
against 5 for the atomic path); GQA dK/dV are summed over the group's heads inside the programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import backward_config, kv_schedule
from .forward import LAST_COMPILED, LOG2E, kernel_seq_lens, launch


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(O, DO, DELTA, DLSE, sob, soh, son, sod, sdb, sdh, sdn, sdd, N, HQ,
                  BR: tl.constexpr, D: tl.constexpr, HAS_DLSE: tl.constexpr):
    # delta [B, HQ, N] fp32 (contiguous) = rowsum(dO * O) - dLSE  (d lse / d s = P, so an lse
    # gradient enters dS = P (dP - delta) exactly like a shift of delta)
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = (bh % HQ).to(tl.int64)
    rows = pid * BR + tl.arange(0, BR)
    ok = rows < N
    r64 = rows.to(tl.int64)
    d = tl.arange(0, D)
    o = tl.load(O + b * sob + h * soh + r64[:, None] * son + d[None, :] * sod, mask=ok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + r64[:, None] * sdn + d[None, :] * sdd, mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh.to(tl.int64) * N + r64, mask=ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * N + r64, delta, mask=ok)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, IDX, CNT, SEQLENS, COLD_SLOT, DQ, DKW, DVW,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sdb, sdh, sdn, sdd,
    sxb, sxh, sxn, sxd,
    sib, sih, siq, sik,
    scb, sch, scq,
    N, HQ, HKV, NQB, NKB, scale_log2, scale, seed, threshold, inv_keep,
    G: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, DROPOUT: tl.constexpr, HAS_COLD: tl.constexpr, IEEE: tl.constexpr,
):
    NSUB: tl.constexpr = G // HPP
    M: tl.constexpr = HPP * BQ
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1)
    qb = NQB - 1 - pid0 // NSUB
    hsub = pid0 % NSUB
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    offs_k = tl.arange(0, BK)
    head = hkv * G + hsub * HPP + offs_m // BQ             # [M]
    qpos = qb * BQ + offs_m % BQ                           # [M]
    row_ok = qpos < N
    b64 = b.to(tl.int64)
    head64 = head.to(tl.int64)
    qpos64 = qpos.to(tl.int64)

    q = tl.load(Q + b64 * sqb + head64[:, None] * sqh + qpos64[:, None] * sqn + offs_d[None, :] * sqd,
                mask=row_ok[:, None], other=0.0)           # [M, D]
    do = tl.load(DO + b64 * sdb + head64[:, None] * sdh + qpos64[:, None] * sdn + offs_d[None, :] * sdd,
                 mask=row_ok[:, None], other=0.0)          # [M, D]
    rowid = (b64 * HQ + head64) * N + qpos64               # [M] row of lse/delta (contiguous [B,HQ,N])
    lse = tl.load(LSE + rowid, mask=row_ok, other=float("-inf"))
    # rows without any valid key (lse = -inf) must give P = 0: use +inf as their log2 base
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + rowid, mask=row_ok, other=0.0)
    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b).to(tl.int32)
    else:
        seqlen = N
    cnt = tl.load(CNT + b64 * scb + hkv * sch + qb * scq)
    idx_base = IDX + b64 * sib + hkv * sih + qb * siq
    k_base = K + b64 * skb + hkv.to(tl.int64) * skh
    v_base = V + b64 * svb + hkv.to(tl.int64) * svh
    slot_base = COLD_SLOT + (b64 * HKV + hkv) * NKB
    q_first = qb * BQ
    row_off = rowid * N                                    # [M] dropout counter base

    dq = tl.zeros([M, D], tl.float32)
    for t in range(0, cnt):
        j = tl.load(idx_base + t * sik)
        kpos = j * BK + offs_k
        kpos64 = kpos.to(tl.int64)
        kv_ok = kpos < seqlen                              # padding keys load as 0 (see forward.py)
        k = tl.load(k_base + kpos64[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok[:, None], other=0.0)  # [BK, D]
        v = tl.load(v_base + kpos64[:, None] * svn + offs_d[None, :] * svd, mask=kv_ok[:, None], other=0.0)  # [BK, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                     # [M, BK]
            dp = tl.dot(do, tl.trans(v))                   # [M, BK]
        s = s * scale_log2
        if (j * BK + BK - 1 > q_first) | (j * BK + BK > seqlen):
            ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seqlen)
            s = tl.where(ok, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])                     # [M, BK] normalised probabilities
        if DROPOUT:
            r = tl.randint(seed, row_off[:, None] + kpos64[None, :])
            keep = r.to(tl.int64) >= threshold
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])                     # [M, BK]
        if IEEE:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)                # [M, D]
        if HAS_COLD:
            slot = tl.load(slot_base + j)
            if slot >= 0:
                # cold block: add this tile's dK/dV share (summed over its HPP heads by the dot)
                if DROPOUT:
                    z = tl.where(keep, p * inv_keep, 0.0)
                else:
                    z = p
                if IEEE:
                    dv_part = tl.dot(tl.trans(z.to(do.dtype)), do, input_precision="ieee")
                    dk_part = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee")
                else:
                    dv_part = tl.dot(tl.trans(z.to(do.dtype)), do)   # [BK, D]
                    dk_part = tl.dot(tl.trans(ds.to(q.dtype)), q)    # [BK, D] (unscaled)
                w_off = slot.to(tl.int64) * (BK * D) + offs_k[:, None] * D + offs_d[None, :]
                tl.atomic_add(DKW + w_off, dk_part, sem="relaxed")
                tl.atomic_add(DVW + w_off, dv_part, sem="relaxed")
    dq = dq * scale
    tl.store(DQ + b64 * sxb + head64[:, None] * sxh + qpos64[:, None] * sxn + offs_d[None, :] * sxd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, KV_INDPTR, KV_QB, SEQLENS, ITEM_ROW, ITEM_T0, ITEM_T1, ITEM_PART,
    DK, DV, PKW, PVW,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sdb, sdh, sdn, sdd,
    skgb, skgh, skgn, skgd,
    svgb, svgh, svgn, svgd,
    N, HQ, HKV, NKB, scale_log2, scale, seed, threshold, inv_keep,
    G: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
):
    # one work item = one KV block and a chunk [t0, t1) of its transposed row (query blocks that
    # selected it); long rows (sinks, popular blocks) are chunked so no program becomes the long pole
    NSUB: tl.constexpr = G // HPP
    M: tl.constexpr = HPP * BQ
    item = tl.program_id(0)
    row = tl.load(ITEM_ROW + item)                         # (b*HKV + hkv)*NKB + j
    t0 = tl.load(ITEM_T0 + item)
    t1 = tl.load(ITEM_T1 + item)
    part = tl.load(ITEM_PART + item)
    j = row % NKB
    bh = row // NKB
    b = bh // HKV
    hkv = bh % HKV
    b64 = b.to(tl.int64)
    hkv64 = hkv.to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, M)
    kpos = j * BK + offs_k
    kpos64 = kpos.to(tl.int64)
    kv_ok = kpos < N                                       # rows of dK/dV this program writes
    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b).to(tl.int32)
    else:
        seqlen = N
    kv_in = kpos < seqlen                                  # padding keys load as 0 (see forward.py)
    k = tl.load(K + b64 * skb + hkv64 * skh + kpos64[:, None] * skn + offs_d[None, :] * skd,
                mask=kv_in[:, None], other=0.0)            # [BK, D]
    v = tl.load(V + b64 * svb + hkv64 * svh + kpos64[:, None] * svn + offs_d[None, :] * svd,
                mask=kv_in[:, None], other=0.0)            # [BK, D]
    dk = tl.zeros([BK, D], tl.float32)
    dv = tl.zeros([BK, D], tl.float32)
    # flat loop over (query block, head subset) pairs in fixed order: deterministic and pipelinable;
    # HPP heads of the group are stacked along the query rows (wider tile products)
    for u in range(t0 * NSUB, t1 * NSUB):
        t = u // NSUB
        hs = u % NSUB
        qb = tl.load(KV_QB + t)
        head64 = (hkv * G + hs * HPP + offs_m // BQ).to(tl.int64)   # [M]
        qpos = qb * BQ + offs_m % BQ                                  # [M]
        qpos64 = qpos.to(tl.int64)
        q_ok = qpos < N
        q = tl.load(Q + b64 * sqb + head64[:, None] * sqh + qpos64[:, None] * sqn + offs_d[None, :] * sqd,
                    mask=q_ok[:, None], other=0.0)         # [M, D]
        do = tl.load(DO + b64 * sdb + head64[:, None] * sdh + qpos64[:, None] * sdn + offs_d[None, :] * sdd,
                     mask=q_ok[:, None], other=0.0)        # [M, D]
        rowid = (b64 * HQ + head64) * N + qpos64            # [M]
        lse = tl.load(LSE + rowid, mask=q_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(DELTA + rowid, mask=q_ok, other=0.0)
        if IEEE:
            st = tl.dot(k, tl.trans(q), input_precision="ieee")
            dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
        else:
            st = tl.dot(k, tl.trans(q))                    # [BK, M] = S^T
            dpt = tl.dot(v, tl.trans(do))                  # [BK, M] = dP^T before dropout
        st = st * scale_log2
        if (j * BK + BK - 1 > qb * BQ) | (j * BK + BK > seqlen):
            ok = (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] < seqlen)
            st = tl.where(ok, st, float("-inf"))
        pt = tl.exp2(st - lse2[None, :])                   # [BK, M]
        if DROPOUT:
            r = tl.randint(seed, rowid[None, :] * N + kpos64[:, None])
            keep = r.to(tl.int64) >= threshold
            zt = tl.where(keep, pt * inv_keep, 0.0)
            dpt = tl.where(keep, dpt * inv_keep, 0.0)
        else:
            zt = pt
        dst = pt * (dpt - delta[None, :])                  # [BK, M]
        if IEEE:
            dv += tl.dot(zt.to(do.dtype), do, input_precision="ieee")
            dk += tl.dot(dst.to(q.dtype), q, input_precision="ieee")
        else:
            dv += tl.dot(zt.to(do.dtype), do)              # [BK, D]
            dk += tl.dot(dst.to(q.dtype), q)               # [BK, D]
    if part < 0:
        # whole row in this item: write dK/dV once, in the output dtype
        tl.store(DK + b64 * skgb + hkv64 * skgh + kpos64[:, None] * skgn + offs_d[None, :] * skgd,
                 (dk * scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(DV + b64 * svgb + hkv64 * svgh + kpos64[:, None] * svgn + offs_d[None, :] * svgd,
                 dv.to(DV.dtype.element_ty), mask=kv_ok[:, None])
    else:
        w_off = part.to(tl.int64) * (BK * D) + offs_k[:, None] * D + offs_d[None, :]
        tl.store(PKW + w_off, dk)
        tl.store(PVW + w_off, dv)


@triton.jit
def _dkdv_finish_kernel(
    COLD_SLOT, PART_START, NPARTS, DK, DV, DKW, DVW, PKW, PVW,
    skgb, skgh, skgn, skgd, svgb, svgh, svgn, svgd,
    N, HKV, NKB, scale,
    BK: tl.constexpr, D: tl.constexpr, HAS_COLD: tl.constexpr, HAS_PARTS: tl.constexpr,
):
    # per KV block: cold -> convert its atomic workspace; chunked -> sum its partials in chunk order
    # (fixed order: deterministic); unselected -> zeros; single-item KV-centric rows were written already
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b64 = (bh // HKV).to(tl.int64)
    hkv64 = (bh % HKV).to(tl.int64)
    row = bh.to(tl.int64) * NKB + j
    offs_k = tl.arange(0, BK)
    offs_d = tl.arange(0, D)
    kpos64 = (j * BK + offs_k).to(tl.int64)
    kv_ok = kpos64 < N
    dk_ptr = DK + b64 * skgb + hkv64 * skgh + kpos64[:, None] * skgn + offs_d[None, :] * skgd
    dv_ptr = DV + b64 * svgb + hkv64 * svgh + kpos64[:, None] * svgn + offs_d[None, :] * svgd
    inner = offs_k[:, None] * D + offs_d[None, :]
    slot = tl.load(COLD_SLOT + row)
    npart = tl.load(NPARTS + row)                          # -1: unselected; 0: written; >= 2: partials
    if HAS_COLD and slot >= 0:
        w_off = slot.to(tl.int64) * (BK * D) + inner
        tl.store(dk_ptr, (tl.load(DKW + w_off) * scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptr, tl.load(DVW + w_off).to(DV.dtype.element_ty), mask=kv_ok[:, None])
    elif npart < 0:
        tl.store(dk_ptr, tl.zeros([BK, D], tl.float32).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptr, tl.zeros([BK, D], tl.float32).to(DV.dtype.element_ty), mask=kv_ok[:, None])
    elif HAS_PARTS and npart > 0:
        start = tl.load(PART_START + row).to(tl.int64)
        dk = tl.zeros([BK, D], tl.float32)
        dv = tl.zeros([BK, D], tl.float32)
        for c in range(0, npart):
            w_off = (start + c) * (BK * D) + inner
            dk += tl.load(PKW + w_off)
            dv += tl.load(PVW + w_off)
        tl.store(dk_ptr, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=kv_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
# tests set this to fill dq/dk/dv with NaN before the launches, proving every element is written
POISON_OUTPUTS = False


def sparse_attn_backward(do, q, k, v, o, lse, indices, counts, kv_indptr, kv_qblocks, slots, num_cold,
                         *, block_q, block_k, scale, seq_lens=None, dlse=None, dropout_p=0.0, dropout_seed=0,
                         config=None, stage_events=None):
    """Launch the backward.  `slots` from `plan.cold_slots` (int32 [B*HKV*NKB]); `num_cold` = number of
    slots >= 0 (0 in deterministic mode).  `config`: a `plan.BackwardConfig` (default
    `plan.backward_config`).  Returns (dq, dk, dv) in q/k/v dtypes.
    `stage_events`: optional 4 CUDA events recorded at start / after preprocess+scheduling+workspace
    zeroing / after the dQ(+atomic) kernel / after the KV-centric and finish kernels.
    No validation here (op.py validates), but every tensor argument is either passed with its strides
    (q, k, v, o, do, indices, counts) or made contiguous here (lse, dlse, seq_lens and the plan arrays
    kv_indptr, kv_qblocks, slots, which the kernels index without strides)."""
    from .reference import dropout_threshold, philox_key

    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    NQB = indices.shape[2]
    NKB = triton.cdiv(N, block_k)
    if config is None:
        config = backward_config(G, block_q, block_k, D, num_cold > 0)
    hpp = config.dq_heads_per_program
    hpp_kv = config.kv_heads_per_program
    dropout = dropout_p > 0.0
    threshold = int(dropout_threshold(dropout_p)) if dropout else 0
    inv_keep = 1.0 / (1.0 - dropout_p) if dropout else 1.0
    ieee = q.dtype == torch.float32
    nw_dq, ns_dq, nw_kv, ns_kv = config.dq_num_warps, config.dq_num_stages, config.kv_num_warps, config.kv_num_stages
    if not do.is_contiguous():
        do = do.contiguous()
    lse = lse.contiguous()
    kv_indptr = kv_indptr.contiguous()
    kv_qblocks = kv_qblocks.contiguous()
    slots = slots.contiguous()
    seql = kernel_seq_lens(seq_lens, N, counts)
    seed = philox_key(dropout_seed)

    if stage_events:
        stage_events[0].record()
    delta = torch.empty((B, HQ, N), device=q.device, dtype=torch.float32)
    BR = 64
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    _delta_kernel[(triton.cdiv(N, BR), B * HQ)](
        o, do, delta, dlse if dlse is not None else delta, *o.stride(), *do.stride(), N, HQ,
        BR=BR, D=D, HAS_DLSE=dlse is not None, num_warps=4)
    reuse = kv_indptr[1:] - kv_indptr[:-1]
    item_row, item_t0, item_t1, item_part, part_start, nparts, num_parts = kv_schedule(reuse, kv_indptr, slots, config.kv_chunk)

    has_cold = num_cold > 0
    if has_cold:
        dkw = torch.zeros((num_cold, block_k, D), device=q.device, dtype=torch.float32)
        dvw = torch.zeros((num_cold, block_k, D), device=q.device, dtype=torch.float32)
    else:
        dkw = dvw = delta  # unused
    if num_parts > 0:
        pkw = torch.empty((num_parts, block_k, D), device=q.device, dtype=torch.float32)
        pvw = torch.empty((num_parts, block_k, D), device=q.device, dtype=torch.float32)
    else:
        pkw = pvw = delta  # unused
    dq = torch.empty((B, HQ, N, D), device=q.device, dtype=q.dtype)
    dk = torch.empty((B, HKV, N, D), device=q.device, dtype=k.dtype)
    dv = torch.empty((B, HKV, N, D), device=q.device, dtype=v.dtype)
    if POISON_OUTPUTS:
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
    if stage_events:
        stage_events[1].record()
    LAST_COMPILED["dq"] = launch(
        _dq_kernel, (NQB * (G // hpp), B * HKV), q, k, v, do, lse, delta, indices, counts, seql, slots, dq, dkw, dvw,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        *indices.stride(), *counts.stride(),
        N, HQ, HKV, NQB, NKB, float(scale * LOG2E), float(scale), seed, threshold, inv_keep,
        G=G, HPP=hpp, BQ=block_q, BK=block_k, D=D, HAS_SEQLENS=seq_lens is not None,
        DROPOUT=dropout, HAS_COLD=has_cold, IEEE=ieee, num_warps=nw_dq, num_stages=ns_dq,
    )
    if stage_events:
        stage_events[2].record()
    if item_row.numel() > 0:
        LAST_COMPILED["dkdv"] = launch(
            _dkdv_kernel, (item_row.numel(),), q, k, v, do, lse, delta, kv_indptr, kv_qblocks, seql, item_row, item_t0, item_t1, item_part,
            dk, dv, pkw, pvw,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            N, HQ, HKV, NKB, float(scale * LOG2E), float(scale), seed, threshold, inv_keep,
            G=G, HPP=hpp_kv, BQ=block_q, BK=block_k, D=D, HAS_SEQLENS=seq_lens is not None,
            DROPOUT=dropout, IEEE=ieee, num_warps=nw_kv, num_stages=ns_kv,
        )
    _dkdv_finish_kernel[(NKB, B * HKV)](
        slots, part_start, nparts, dk, dv, dkw, dvw, pkw, pvw, *dk.stride(), *dv.stride(),
        N, HKV, NKB, float(scale), BK=block_k, D=D, HAS_COLD=has_cold, HAS_PARTS=num_parts > 0, num_warps=4,
    )
    if stage_events:
        stage_events[3].record()
    return dq, dk, dv
