"""The block-sparse backward's KV-centric dK/dV and query-centric dQ kernels, hand-scheduled in Gluon for Hopper.

Math (as backward.py: causal, length and document masks; no dropout):
    P^T = exp2(scale_log2 K Q^T - lse2);  dS^T = P^T (V dO^T - delta)
    dV_k = sum_{h in group, q} P^T dO;  dK_k = scale sum_{h in group, q} dS^T Q

Notation: as backward.py; M = TILE_ROWS query rows per step (one head, one row slice of a query block);
KR = KEY_ROWS key rows per program (all of the block's BK, or a slice); NUM_BUF = the depth of the q/dO ring in
shared memory. One program = one work item of the KV schedule
(a KV block and a chunk [t0, t1) of its transposed row), exactly the Triton kernel's items, so the plan,
the chunk partials and the finish kernel are shared with it.

What the hand schedule adds over the Triton kernel (whose tile products wait for each other): the q/dO
slices of step u + NUM_BUF - 1 are in flight by TMA while step u computes; the scores' softmax overlaps
the dP^T product; the dK/dV products of step u run while step u + 1 waits for its tiles and loads its lse
and delta (warpgroup MMAs issued asynchronously, waited for only where a result is read).

Known limits (the launcher falls back to the Triton kernel outside them, :func:`gluon_kv_supported`):
Hopper (sm_90) only, bf16/fp16, [B, H, N, D] tensors in layouts TMA addresses (any strides with the last
one 1, e.g. the projections' [B, N, H, D] memory), N a multiple of BLOCK_Q (key rows past N arrive as zeros
and are masked as in the Triton kernel; query rows past N would need masked lse/delta loads, whose registers
spill the accumulators at D = 128), BLOCK_K in {64, 128}, no dropout, sequence lengths or query-block map, one
head per step. A program takes KEY_ROWS (64 or 128) rows of its block, 4 warps per 64 rows: a 128-key block runs as
two 64-row programs by default (``plan.tuning.GLUON_KEY_ROWS``), each loading the item's q/dO slices itself; 128 x 128
key
tiles at D = 128 (one program per block) spill a few bytes (ptxas of triton 3.6). The
dQ kernel (``_dq_gluon_kernel``, :func:`gluon_dq_supported`) is the query tile of ``_dq_kernel``: q and dO once
by TMA, the K/V tiles of its index row through a ring (``_gluon.kv_ring``), S and dP as asynchronous MMAs; it
leaves cold blocks (atomic dK/dV) to the Triton kernel. Gluon kernels cannot run in Triton's interpreter; the CPU
tests compile them for sm_90a instead (tests/kernels/test_kernel_gluon.py).
"""

from __future__ import annotations

import triton

from ...plan.tuning import GLUON_KEY_ROWS
from .common import HAS_GLUON, LOG2E, gluon_call_supported, gluon_descriptor

