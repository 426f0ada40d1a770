"""Triton backward of exact block-sparse attention: dQ query-centric, dK/dV hybrid.

Math (P recomputed from the saved lse, under the forward's masks: causal, length, and the document mask
doc[b, k] == doc[b, q] when HAS_DOCS; Z = keep / (1 - p) * P is what multiplied V in the forward):
    delta_q = sum_d dO_qd O_qd - dlse_q;  dP_qk = keep_qk / (1 - p) <dO_q, V_k>;  dS_qk = P_qk (dP_qk - delta_q)
    dQ_q = scale sum_k dS_qk K_k;  dK_k = scale sum_{h in group, q} dS_qk Q_q;  dV_k = sum_{h in group, q} Z_qk dO_q
(rowsum(dO * O) equals rowsum(P * dP) also with dropout, because O = Z V.)

Notation: as in forward.py (B, HQ, HKV, GROUP, N, HEAD_DIM = D, BLOCK_Q / BLOCK_K = BQ/BK, NQB, NKB,
HEADS_PER_PROGRAM, HEAD_SUBSETS, M rows per tile). A KV block is "hot" when its reuse (query blocks
that selected it) is >= r0 and "cold" when 0 < reuse < r0; a cold slot is its position in the compact
fp32 atomic workspace [num_cold, BK, D] (-1 for hot or unselected blocks); a KV-centric work item is a
KV block and a chunk of at most kv_chunk query blocks of its transposed row (sparse_train/plan/plan.py).
Under a query-block map (HAS_QUERY_MAP, context parallelism) q, dO, lse, delta and dQ hold the L rows of
the listed query blocks and the plan lists LOCAL query blocks; positions (masks, dropout counters) are
global (``_jit.map_query_rows``), and dK/dV are the full-length contributions of those rows.

Layers: (1) ``@triton.jit`` kernels ``_delta_kernel`` (delta), ``_dq_kernel`` (query-centric dQ; for
cold blocks also their dK/dV contributions, by tl.atomic_add into the atomic workspace),
``_dkdv_kernel`` (KV-centric dK/dV per work item: a row in one item is written directly, a chunked row
writes fp32 partials; in stored-dS mode it also files dS), ``_dq_from_ds_kernel`` (stored-dS mode's dQ)
and ``_dkdv_finish_kernel`` (per KV block: convert its atomic workspace, or sum its partials in chunk
order, or write zeros when unselected); (2) the launcher ``sparse_attn_backward``
(allocate, schedule, launch). The autograd op is in op.py; the schedules (cold slots, work items) and
the tile configuration come from sparse_train/plan/plan.py.

Gluon KV-centric kernel (``BackwardConfig.kv_gluon``, default on a Hopper GPU): the same work items, partials
and finish, with the dK/dV tile products hand-scheduled in Gluon (gluon/backward.py: TMA ring of q/dO slices,
asynchronous warpgroup MMAs; documents included); where it does not apply (dropout, sequence lengths, a query-block
map, N not a multiple of BLOCK_Q, fused or stored-dS mode) ``_dkdv_kernel`` runs.

Deterministic mode: no block is cold, so no atomics run; every dK/dV element comes from one program or
from the fixed-order sum of chunk partials, dQ from one program per tile: gradients are bitwise
identical run to run.

Fused mode (``BackwardConfig.fused_dq``, ``kernel_options.fused_dq``): every block is KV-centric, and the
KV-centric kernel also computes each slice's dQ share, dS K (from the dS^T tile it already holds), adding
it by float32 atomics into a zeroed ``[B, HQ, L, D]`` buffer that is cast to q's dtype at the end; the dQ
kernel does not run. 5 tile products per (block, head) pair instead of 7, at the price of B*HQ*L*D*4
bytes of buffer and one atomic add per dQ element per selected key block. The atomic order varies, so
dQ is not bitwise reproducible (refused with deterministic mode). Opt-in because it does not pay: the
float32 atomics (one per dQ element and selected key block, ~27 GB at 64K, P64, D=128, B=1, HQ=32) cost
more than the saved recomputation (the backward modes of docs/benchmarks/attention_64k_h200_d128.md).

Stored-dS mode (``BackwardConfig.stored_ds``, ``kernel_options.stored_ds``): every block is KV-centric; the
KV-centric kernel files each dS^T tile it computes, in q's dtype (the operand the dQ product takes), under
the pair's index slot (``BlockPlan.kv_pairs``) in a ``[B*HKV*NQB*K*GROUP, BK, BQ]`` buffer, and then
``_dq_from_ds_kernel`` computes dQ_q = scale sum_t dS[q, t] K[block t] over each index row in order: 5 tile
products per (block, head) pair and no atomics (deterministic), for 2 bytes written and read per dS element
(B*HQ*NQB*K*BQ*BK*2 bytes of buffer, K the index capacity).

TMA loads (``BackwardConfig.dq_tma`` / ``kv_tma``, Hopper and newer, where ``_launch.tma_descriptor`` makes
a descriptor): the dQ kernel's K/V tiles, and the KV-centric kernel's q/dO row slices when a step takes one
head and there is no query-block map (a slice is then consecutive rows of one head).

Known limits: the forward's dtypes, head dims and block sizes; workspaces: atomic
2 * num_cold * BK * D * 4 bytes, chunk partials 2 * num_parts * BK * D * 4 bytes; S and dP are
recomputed by both the dQ and the KV-centric kernel (7 tile products per (block, head) pair against 5
on the atomic path, in fused mode and in stored-dS mode, whose dS buffer is B*HQ*NQB*K*BQ*BK elements);
GQA dK/dV are summed over the group's heads inside the programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...plan.plan import kv_schedule, kv_schedule_capacity
from ...plan.tuning import backward_config
from ..gluon.backward import gluon_dq_tiles_supported, gluon_kv_tiles_supported, launch_dkdv_gluon, launch_dq_gluon
from ..gluon.common import gluon_call_supported
from ..reference.attention import dropout_threshold, philox_key  # the one definition of the keep bits
from ._jit import (
    LOG2E,
    crosses_documents,
    documents_row,
    dot,
    dropout_keep,
    index_row,
    last_document,
    load_documents,
    load_key_tile,
    load_rows,
    log2_lse,
    map_query_rows,
    mask_scores,
    query_documents,
    query_tile,
    sequence_length,
    tile_pointers,
    tile_row_slice,
)
from ._launch import (
    LAST_COMPILED,
    kernel_document_ids,
    kernel_query_map,
    kernel_seq_lens,
    launch,
    tma_descriptor,
    tma_operands,
)

__all__ = ["sparse_attn_backward"]

_DELTA_ROWS = 64  # rows per program of the delta kernel


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _delta_kernel(
    O,
    DO,
    DELTA,
    DLSE,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    N,
    HQ,
    BLOCK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    # delta [B, HQ, N] fp32 (contiguous) = rowsum(dO * O) - dLSE  (d lse / d s = P, so an lse
    # gradient enters dS = P (dP - delta) exactly like a shift of delta)
    batch_head = tl.program_id(1)
    b64 = (batch_head // HQ).to(tl.int64)
    h64 = (batch_head % HQ).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ok = rows < N
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(
        tile_pointers(O + b64 * stride_ob + h64 * stride_oh, rows64, offs_d, stride_on, stride_od),
        mask=ok[:, None],
        other=0.0,
    )
    do = tl.load(
        tile_pointers(DO + b64 * stride_dob + h64 * stride_doh, rows64, offs_d, stride_don, stride_dod),
        mask=ok[:, None],
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + batch_head.to(tl.int64) * N + rows64, mask=ok, other=0.0)
    tl.store(DELTA + batch_head.to(tl.int64) * N + rows64, delta, mask=ok)


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    INDICES,
    COUNTS,
    SEQ_LENS,
    DOCS,
    QUERY_MAP,
    QUERY_ROW0,
    COLD_SLOTS,
    DQ,
    DK_ATOMIC,
    DV_ATOMIC,
    DESC_K,
    DESC_V,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    stride_ib,
    stride_ih,
    stride_iq,
    stride_ik,
    stride_cb,
    stride_ch,
    stride_cq,
    N,
    L,
    HQ,
    HKV,
    NQB,
    NKB,
    scale_log2,
    scale,
    seed,
    threshold,
    inv_keep,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_COLD: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_QUERY_MAP: tl.constexpr,
    TMA_LOADS: tl.constexpr,
):
    M: tl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q
    # qb: the LOCAL query block (index row, rows of q/dO/lse/dQ); qb_global, qpos: GLOBAL (masks, dropout)
    qb, b, hkv, head, qpos = query_tile(NQB, HKV, GROUP, HEADS_PER_PROGRAM, BLOCK_Q, True)  # head, qpos: [M]
    qb_global, qpos, qrow64 = map_query_rows(QUERY_MAP, QUERY_ROW0, qb, qpos, BLOCK_Q, HAS_QUERY_MAP)
    b64, hkv64, head64, qpos64 = b.to(tl.int64), hkv.to(tl.int64), head.to(tl.int64), qpos.to(tl.int64)
    row_ok = qpos < N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    q = load_rows(Q, b64, head64, qrow64, offs_d, stride_qb, stride_qh, stride_qn, stride_qd, row_ok)  # [M, D]
    do = load_rows(DO, b64, head64, qrow64, offs_d, stride_dob, stride_doh, stride_don, stride_dod, row_ok)  # [M, D]
    if HAS_QUERY_MAP:
        row = (b64 * HQ + head64) * L + qrow64  # [M] row of lse / delta (contiguous [B, HQ, L])
        row_counter = ((b64 * HQ + head64) * N + qpos64) * N  # [M] dropout counter of (row, key 0), global
    else:
        row = (b64 * HQ + head64) * N + qpos64  # [M] row of lse / delta (contiguous [B, HQ, N])
        row_counter = row * N
    lse2 = log2_lse(tl.load(LSE + row, mask=row_ok, other=float("-inf")))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    selected, count = index_row(
        INDICES, COUNTS, b64, hkv64, qb.to(tl.int64), stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq
    )
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    v_base = V + b64 * stride_vb + hkv64 * stride_vh
    cold_slot_row = COLD_SLOTS + (b64 * HKV + hkv64) * NKB
    q_first = qb_global * BLOCK_Q
    docs_row, doc_q, doc_q_last = query_documents(DOCS, b64, qpos, q_first, N, BLOCK_Q, HAS_DOCS)

    dq = tl.zeros([M, HEAD_DIM], tl.float32)
    for t in range(0, count):
        j = tl.load(selected + t * stride_ik)  # t-th selected key block
        kpos = j * BLOCK_K + offs_k
        kpos64 = kpos.to(tl.int64)
        kv_ok = kpos < seqlen  # padding keys load as 0 (see forward.py)
        # as in the forward; here K's padding rows are zeroed too (dS there is 0, and 0 * NaN in dS K is NaN)
        crosses_length = j * BLOCK_K + BLOCK_K > seqlen
        k = load_key_tile(
            DESC_K,
            k_base,
            b,
            hkv,
            j,
            kpos64,
            offs_d,
            stride_kn,
            stride_kd,
            kv_ok,
            crosses_length,
            TMA_LOADS,
            HAS_SEQ_LENS,
            BLOCK_K,
            HEAD_DIM,
        )  # [BK, D]
        v = load_key_tile(
            DESC_V,
            v_base,
            b,
            hkv,
            j,
            kpos64,
            offs_d,
            stride_vn,
            stride_vd,
            kv_ok,
            crosses_length,
            TMA_LOADS,
            HAS_SEQ_LENS,
            BLOCK_K,
            HEAD_DIM,
        )  # [BK, D]
        s = dot(q, tl.trans(k), IEEE)  # [M, BK]
        dp = dot(do, tl.trans(v), IEEE)  # [M, BK]
        s = s * scale_log2
        s = mask_scores(
            s, qpos, kpos, seqlen, j * BLOCK_K, q_first, docs_row, doc_q, doc_q_last, N, HAS_DOCS, BLOCK_K
        )  # the forward's masks, skipped where it skipped them
        p = tl.exp2(s - lse2[:, None])  # [M, BK] normalised probabilities
        if DROPOUT:
            keep = dropout_keep(seed, row_counter[:, None] + kpos64[None, :], threshold)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])  # [M, BK]
        dq += dot(ds.to(k.dtype), k, IEEE)  # [M, D]
        if HAS_COLD:
            slot = tl.load(cold_slot_row + j)
            if slot >= 0:
                # cold block: add this tile's dK/dV share (summed over its heads by the dot)
                if DROPOUT:
                    z = tl.where(keep, p * inv_keep, 0.0)
                else:
                    z = p
                dv_part = dot(tl.trans(z.to(do.dtype)), do, IEEE)  # [BK, D]
                dk_part = dot(tl.trans(ds.to(q.dtype)), q, IEEE)  # [BK, D] (unscaled)
                workspace = slot.to(tl.int64) * (BLOCK_K * HEAD_DIM) + offs_k[:, None] * HEAD_DIM + offs_d[None, :]
                tl.atomic_add(DK_ATOMIC + workspace, dk_part, sem="relaxed")
                tl.atomic_add(DV_ATOMIC + workspace, dv_part, sem="relaxed")
    dq = dq * scale
    dq_ptrs = tile_pointers(
        DQ + b64 * stride_dqb + head64[:, None] * stride_dqh, qrow64, offs_d, stride_dqn, stride_dqd
    )
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    KV_QBLOCKS,
    KV_PAIRS,
    SEQ_LENS,
    DOCS,
    QUERY_MAP,
    QUERY_ROW0,
    ITEM_ROW,
    ITEM_T0,
    ITEM_T1,
    ITEM_PART,
    DK,
    DV,
    DK_PARTIAL,
    DV_PARTIAL,
    DQ_ACC,
    DS,
    DESC_Q,
    DESC_DO,
    DESC_DS,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    N,
    L,
    HQ,
    HKV,
    NKB,
    scale_log2,
    scale,
    seed,
    threshold,
    inv_keep,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    HAS_QUERY_MAP: tl.constexpr,
    FUSE_DQ: tl.constexpr,
    TMA_LOADS: tl.constexpr,
    STORE_DS: tl.constexpr,
    TMA_STORE_DS: tl.constexpr,
):
    # one work item = one KV block and a chunk [t0, t1) of its transposed row (the query blocks that
    # selected it); long rows (sinks, popular blocks) are chunked so no program becomes the long pole
    HEAD_SUBSETS: tl.constexpr = GROUP // HEADS_PER_PROGRAM
    # each query tile is walked in slices of TILE_ROWS rows: S^T and dP^T of a slice are what stays live
    # beside the two [BK, D] fp32 accumulators, so thinner slices keep the program out of local memory
    ROW_SLICES: tl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q // TILE_ROWS
    STEPS_PER_BLOCK: tl.constexpr = HEAD_SUBSETS * ROW_SLICES
    item = tl.program_id(0)
    kv_row = tl.load(ITEM_ROW + item)  # (b*HKV + hkv)*NKB + j
    if kv_row < 0:  # padding item: the grid is the schedule's shape bound, not its real length
        return
    t0 = tl.load(ITEM_T0 + item)
    t1 = tl.load(ITEM_T1 + item)
    part = tl.load(ITEM_PART + item)
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
    kv_ok = kpos < N  # rows of dK/dV this program writes
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    kv_in = kpos < seqlen  # padding keys load as 0 (see forward.py)
    k = tl.load(
        tile_pointers(K + b64 * stride_kb + hkv64 * stride_kh, kpos64, offs_d, stride_kn, stride_kd),
        mask=kv_in[:, None],
        other=0.0,
    )  # [BK, D]
    v = tl.load(
        tile_pointers(V + b64 * stride_vb + hkv64 * stride_vh, kpos64, offs_d, stride_vn, stride_vd),
        mask=kv_in[:, None],
        other=0.0,
    )  # [BK, D]
    if HAS_DOCS:
        docs_row = documents_row(DOCS, b64, N)
        doc_k = load_documents(docs_row, kpos, N)  # [BK]
    dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    # flat loop over (query block, head subset, row slice) in fixed order: deterministic and
    # pipelinable; the subset's heads are stacked along the query rows (wider tile products)
    for u in range(t0 * STEPS_PER_BLOCK, t1 * STEPS_PER_BLOCK):
        t = u // STEPS_PER_BLOCK
        head_subset = (u % STEPS_PER_BLOCK) // ROW_SLICES
        first_row = (u % ROW_SLICES) * TILE_ROWS
        qb_local = tl.load(KV_QBLOCKS + t)  # the plan lists LOCAL query blocks under a query-block map
        # [M] each, M = TILE_ROWS; the masks below test the whole query block (a superset of the slice)
        head, qpos = tile_row_slice(qb_local, hkv, head_subset, first_row, TILE_ROWS, GROUP, HEADS_PER_PROGRAM, BLOCK_Q)
        qb, qpos, qrow64 = map_query_rows(QUERY_MAP, QUERY_ROW0, qb_local, qpos, BLOCK_Q, HAS_QUERY_MAP)
        head64 = head.to(tl.int64)
        qpos64 = qpos.to(tl.int64)
        q_ok = qpos < N
        if TMA_LOADS:
            # one head per step and no query-block map (the launcher's condition): the slice is TILE_ROWS
            # consecutive rows of one head, rows past N arrive as 0
            slice_head = hkv * GROUP + head_subset
            slice_row = qb_local * BLOCK_Q + first_row
            q = DESC_Q.load([b, slice_head, slice_row, 0]).reshape(TILE_ROWS, HEAD_DIM)  # [M, D]
            do = DESC_DO.load([b, slice_head, slice_row, 0]).reshape(TILE_ROWS, HEAD_DIM)  # [M, D]
        else:
            q = load_rows(Q, b64, head64, qrow64, offs_d, stride_qb, stride_qh, stride_qn, stride_qd, q_ok)  # [M, D]
            do = load_rows(
                DO, b64, head64, qrow64, offs_d, stride_dob, stride_doh, stride_don, stride_dod, q_ok
            )  # [M, D]
        if HAS_QUERY_MAP:
            row = (b64 * HQ + head64) * L + qrow64  # [M] row of lse / delta ([B, HQ, L])
            counter_row = (b64 * HQ + head64) * N + qpos64  # [M] global (b, h, q) of the dropout counters
        else:
            row = (b64 * HQ + head64) * N + qpos64  # [M]
            counter_row = row
        lse2 = log2_lse(tl.load(LSE + row, mask=q_ok, other=float("-inf")))
        delta = tl.load(DELTA + row, mask=q_ok, other=0.0)
        st = dot(k, tl.trans(q), IEEE)  # [BK, M] = S^T
        dpt = dot(v, tl.trans(do), IEEE)  # [BK, M] = dP^T before dropout
        st = st * scale_log2
        if HAS_DOCS:  # the forward's masks, skipped where it skipped them (forward.py)
            if (
                (j * BLOCK_K + BLOCK_K - 1 > qb * BLOCK_Q)
                | (j * BLOCK_K + BLOCK_K > seqlen)
                | crosses_documents(docs_row, j * BLOCK_K, last_document(docs_row, qb * BLOCK_Q, BLOCK_Q, N))
            ):
                doc_q = load_documents(docs_row, qpos, N)  # [M]
                ok = (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] < seqlen) & (doc_k[:, None] == doc_q[None, :])
                st = tl.where(ok, st, float("-inf"))
        else:
            if (j * BLOCK_K + BLOCK_K - 1 > qb * BLOCK_Q) | (j * BLOCK_K + BLOCK_K > seqlen):
                ok = (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] < seqlen)
                st = tl.where(ok, st, float("-inf"))
        pt = tl.exp2(st - lse2[None, :])  # [BK, M]
        if DROPOUT:
            keep = dropout_keep(seed, counter_row[None, :] * N + kpos64[:, None], threshold)
            zt = tl.where(keep, pt * inv_keep, 0.0)
            dpt = tl.where(keep, dpt * inv_keep, 0.0)
        else:
            zt = pt
        dst = pt * (dpt - delta[None, :])  # [BK, M]
        dst_operand = dst.to(q.dtype)  # [BK, M], what the dK product (and, stored, the dQ product) takes
        dv += dot(zt.to(do.dtype), do, IEEE)  # [BK, D]
        dk += dot(dst_operand, q, IEEE)  # [BK, D]
        if STORE_DS:
            # filed under the pair's index slot as [slot, head in group, BK, BQ] (dS^T, so the rows of a
            # slice are contiguous); every selected pair's slices of every head pass here exactly once
            pair64 = tl.load(KV_PAIRS + t).to(tl.int64)
            if TMA_STORE_DS:
                # one head per step (the launcher's condition): the slice is one [BK, M] box of that head's tile,
                # written by the copy engine from shared memory while the program goes on
                DESC_DS.store(
                    [(pair64 * GROUP + head_subset).to(tl.int32), 0, first_row],
                    dst_operand.reshape(1, BLOCK_K, TILE_ROWS),
                )
            else:
                in_group64 = (head - hkv * GROUP).to(tl.int64)  # [M]
                row_in_block = (first_row + tl.arange(0, TILE_ROWS)) % BLOCK_Q  # [M]
                ds_ptrs = (
                    DS
                    + ((pair64 * GROUP + in_group64[None, :]) * BLOCK_K + offs_k[:, None]) * BLOCK_Q
                    + row_in_block[None, :]
                )  # [BK, M]
                tl.store(ds_ptrs, dst_operand)
        if FUSE_DQ:
            # this slice's share of dQ: the rows' other key blocks add theirs from other programs, in no
            # fixed order (float32 atomics into DQ_ACC [B, HQ, L, D], contiguous)
            dq_part = dot(tl.trans(dst.to(k.dtype)), k, IEEE) * scale  # [M, D]
            dq_rows = (b64 * HQ + head64) * L + qrow64  # [M]
            tl.atomic_add(
                DQ_ACC + dq_rows[:, None] * HEAD_DIM + offs_d[None, :], dq_part, mask=q_ok[:, None], sem="relaxed"
            )
    if part < 0:
        # whole row in this item: write dK/dV once, in the output dtype
        dk_ptrs = tile_pointers(DK + b64 * stride_dkb + hkv64 * stride_dkh, kpos64, offs_d, stride_dkn, stride_dkd)
        dv_ptrs = tile_pointers(DV + b64 * stride_dvb + hkv64 * stride_dvh, kpos64, offs_d, stride_dvn, stride_dvd)
        tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok[:, None])
    else:
        workspace = part.to(tl.int64) * (BLOCK_K * HEAD_DIM) + offs_k[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(DK_PARTIAL + workspace, dk)
        tl.store(DV_PARTIAL + workspace, dv)


@triton.jit
def _dq_from_ds_kernel(
    K,
    DS,
    INDICES,
    COUNTS,
    SEQ_LENS,
    QUERY_MAP,
    QUERY_ROW0,
    DQ,
    DESC_K,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    stride_ib,
    stride_ih,
    stride_iq,
    stride_ik,
    stride_cb,
    stride_ch,
    stride_cq,
    N,
    HKV,
    NQB,
    CAPACITY,
    scale,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_QUERY_MAP: tl.constexpr,
    TMA_LOADS: tl.constexpr,
):
    # stored-dS mode: dQ_q = scale sum_t dS[q, block t] K[block t], the dS tiles filed by the KV-centric kernel
    # under the index slot of (query block, t); masks, dropout and lse are already in them, so the only tile
    # product left is dS K, summed over the row in index order (deterministic)
    M: tl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q
    qb, b, hkv, head, qpos = query_tile(NQB, HKV, GROUP, HEADS_PER_PROGRAM, BLOCK_Q, True)  # head, qpos: [M]
    qb_global, qpos, qrow64 = map_query_rows(QUERY_MAP, QUERY_ROW0, qb, qpos, BLOCK_Q, HAS_QUERY_MAP)
    b64, hkv64, head64 = b.to(tl.int64), hkv.to(tl.int64), head.to(tl.int64)
    row_ok = qpos < N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    in_group64 = head64 - hkv64 * GROUP  # [M]
    row_in_block = tl.arange(0, M) % BLOCK_Q  # [M]
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    selected, count = index_row(
        INDICES, COUNTS, b64, hkv64, qb.to(tl.int64), stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq
    )
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    first_pair64 = ((b64 * HKV + hkv64) * NQB + qb) * CAPACITY  # the index slot of t = 0
    dq = tl.zeros([M, HEAD_DIM], tl.float32)
    for t in range(0, count):
        j = tl.load(selected + t * stride_ik)
        kpos = j * BLOCK_K + offs_k
        kv_ok = kpos < seqlen
        # K's rows in [seqlen, N) zeroed: dS is 0 there, and 0 * NaN padding would be NaN
        k = load_key_tile(
            DESC_K,
            k_base,
            b,
            hkv,
            j,
            kpos.to(tl.int64),
            offs_d,
            stride_kn,
            stride_kd,
            kv_ok,
            j * BLOCK_K + BLOCK_K > seqlen,
            TMA_LOADS,
            HAS_SEQ_LENS,
            BLOCK_K,
            HEAD_DIM,
        )  # [BK, D]
        dst = tl.load(
            DS
            + (((first_pair64 + t) * GROUP + in_group64[None, :]) * BLOCK_K + offs_k[:, None]) * BLOCK_Q
            + row_in_block[None, :]
        )  # [BK, M]
        dq += dot(tl.trans(dst), k, IEEE)  # [M, D]
    dq = dq * scale
    dq_ptrs = tile_pointers(
        DQ + b64 * stride_dqb + head64[:, None] * stride_dqh, qrow64, offs_d, stride_dqn, stride_dqd
    )
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_finish_kernel(
    COLD_SLOTS,
    PART_START,
    NUM_PARTS,
    DK,
    DV,
    DK_ATOMIC,
    DV_ATOMIC,
    DK_PARTIAL,
    DV_PARTIAL,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    N,
    HKV,
    NKB,
    scale,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_COLD: tl.constexpr,
    HAS_PARTS: tl.constexpr,
):
    # per KV block: cold -> convert its atomic workspace; chunked -> sum its partials in chunk order
    # (fixed order: deterministic); unselected -> zeros; rows in one work item were written already
    j = tl.program_id(0)
    batch_head = tl.program_id(1)
    b64 = (batch_head // HKV).to(tl.int64)
    hkv64 = (batch_head % HKV).to(tl.int64)
    kv_row = batch_head.to(tl.int64) * NKB + j
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM)
    kpos64 = (j * BLOCK_K + offs_k).to(tl.int64)
    kv_ok = kpos64 < N
    dk_ptrs = tile_pointers(DK + b64 * stride_dkb + hkv64 * stride_dkh, kpos64, offs_d, stride_dkn, stride_dkd)
    dv_ptrs = tile_pointers(DV + b64 * stride_dvb + hkv64 * stride_dvh, kpos64, offs_d, stride_dvn, stride_dvd)
    in_block = offs_k[:, None] * HEAD_DIM + offs_d[None, :]
    slot = tl.load(COLD_SLOTS + kv_row)
    num_parts = tl.load(NUM_PARTS + kv_row)  # -1: unselected; 0: written; >= 2: partials
    if HAS_COLD and slot >= 0:
        workspace = slot.to(tl.int64) * (BLOCK_K * HEAD_DIM) + in_block
        tl.store(dk_ptrs, (tl.load(DK_ATOMIC + workspace) * scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptrs, tl.load(DV_ATOMIC + workspace).to(DV.dtype.element_ty), mask=kv_ok[:, None])
    elif num_parts < 0:
        tl.store(dk_ptrs, tl.zeros([BLOCK_K, HEAD_DIM], tl.float32).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptrs, tl.zeros([BLOCK_K, HEAD_DIM], tl.float32).to(DV.dtype.element_ty), mask=kv_ok[:, None])
    elif HAS_PARTS and num_parts > 0:
        start = tl.load(PART_START + kv_row).to(tl.int64)
        dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
        for c in range(0, num_parts):
            workspace = (start + c) * (BLOCK_K * HEAD_DIM) + in_block
            dk += tl.load(DK_PARTIAL + workspace)
            dv += tl.load(DV_PARTIAL + workspace)
        tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok[:, None])
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def sparse_attn_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    indices,
    counts,
    kv_indptr,
    kv_qblocks,
    slots,
    num_cold,
    *,
    block_q,
    block_k,
    scale,
    seq_lens=None,
    dlse=None,
    dropout_p=0.0,
    dropout_seed=0,
    config=None,
    stage_events=None,
    document_ids=None,
    query_map=None,
    query_row0=None,
    kv_pairs=None,
):
    """Launch the backward.  ``slots`` from ``plan.cold_slots`` (int32 ``[B*HKV*NKB]``); ``num_cold`` =
    blocks of the atomic workspace, at least the number of slots >= 0 (``plan.cold_capacity``: a shape
    bound; 0 when no block is cold, e.g. in deterministic mode); ``config``: a ``plan.BackwardConfig`` (default
    ``plan.tuning.backward_config``).  Returns (dq, dk, dv) in q/k/v dtypes.  ``stage_events``: optional 4 CUDA
    events recorded at start / after delta, scheduling and workspace zeroing / after the dQ (+atomic)
    kernel / after the KV-centric and finish kernels (stored-dS mode runs the dQ kernel last: its third event
    follows the KV-centric and finish kernels, the fourth the dQ kernel).  ``kv_pairs``: the plan's
    ``kv_pairs``, needed in stored-dS mode (``config.stored_ds``) only.  ``document_ids``: int ``[B, N]``
    (non-decreasing) or None, the forward's.  No validation here (op.py validates), but every tensor argument is
    either passed with its strides (q, k, v, o, do, indices, counts) or made contiguous here (lse, dlse,
    seq_lens, document_ids and the plan arrays kv_indptr, kv_qblocks, kv_pairs, slots, which the kernels index
    without strides).

    Query-block map (context parallelism; see ``forward.sparse_attn_forward``): with ``query_map`` /
    ``query_row0`` q, o, do, lse (and dlse) hold the ``L`` rows of the listed query blocks, indices /
    counts the index rows of those blocks, and the plan (kv_indptr, kv_qblocks, slots) is built from those
    rows (``plan.build_plan(index, r0, query_blocks=...)``: LOCAL query-block ids). dq comes back
    ``[B, HQ, L, D]``; dk, dv are the full ``[B, HKV, N, D]`` contributions of these query rows (zero where
    no listed block selected a key block)."""
    B, HQ, L, D = q.shape
    N = k.shape[2]
    HKV = k.shape[1]
    group = HQ // HKV
    NQB = indices.shape[2]
    NKB = triton.cdiv(N, block_k)
    if B == 0:  # no sequence: empty gradients, nothing to launch (and a TMA descriptor takes no zero extent)
        for event in stage_events or ():
            event.record()
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if config is None:
        config = backward_config(group, block_q, block_k, D, num_cold > 0)
    dropout = dropout_p > 0.0
    threshold = int(dropout_threshold(dropout_p)) if dropout else 0
    inv_keep = 1.0 / (1.0 - dropout_p) if dropout else 1.0
    ieee = q.dtype == torch.float32
    if do.stride(-1) != 1:  # any other layout is read through its strides (the output's [B, L, HQ, D] one)
        do = do.contiguous()
    lse = lse.contiguous()
    kv_indptr = kv_indptr.contiguous()
    kv_qblocks = kv_qblocks.contiguous()
    slots = slots.contiguous()
    seq_lens_arg = kernel_seq_lens(seq_lens, N, counts)
    docs_arg = kernel_document_ids(document_ids, counts)
    has_docs = document_ids is not None
    seed = philox_key(dropout_seed)
    has_map = query_map is not None
    query_map, query_row0 = kernel_query_map(query_map, query_row0, counts)

    if stage_events:
        stage_events[0].record()
    delta = torch.empty((B, HQ, L), device=q.device, dtype=torch.float32)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    _delta_kernel[(triton.cdiv(L, _DELTA_ROWS), B * HQ)](
        o,
        do,
        delta,
        dlse if dlse is not None else delta,
        *o.stride(),
        *do.stride(),
        L,
        HQ,
        BLOCK_ROWS=_DELTA_ROWS,
        HEAD_DIM=D,
        HAS_DLSE=dlse is not None,
        num_warps=4,
    )
    # sized from shapes (no host read of the real item count): padding items return at once
    num_items, num_parts = kv_schedule_capacity(kv_indptr.numel() - 1, NQB, kv_qblocks.numel(), config.kv_chunk)
    schedule = kv_schedule(
        kv_indptr[1:] - kv_indptr[:-1], kv_indptr, slots, config.kv_chunk, num_items=num_items, num_parts=num_parts
    )

    has_cold = num_cold > 0
    if has_cold:
        dk_atomic = torch.zeros((num_cold, block_k, D), device=q.device, dtype=torch.float32)
        dv_atomic = torch.zeros((num_cold, block_k, D), device=q.device, dtype=torch.float32)
    else:
        dk_atomic = dv_atomic = delta  # unused
    if schedule.total_parts > 0:
        dk_partial = torch.empty((schedule.total_parts, block_k, D), device=q.device, dtype=torch.float32)
        dv_partial = torch.empty((schedule.total_parts, block_k, D), device=q.device, dtype=torch.float32)
    else:
        dk_partial = dv_partial = delta  # unused
    fused = bool(config.fused_dq)
    stored = bool(config.stored_ds)
    if (fused or stored) and has_cold:
        raise ValueError(
            "the fused and the stored-dS backward (kernel_options.fused_dq / stored_ds) need every "
            "block KV-centric: num_cold must be 0"
        )
    if fused and stored:
        raise ValueError("config.fused_dq and config.stored_ds are two ways of producing dQ; set at most one")
    if stored and kv_pairs is None:
        raise ValueError("the stored-dS backward (kernel_options.stored_ds) needs the plan's kv_pairs")
    if fused:
        dq_acc = torch.zeros((B, HQ, L, D), device=q.device, dtype=torch.float32)
    else:
        dq = torch.empty_like(q)
        dq_acc = delta  # unused
    if stored:
        # one [BK, BQ] tile per index slot and query head; slots past a row's count are never written or read
        ds = torch.empty((indices.numel() * group, block_k, block_q), device=q.device, dtype=q.dtype)
        kv_pairs = kv_pairs.contiguous()
    else:
        ds = delta  # unused
        kv_pairs = kv_qblocks  # unused
    # the gradients in their inputs' layouts: the projections' [B, N, H, D] memory flows back without a copy
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if stage_events:
        stage_events[1].record()
    scale_log2 = float(scale * LOG2E.value)
    # the Gluon kernels where they apply (one check of what they share); the Triton kernels' TMA descriptors are
    # built only for the Triton kernels that run
    gluon = (
        bool(config.dq_gluon or config.kv_gluon)
        and not (fused or stored)
        and gluon_call_supported(
            q,
            k,
            v,
            do,
            block_q=block_q,
            block_k=block_k,
            has_seq_lens=seq_lens is not None,
            has_docs=has_docs,
            dropout=dropout,
            query_map=has_map,
        )
        is None
    )
    dq_gluon = (
        gluon
        and bool(config.dq_gluon)
        and gluon_dq_tiles_supported(
            block_q=block_q, heads_per_program=config.dq_gluon_heads_per_program, has_cold=has_cold
        )
        is None
    )
    kv_gluon = (
        gluon
        and bool(config.kv_gluon)
        and gluon_kv_tiles_supported(
            block_q=block_q,
            tile_rows=config.gluon_tile_rows,
            heads_per_step=config.kv_heads_per_program,
            block_k=block_k,
            key_rows=config.gluon_key_rows,
        )
        is None
    )
    k_operand, v_operand, dq_tma = tma_operands(k, v, block_k, bool(config.dq_tma) and not fused and not dq_gluon)
    # the KV-centric kernel's TMA slices are rows of one head: one head per step, rows of q = positions
    kv_slices = bool(config.kv_tma) and config.kv_heads_per_program == 1 and not has_map
    q_operand, do_operand, kv_tma = tma_operands(q, do, config.kv_tile_rows, kv_slices and not kv_gluon)
    # the dS slices go out through a descriptor under the same conditions as the q/dO slices come in (a slice is
    # then rows of one head); tile ids are int32 coordinates
    ds_operand = (
        tma_descriptor(ds, 0, stored and kv_slices and 0 < ds.shape[0] < 2**31, block=[1, block_k, config.kv_tile_rows])
        if stored
        else None
    )
    ds_tma = ds_operand is not None
    if not ds_tma:
        ds_operand = ds
    if dq_gluon:
        LAST_COMPILED["dq"] = launch_dq_gluon(
            q,
            k,
            v,
            do,
            lse,
            delta,
            indices,
            counts,
            dq,
            docs_arg if has_docs else None,
            block_q=block_q,
            block_k=block_k,
            scale=float(scale),
            heads_per_program=config.dq_gluon_heads_per_program,
            num_buf=config.dq_gluon_stages,
        )
    elif not (fused or stored):
        LAST_COMPILED["dq"] = launch(
            _dq_kernel,
            (NQB * (group // config.dq_heads_per_program), B * HKV),
            q,
            k,
            v,
            do,
            lse,
            delta,
            indices,
            counts,
            seq_lens_arg,
            docs_arg,
            query_map,
            query_row0,
            slots,
            dq,
            dk_atomic,
            dv_atomic,
            k_operand,
            v_operand,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *dq.stride(),
            *indices.stride(),
            *counts.stride(),
            N,
            L,
            HQ,
            HKV,
            NQB,
            NKB,
            scale_log2,
            float(scale),
            seed,
            threshold,
            inv_keep,
            GROUP=group,
            HEADS_PER_PROGRAM=config.dq_heads_per_program,
            BLOCK_Q=block_q,
            BLOCK_K=block_k,
            HEAD_DIM=D,
            HAS_SEQ_LENS=seq_lens is not None,
            DROPOUT=dropout,
            HAS_COLD=has_cold,
            IEEE=ieee,
            HAS_DOCS=has_docs,
            HAS_QUERY_MAP=has_map,
            TMA_LOADS=dq_tma,
            num_warps=config.dq_num_warps,
            num_stages=config.dq_num_stages,
        )
    if stage_events and not stored:
        stage_events[2].record()
    num_items = schedule.item_row.numel()
    if num_items > 0 and kv_gluon:
        LAST_COMPILED["dkdv"] = launch_dkdv_gluon(
            q,
            k,
            v,
            do,
            lse,
            delta,
            kv_qblocks,
            schedule.item_row,
            schedule.item_t0,
            schedule.item_t1,
            schedule.item_part,
            dk,
            dv,
            dk_partial,
            dv_partial,
            docs_arg if has_docs else None,
            block_q=block_q,
            block_k=block_k,
            scale=float(scale),
            tile_rows=config.gluon_tile_rows,
            num_buf=config.gluon_stages,
            key_rows=config.gluon_key_rows,
        )
    elif num_items > 0:
        LAST_COMPILED["dkdv"] = launch(
            _dkdv_kernel,
            (num_items,),
            q,
            k,
            v,
            do,
            lse,
            delta,
            kv_qblocks,
            kv_pairs,
            seq_lens_arg,
            docs_arg,
            query_map,
            query_row0,
            schedule.item_row,
            schedule.item_t0,
            schedule.item_t1,
            schedule.item_part,
            dk,
            dv,
            dk_partial,
            dv_partial,
            dq_acc,
            ds,
            q_operand,
            do_operand,
            ds_operand,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *dk.stride(),
            *dv.stride(),
            N,
            L,
            HQ,
            HKV,
            NKB,
            scale_log2,
            float(scale),
            seed,
            threshold,
            inv_keep,
            GROUP=group,
            HEADS_PER_PROGRAM=config.kv_heads_per_program,
            BLOCK_Q=block_q,
            BLOCK_K=block_k,
            HEAD_DIM=D,
            HAS_SEQ_LENS=seq_lens is not None,
            DROPOUT=dropout,
            IEEE=ieee,
            HAS_DOCS=has_docs,
            TILE_ROWS=config.kv_tile_rows,
            HAS_QUERY_MAP=has_map,
            FUSE_DQ=fused,
            TMA_LOADS=kv_tma,
            STORE_DS=stored,
            TMA_STORE_DS=ds_tma,
            num_warps=config.kv_num_warps,
            num_stages=config.kv_num_stages,
        )
    _dkdv_finish_kernel[(NKB, B * HKV)](
        slots,
        schedule.part_start,
        schedule.num_parts,
        dk,
        dv,
        dk_atomic,
        dv_atomic,
        dk_partial,
        dv_partial,
        *dk.stride(),
        *dv.stride(),
        N,
        HKV,
        NKB,
        float(scale),
        BLOCK_K=block_k,
        HEAD_DIM=D,
        HAS_COLD=has_cold,
        HAS_PARTS=schedule.total_parts > 0,
        num_warps=4,
    )
    if fused:
        dq = torch.empty_like(q).copy_(dq_acc)
    if stored:
        if stage_events:
            stage_events[2].record()
        LAST_COMPILED["dq"] = launch(
            _dq_from_ds_kernel,
            (NQB * (group // config.dq_heads_per_program), B * HKV),
            k,
            ds,
            indices,
            counts,
            seq_lens_arg,
            query_map,
            query_row0,
            dq,
            k_operand,
            *k.stride(),
            *dq.stride(),
            *indices.stride(),
            *counts.stride(),
            N,
            HKV,
            NQB,
            indices.shape[3],
            float(scale),
            GROUP=group,
            HEADS_PER_PROGRAM=config.dq_heads_per_program,
            BLOCK_Q=block_q,
            BLOCK_K=block_k,
            HEAD_DIM=D,
            HAS_SEQ_LENS=seq_lens is not None,
            IEEE=ieee,
            HAS_QUERY_MAP=has_map,
            TMA_LOADS=dq_tma,
            num_warps=config.dq_num_warps,
            num_stages=config.dq_num_stages,
        )
    if stage_events:
        stage_events[3].record()
    return dq, dk, dv