if HAS_GLUON:
    from .common import (
        gl,
        gluon,
        invalidate_ring,
        issue_kv_load,
        kv_ring,
        mask_query_scores,
        mbarrier,
        query_documents,
        query_program,
        store_query_rows,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

__all__ = [
    "HAS_GLUON",
    "dkdv_gluon_arguments",
    "dq_gluon_arguments",
    "gluon_dq_supported",
    "gluon_kv_supported",
    "launch_dkdv_gluon",
    "launch_dq_gluon",
]


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
if HAS_GLUON:

    @gluon.jit
    def _issue_qdo_load(
        desc_q,
        desc_do,
        q_ring,
        do_ring,
        ready,
        KV_QBLOCKS,
        t0,
        hkv,
        b,
        u,
        GROUP: gl.constexpr,
        ROW_SLICES: gl.constexpr,
        BLOCK_Q: gl.constexpr,
        TILE_ROWS: gl.constexpr,
        NUM_BUF: gl.constexpr,
    ):
        # step u of the item: query block t0 + u // (GROUP * ROW_SLICES), head (u // ROW_SLICES) % GROUP,
        # row slice u % ROW_SLICES; its q and dO slices ([1, 1, M, D] boxes, rows past N arrive as 0) land in
        # ring slot u % NUM_BUF
        steps_per_block: gl.constexpr = GROUP * ROW_SLICES
        qb = gl.load(KV_QBLOCKS + t0 + u // steps_per_block)
        head = hkv * GROUP + (u % steps_per_block) // ROW_SLICES
        row = qb * BLOCK_Q + (u % ROW_SLICES) * TILE_ROWS
        slot = u % NUM_BUF
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [b, head, row, 0], bar, q_ring.index(slot))
        tma.async_copy_global_to_shared(desc_do, [b, head, row, 0], bar, do_ring.index(slot))

    @gluon.jit
    def _dkdv_gluon_kernel(
        desc_q,
        desc_do,
        desc_k,
        desc_v,
        LSE,
        DELTA,
        KV_QBLOCKS,
        ITEM_ROW,
        ITEM_T0,
        ITEM_T1,
        ITEM_PART,
        DK,
        DV,
        DK_PARTIAL,
        DV_PARTIAL,
        DOCS,
        stride_dkb,
        stride_dkh,
        stride_dkn,
        stride_dkd,
        stride_dvb,
        stride_dvh,
        stride_dvn,
        stride_dvd,
        N,
        HQ,
        HKV,
        NKB,
        scale_log2,
        scale,
        GROUP: gl.constexpr,
        BLOCK_Q: gl.constexpr,
        BLOCK_K: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        TILE_ROWS: gl.constexpr,
        KEY_ROWS: gl.constexpr,
        NUM_BUF: gl.constexpr,
        HAS_DOCS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        ROW_SLICES: gl.constexpr = BLOCK_Q // TILE_ROWS
        STEPS_PER_BLOCK: gl.constexpr = GROUP * ROW_SLICES
        KEY_SLICES: gl.constexpr = BLOCK_K // KEY_ROWS
        # one warpgroup per 64 key rows: both MMA shapes split the key rows over the warps, so a score
        # tile's rows are held by the warps that hold the same dK/dV rows (the P^T -> operand conversion
        # stays inside each thread)
        scores_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, TILE_ROWS, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        key_rows_layout: gl.constexpr = gl.SliceLayout(1, scores_layout)
        query_cols_layout: gl.constexpr = gl.SliceLayout(0, scores_layout)

        # KEY_SLICES programs per work item, each the dK/dV of KEY_ROWS keys of the block (neighbouring program
        # ids: the slices of one item read the same q/dO slices at about the same time, from L2)
        item = gl.program_id(0) // KEY_SLICES
        key_row0_in_block = (gl.program_id(0) % KEY_SLICES) * KEY_ROWS
        kv_row = gl.load(ITEM_ROW + item)  # (b*HKV + hkv)*NKB + j; -1: padding item
        if kv_row >= 0:
            t0 = gl.load(ITEM_T0 + item)
            t1 = gl.load(ITEM_T1 + item)
            part = gl.load(ITEM_PART + item)
            j = kv_row % NKB
            batch_head = kv_row // NKB
            b = batch_head // HKV
            hkv = batch_head % HKV
            num_steps = (t1 - t0) * STEPS_PER_BLOCK

            # TMA boxes are [1, 1, rows, D] (a head's rows of a [B, H, N, D] tensor of any strides); the tile
            # products take them as [rows, D] views
            k_box = gl.allocate_shared_memory(desc_k.dtype, desc_k.block_type.shape, desc_k.layout)
            v_box = gl.allocate_shared_memory(desc_v.dtype, desc_v.block_type.shape, desc_v.layout)
            q_ring = gl.allocate_shared_memory(desc_q.dtype, [NUM_BUF, 1, 1, TILE_ROWS, HEAD_DIM], desc_q.layout)
            do_ring = gl.allocate_shared_memory(desc_do.dtype, [NUM_BUF, 1, 1, TILE_ROWS, HEAD_DIM], desc_do.layout)
            kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_ready, count=1)
            for i in gl.static_range(NUM_BUF):
                mbarrier.init(ready.index(i), count=1)

            mbarrier.expect(kv_ready, 2 * desc_k.block_type.nbytes)
            key_row0 = j * BLOCK_K + key_row0_in_block
            tma.async_copy_global_to_shared(desc_k, [b, hkv, key_row0, 0], kv_ready, k_box)
            tma.async_copy_global_to_shared(desc_v, [b, hkv, key_row0, 0], kv_ready, v_box)
            for i in gl.static_range(NUM_BUF - 1):
                if i < num_steps:
                    _issue_qdo_load(
                        desc_q,
                        desc_do,
                        q_ring,
                        do_ring,
                        ready,
                        KV_QBLOCKS,
                        t0,
                        hkv,
                        b,
                        i,
                        GROUP,
                        ROW_SLICES,
                        BLOCK_Q,
                        TILE_ROWS,
                        NUM_BUF,
                    )

            k_smem = k_box.reshape([KEY_ROWS, HEAD_DIM])
            v_smem = v_box.reshape([KEY_ROWS, HEAD_DIM])
            kpos = key_row0 + gl.arange(0, KEY_ROWS, key_rows_layout)  # [KR]
            offs_m = gl.arange(0, TILE_ROWS, query_cols_layout)  # [M]
            # the block's last key is past a query of some step's block (the diagonal), or past N: mask. Decided
            # per block, as in the Triton kernel, also for a slice that needs no mask (masking it changes nothing)
            masked_block = j * BLOCK_K + BLOCK_K > N
            if HAS_DOCS:  # the key side of the document mask: ids of the block's keys, of its first key
                docs_row = DOCS + b.to(gl.int64) * N
                doc_k = gl.load(docs_row + kpos, mask=kpos < N, other=-1)  # [KR]
                doc_k_first = gl.load(docs_row + j * BLOCK_K)
            zero_scores = gl.zeros([KEY_ROWS, TILE_ROWS], gl.float32, scores_layout)
            # loop-carried as in-flight accumulators: each step's dK/dV products are waited for by the next
            dk = warpgroup_mma_init(gl.zeros([KEY_ROWS, HEAD_DIM], gl.float32, acc_layout))
            dv = warpgroup_mma_init(gl.zeros([KEY_ROWS, HEAD_DIM], gl.float32, acc_layout))
            mbarrier.wait(kv_ready, phase=0)
            for u in range(num_steps):
                slot = u % NUM_BUF
                qb = gl.load(KV_QBLOCKS + t0 + u // STEPS_PER_BLOCK)
                head = hkv * GROUP + (u % STEPS_PER_BLOCK) // ROW_SLICES
                first_row = (u % ROW_SLICES) * TILE_ROWS
                q_slot = q_ring.index(slot).reshape([TILE_ROWS, HEAD_DIM])  # [M, D]
                do_slot = do_ring.index(slot).reshape([TILE_ROWS, HEAD_DIM])  # [M, D]
                mbarrier.wait(ready.index(slot), phase=(u // NUM_BUF) & 1)
                st = warpgroup_mma(
                    k_smem, q_slot.permute((1, 0)), zero_scores, use_acc=False, is_async=True
                )  # [KR, M] = K Q^T
                dpt = warpgroup_mma(
                    v_smem, do_slot.permute((1, 0)), zero_scores, use_acc=False, is_async=True
                )  # [KR, M] = V dO^T
                qpos = qb * BLOCK_Q + first_row + offs_m  # [M]
                # [M] rows of lse / delta ([B, HQ, N] contiguous); every query row is < N (N a multiple of
                # BLOCK_Q: unmasked loads, whose masks would cost the registers the accumulators need)
                row = (b * HQ + head).to(gl.int64) * N + qpos
                lse = gl.load(LSE + row)
                lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
                delta = gl.load(DELTA + row)
                # S^T done (and with it the previous step's dK/dV products, issued before it): the ring slot
                # they read is free for the step NUM_BUF - 1 ahead
                st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
                if u + NUM_BUF - 1 < num_steps:
                    _issue_qdo_load(
                        desc_q,
                        desc_do,
                        q_ring,
                        do_ring,
                        ready,
                        KV_QBLOCKS,
                        t0,
                        hkv,
                        b,
                        u + NUM_BUF - 1,
                        GROUP,
                        ROW_SLICES,
                        BLOCK_Q,
                        TILE_ROWS,
                        NUM_BUF,
                    )
                st = st * scale_log2
                edge = masked_block | (j * BLOCK_K + BLOCK_K - 1 > qb * BLOCK_Q)
                if HAS_DOCS:  # the forward's masks, where it had them (a block before the whole query block holds
                    # two documents iff its first key's id differs from the query block's last id)
                    if edge | (doc_k_first != gl.load(docs_row + qb * BLOCK_Q + BLOCK_Q - 1)):
                        doc_q = gl.load(docs_row + qpos)  # [M]
                        ok = (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] < N) & (doc_k[:, None] == doc_q[None, :])
                        st = gl.where(ok, st, float("-inf"))
                else:
                    if edge:  # the forward's masks, where it had them
                        ok = (kpos[:, None] <= qpos[None, :]) & (kpos[:, None] < N)
                        st = gl.where(ok, st, float("-inf"))
                pt = gl.exp2(st - lse2[None, :])  # [KR, M]
                dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
                dst = pt * (dpt - delta[None, :])  # [KR, M]
                pt_operand = gl.convert_layout(pt.to(desc_do.dtype), operand_layout)
                dst_operand = gl.convert_layout(dst.to(desc_q.dtype), operand_layout)
                dv = warpgroup_mma(pt_operand, do_slot, dv, is_async=True)  # [KR, D]
                dk = warpgroup_mma(dst_operand, q_slot, dk, is_async=True)  # [KR, D]
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            mbarrier.invalidate(kv_ready)
            for i in gl.static_range(NUM_BUF):
                mbarrier.invalidate(ready.index(i))

            rows = gl.arange(0, KEY_ROWS, gl.SliceLayout(1, acc_layout))
            cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, acc_layout))
            if part < 0:
                # whole row in this item: dK/dV once, in the output dtype, through their strides
                kpos64 = (key_row0 + rows).to(gl.int64)
                kv_ok = (key_row0 + rows < N)[:, None]
                dk_ptrs = (
                    DK
                    + b.to(gl.int64) * stride_dkb
                    + hkv.to(gl.int64) * stride_dkh
                    + kpos64[:, None] * stride_dkn
                    + cols[None, :] * stride_dkd
                )
                dv_ptrs = (
                    DV
                    + b.to(gl.int64) * stride_dvb
                    + hkv.to(gl.int64) * stride_dvh
                    + kpos64[:, None] * stride_dvn
                    + cols[None, :] * stride_dvd
                )
                gl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
                gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)
            else:
                block_rows = key_row0_in_block + rows
                workspace = part.to(gl.int64) * (BLOCK_K * HEAD_DIM) + block_rows[:, None] * HEAD_DIM + cols[None, :]
                gl.store(DK_PARTIAL + workspace, dk)
                gl.store(DV_PARTIAL + workspace, dv)

    @gluon.jit
    def _dq_gluon_kernel(
        desc_q,
        desc_do,
        desc_k,
        desc_v,
        LSE,
        DELTA,
        INDICES,
        COUNTS,
        DQ,
        DOCS,
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
        HQ,
        HKV,
        NQB,
        scale_log2,
        scale,
        GROUP: gl.constexpr,
        HEADS_PER_PROGRAM: gl.constexpr,
        BLOCK_Q: gl.constexpr,
        BLOCK_K: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        NUM_BUF: gl.constexpr,
        HAS_DOCS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # one program = the query tile of _dq_kernel: HEADS_PER_PROGRAM heads of one query block stacked into
        # M rows, walking its index row; the tile of q and dO stays in shared memory, K/V tiles stream through
        # a ring filled NUM_BUF - 1 steps ahead
        M: gl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q
        # one warpgroup per 64 query rows in both MMA shapes, so a score row is held by the warps that hold
        # the same dQ row (the dS -> operand conversion stays inside each thread)
        scores_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_K, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

        qb, b, hkv, first_head, count, selected = query_program(
            INDICES,
            COUNTS,
            stride_ib,
            stride_ih,
            stride_iq,
            stride_cb,
            stride_ch,
            stride_cq,
            HKV,
            NQB,
            GROUP,
            HEADS_PER_PROGRAM,
        )
        # q and dO arrive as [1, HEADS_PER_PROGRAM, BQ, D] boxes (the heads' rows of a [B, H, N, D] tensor of
        # any strides); the tile products take them as [M, D]
        q_box = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)
        do_box = gl.allocate_shared_memory(desc_do.dtype, desc_do.block_type.shape, desc_do.layout)
        qdo_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_ready, count=1)
        mbarrier.expect(qdo_ready, 2 * desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [b, first_head, qb * BLOCK_Q, 0], qdo_ready, q_box)
        tma.async_copy_global_to_shared(desc_do, [b, first_head, qb * BLOCK_Q, 0], qdo_ready, do_box)
        k_ring, v_ring, ready = kv_ring(desc_k, desc_v, selected, stride_ik, b, hkv, count, BLOCK_K, HEAD_DIM, NUM_BUF)

        q_smem = q_box.reshape([M, HEAD_DIM])
        do_smem = do_box.reshape([M, HEAD_DIM])
        offs_m = gl.arange(0, M, gl.SliceLayout(1, scores_layout))  # [M]
        offs_k = gl.arange(0, BLOCK_K, gl.SliceLayout(0, scores_layout))  # [BK]
        qpos = qb * BLOCK_Q + offs_m % BLOCK_Q  # [M]
        docs_row, doc_q, doc_q_last = query_documents(DOCS, b, qb, qpos, N, BLOCK_Q, HAS_DOCS)
        # [M] rows of lse / delta ([B, HQ, N] contiguous); every query row is < N (N a multiple of BLOCK_Q)
        row = (b * HQ + first_head + offs_m // BLOCK_Q).to(gl.int64) * N + qpos
        lse = gl.load(LSE + row)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = gl.load(DELTA + row)
        zero_scores = gl.zeros([M, BLOCK_K], gl.float32, scores_layout)
        # loop-carried as an in-flight accumulator: each step's dQ product is waited for by the next step
        dq = warpgroup_mma_init(gl.zeros([M, HEAD_DIM], gl.float32, acc_layout))
        mbarrier.wait(qdo_ready, phase=0)
        for t in range(count):
            slot = t % NUM_BUF
            j = gl.load(selected + t * stride_ik)
            k_slot = k_ring.index(slot).reshape([BLOCK_K, HEAD_DIM])  # [BK, D]
            v_slot = v_ring.index(slot).reshape([BLOCK_K, HEAD_DIM])  # [BK, D]
            mbarrier.wait(ready.index(slot), phase=(t // NUM_BUF) & 1)
            s = warpgroup_mma(
                q_smem, k_slot.permute((1, 0)), zero_scores, use_acc=False, is_async=True
            )  # [M, BK] = Q K^T
            dp = warpgroup_mma(
                do_smem, v_slot.permute((1, 0)), zero_scores, use_acc=False, is_async=True
            )  # [M, BK] = dO V^T
            # S done (and with it the previous step's dQ product, issued before it): the ring slot that product
            # read is free for the step NUM_BUF - 1 ahead
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            if t + NUM_BUF - 1 < count:
                issue_kv_load(
                    desc_k,
                    desc_v,
                    k_ring,
                    v_ring,
                    ready,
                    selected,
                    stride_ik,
                    b,
                    hkv,
                    t + NUM_BUF - 1,
                    BLOCK_K,
                    NUM_BUF,
                )
            s = mask_query_scores(
                s * scale_log2, qb, j, qpos, offs_k, N, docs_row, doc_q, doc_q_last, BLOCK_Q, BLOCK_K, HAS_DOCS
            )
            p = gl.exp2(s - lse2[:, None])  # [M, BK]
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
            ds = p * (dp - delta[:, None])  # [M, BK]
            ds_operand = gl.convert_layout(ds.to(desc_k.dtype), operand_layout)
            dq = warpgroup_mma(ds_operand, k_slot, dq, is_async=True)  # [M, D]
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.invalidate(qdo_ready)
        invalidate_ring(ready, NUM_BUF)
        store_query_rows(
            DQ,
            dq * scale,
            b,
            first_head,
            qb,
            stride_dqb,
            stride_dqh,
            stride_dqn,
            stride_dqd,
            BLOCK_Q,
            M,
            HEAD_DIM,
            acc_layout,
        )


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def gluon_kv_supported(
    q,
    k,
    v,
    do,
    *,
    block_q: int,
    block_k: int,
    tile_rows: int,
    heads_per_step: int,
    has_seq_lens: bool,
    has_docs: bool,
    dropout: bool,
    query_map: bool,
    key_rows: int = GLUON_KEY_ROWS,
) -> str | None:
    """None when the Gluon KV-centric kernel can take this call, else why not (the launcher then runs the
    Triton kernel)."""
    common = gluon_call_supported(
        q,
        k,
        v,
        do,
        block_q=block_q,
        block_k=block_k,
        has_seq_lens=has_seq_lens,
        has_docs=has_docs,
        dropout=dropout,
        query_map=query_map,
    )
    if common is not None:
        return common
    return gluon_kv_tiles_supported(
        block_q=block_q, tile_rows=tile_rows, heads_per_step=heads_per_step, block_k=block_k, key_rows=key_rows
    )


def gluon_kv_key_rows(block_k: int, key_rows: int) -> int:
    """Key rows one Gluon KV-centric program takes: ``key_rows`` (``BackwardConfig.gluon_key_rows``), at most the
    block's ``block_k``."""
    return min(block_k, key_rows)


def gluon_kv_tiles_supported(
    *, block_q: int, tile_rows: int, heads_per_step: int, block_k: int, key_rows: int = GLUON_KEY_ROWS
) -> str | None:
    """The KV-centric Gluon kernel's own conditions, beyond those every Gluon kernel shares
    (``_gluon.gluon_call_supported``): None, or why not."""
    if heads_per_step != 1:
        return "more than one head per step"
    if tile_rows not in (32, 64, 128) or block_q % tile_rows:
        return f"tiles BQ={block_q}, rows per step {tile_rows}"
    rows = gluon_kv_key_rows(block_k, key_rows)
    if rows not in (64, 128) or block_k % rows:
        return f"{rows} key rows per program of a {block_k}-key block"
    return None


def dkdv_gluon_arguments(
    q,
    k,
    v,
    do,
    lse,
    delta,
    kv_qblocks,
    item_row,
    item_t0,
    item_t1,
    item_part,
    dk,
    dv,
    dk_partial,
    dv_partial,
    document_ids=None,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    tile_rows: int,
    num_buf: int = 2,
    key_rows: int = GLUON_KEY_ROWS,
):
    """The grid, positional arguments and keyword arguments of :func:`launch_dkdv_gluon` (the CPU tests
    compile the kernel from them without a GPU). ``key_rows``: keys per program (:func:`gluon_kv_key_rows`);
    a 128-key block split into two 64-row programs lets two programs share an SM."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    rows = gluon_kv_key_rows(block_k, key_rows)
    args = (
        gluon_descriptor(q, 1, tile_rows),
        gluon_descriptor(do, 1, tile_rows),
        gluon_descriptor(k, 1, rows),
        gluon_descriptor(v, 1, rows),
        lse,
        delta,
        kv_qblocks,
        item_row,
        item_t0,
        item_t1,
        item_part,
        dk,
        dv,
        dk_partial,
        dv_partial,
        lse if document_ids is None else document_ids,
        *dk.stride(),
        *dv.stride(),
        N,
        HQ,
        HKV,
        triton.cdiv(N, block_k),
        scale * LOG2E,
        scale,
    )
    kwargs = dict(
        GROUP=HQ // HKV,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=D,
        TILE_ROWS=tile_rows,
        KEY_ROWS=rows,
        NUM_BUF=num_buf,
        HAS_DOCS=document_ids is not None,
        num_warps=4 * (rows // 64),
    )
    return (item_row.numel() * (block_k // rows),), args, kwargs


def launch_dkdv_gluon(*tensors, **options):
    """Run the Gluon KV-centric kernel over the schedule's items (the buffers of the Triton kernel: q, do
    ``[B, HQ, N, D]``, k, v, dk, dv ``[B, HKV, N, D]`` in any TMA-addressable strides, lse and delta
    ``[B, HQ, N]`` float32 contiguous, chunk partials ``[parts, BK, D]`` float32, document ids int32 contiguous
    ``[B, N]`` or None; arguments as :func:`dkdv_gluon_arguments`). Returns the compiled kernel."""
    grid, args, kwargs = dkdv_gluon_arguments(*tensors, **options)
    return _dkdv_gluon_kernel[grid](*args, **kwargs)


def gluon_dq_supported(
    q,
    k,
    v,
    do,
    *,
    block_q: int,
    block_k: int,
    heads_per_program: int,
    has_cold: bool,
    has_seq_lens: bool,
    has_docs: bool,
    dropout: bool,
    query_map: bool,
) -> str | None:
    """None when the Gluon dQ kernel can take this call, else why not (the launcher then runs ``_dq_kernel``)."""
    common = gluon_call_supported(
        q,
        k,
        v,
        do,
        block_q=block_q,
        block_k=block_k,
        has_seq_lens=has_seq_lens,
        has_docs=has_docs,
        dropout=dropout,
        query_map=query_map,
    )
    if common is not None:
        return common
    return gluon_dq_tiles_supported(block_q=block_q, heads_per_program=heads_per_program, has_cold=has_cold)


def gluon_dq_tiles_supported(*, block_q: int, heads_per_program: int, has_cold: bool) -> str | None:
    """The Gluon dQ kernel's own conditions, beyond those every Gluon kernel shares
    (``_gluon.gluon_call_supported``): None, or why not."""
    if has_cold:
        return "cold blocks (their atomic dK/dV products run in the Triton dQ kernel)"
    if heads_per_program * block_q not in (64, 128):
        return f"{heads_per_program} heads x BQ={block_q} rows per program (64 or 128 supported)"
    return None


def dq_gluon_arguments(
    q,
    k,
    v,
    do,
    lse,
    delta,
    indices,
    counts,
    dq,
    document_ids=None,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    heads_per_program: int,
    num_buf: int = 2,
):
    """The grid, positional arguments and keyword arguments of :func:`launch_dq_gluon` (the CPU tests compile
    the kernel from them without a GPU)."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    group = HQ // HKV

    nqb = indices.shape[2]
    rows = heads_per_program * block_q
    args = (
        gluon_descriptor(q, heads_per_program, block_q),
        gluon_descriptor(do, heads_per_program, block_q),
        gluon_descriptor(k, 1, block_k),
        gluon_descriptor(v, 1, block_k),
        lse,
        delta,
        indices,
        counts,
        dq,
        lse if document_ids is None else document_ids,
        *dq.stride(),
        *indices.stride(),
        *counts.stride(),
        N,
        HQ,
        HKV,
        nqb,
        scale * LOG2E,
        scale,
    )
    kwargs = dict(
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=D,
        NUM_BUF=num_buf,
        HAS_DOCS=document_ids is not None,
        num_warps=4 * (rows // 64),
    )
    return (nqb * (group // heads_per_program), B * HKV), args, kwargs


def launch_dq_gluon(*tensors, **options):
    """Run the Gluon dQ kernel (q, do, dq ``[B, HQ, N, D]``, k, v ``[B, HKV, N, D]`` in TMA-addressable
    strides, lse and delta ``[B, HQ, N]`` float32 contiguous, the index's indices / counts, document ids int32
    contiguous ``[B, N]`` or None; arguments as :func:`dq_gluon_arguments`). Returns the compiled kernel."""
    grid, args, kwargs = dq_gluon_arguments(*tensors, **options)
    return _dq_gluon_kernel[grid](*args, **kwargs)
