"""What the Gluon kernels (Hopper, hand-scheduled: gluon/backward.py, gluon/forward.py) share: the Gluon imports,
the TMA descriptors of ``[B, H, N, D]`` tensors, the conditions every Gluon kernel needs (the launchers run the
Triton kernels outside them), and the pieces of a query-centric program (the forward and dQ kernels): its tile,
its K/V ring, the forward's masks, the store of its rows."""

from __future__ import annotations

import torch

try:  # Gluon ships with triton >= 3.4; without it the Triton kernels are the only ones
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAS_GLUON = False

from ...plan.device import tma_addressable

__all__ = [
    "HAS_GLUON",
    "LOG2E",
    "gl",
    "gluon",
    "gluon_call_supported",
    "gluon_descriptor",
    "invalidate_ring",
    "issue_kv_load",
    "kv_ring",
    "mask_query_scores",
    "mbarrier",
    "query_documents",
    "query_program",
    "store_query_rows",
    "tma",
    "warpgroup_mma",
    "warpgroup_mma_init",
    "warpgroup_mma_wait",
]

LOG2E = 1.4426950408889634
"""log2(e) (the kernels' softmax runs in base 2), as a float the Gluon kernels and launchers both take."""


def gluon_descriptor(x, heads: int, rows: int):
    """A TMA descriptor of ``x`` ``[B, H, N, D]`` (any strides TMA addresses) for boxes of ``[1, heads, rows, D]``
    elements: ``heads`` consecutive heads' rows, which a kernel takes as a ``[heads * rows, D]`` tile; rows past
    N arrive as zeros."""
    block = [1, heads, rows, x.shape[-1]]
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def gluon_call_supported(
    q, k, v, do, *, block_q: int, block_k: int, has_seq_lens: bool, has_docs: bool, dropout: bool, query_map: bool
) -> str | None:
    """The conditions every Gluon kernel shares: None, or why this call is outside them (``do`` may be None:
    the forward). Documents (``has_docs``) are within them: the kernels take the document mask."""
    if not HAS_GLUON:
        return "this triton has no Gluon"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon kernels are for Hopper (sm_90)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16/fp16 only)"
    if has_seq_lens or dropout or query_map:
        return "sequence lengths, dropout or a query-block map"
    if block_k not in (64, 128):
        return f"BK={block_k} (64 or 128 supported)"
    if q.shape[2] % block_q:
        return f"N={q.shape[2]} is not a multiple of BLOCK_Q={block_q}"
    if not all(tma_addressable(x) for x in (q, k, v, do) if x is not None):
        return "a layout of q, k, v or dO that TMA cannot address"
    return None


if HAS_GLUON:

    @gluon.jit
    def issue_kv_load(
        desc_k,
        desc_v,
        k_ring,
        v_ring,
        ready,
        selected,
        stride_ik,
        b,
        hkv,
        t,
        BLOCK_K: gl.constexpr,
        NUM_BUF: gl.constexpr,
    ):
        """Step t of a query-centric program: the K and V tiles of its t-th selected key block ([1, 1, BK, D]
        boxes, rows past N arrive as 0) land in ring slot t % NUM_BUF, signalled on ``ready[slot]``."""
        j = gl.load(selected + t * stride_ik)
        slot = t % NUM_BUF
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [b, hkv, j * BLOCK_K, 0], bar, k_ring.index(slot))
        tma.async_copy_global_to_shared(desc_v, [b, hkv, j * BLOCK_K, 0], bar, v_ring.index(slot))

    @gluon.jit
    def query_program(
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
        GROUP: gl.constexpr,
        HEADS_PER_PROGRAM: gl.constexpr,
    ):
        """The tile of a query-centric program on a grid (NQB * HEAD_SUBSETS, B * HKV), late (long) query blocks
        first, as the Triton kernels' ``query_tile``: (query block, batch, KV head, first query head, number of
        selected key blocks, pointer to the index row)."""
        HEAD_SUBSETS: gl.constexpr = GROUP // HEADS_PER_PROGRAM
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        qb = NQB - 1 - pid_m // HEAD_SUBSETS
        b = pid_bh // HKV
        hkv = pid_bh % HKV
        first_head = hkv * GROUP + (pid_m % HEAD_SUBSETS) * HEADS_PER_PROGRAM
        count = gl.load(
            COUNTS + b.to(gl.int64) * stride_cb + hkv.to(gl.int64) * stride_ch + qb.to(gl.int64) * stride_cq
        )
        selected = INDICES + b.to(gl.int64) * stride_ib + hkv.to(gl.int64) * stride_ih + qb.to(gl.int64) * stride_iq
        return qb, b, hkv, first_head, count, selected

    @gluon.jit
    def kv_ring(
        desc_k,
        desc_v,
        selected,
        stride_ik,
        b,
        hkv,
        count,
        BLOCK_K: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        NUM_BUF: gl.constexpr,
    ):
        """The K/V ring of a query-centric program in shared memory (NUM_BUF slots and their barriers), its first
        NUM_BUF - 1 steps already in flight (:func:`issue_kv_load`). Returns (K ring, V ring, barriers)."""
        k_ring = gl.allocate_shared_memory(desc_k.dtype, [NUM_BUF, 1, 1, BLOCK_K, HEAD_DIM], desc_k.layout)
        v_ring = gl.allocate_shared_memory(desc_v.dtype, [NUM_BUF, 1, 1, BLOCK_K, HEAD_DIM], desc_v.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
        for i in gl.static_range(NUM_BUF - 1):
            if i < count:
                issue_kv_load(desc_k, desc_v, k_ring, v_ring, ready, selected, stride_ik, b, hkv, i, BLOCK_K, NUM_BUF)
        return k_ring, v_ring, ready

    @gluon.jit
    def invalidate_ring(ready, NUM_BUF: gl.constexpr):
        """Retire the ring's barriers (every load they signalled has been waited for)."""
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit
    def query_documents(DOCS, b, qb, qpos, N, BLOCK_Q: gl.constexpr, HAS_DOCS: gl.constexpr):
        """The query side of the document mask (ids int32 ``[B, N]``, non-decreasing; every query < N): (pointer
        to batch row b's ids, the id of each query ``qpos``, the id of the block's last query, its largest).
        Without documents, placeholders of the right kinds."""
        if HAS_DOCS:
            docs_row = DOCS + b.to(gl.int64) * N
            doc_q = gl.load(docs_row + qpos)
            doc_q_last = gl.load(docs_row + qb * BLOCK_Q + BLOCK_Q - 1)
        else:
            docs_row = DOCS
            doc_q = qpos
            doc_q_last = 0
        return docs_row, doc_q, doc_q_last

    @gluon.jit
    def mask_query_scores(
        s,
        qb,
        j,
        qpos,
        offs_k,
        N,
        docs_row,
        doc_q,
        doc_q_last,
        BLOCK_Q: gl.constexpr,
        BLOCK_K: gl.constexpr,
        HAS_DOCS: gl.constexpr,
    ):
        """The forward's masks on scores ``s`` [M, BK] of key block ``j``: -inf past the diagonal, past N and
        (``HAS_DOCS``) across documents, applied only to blocks that can hold such a pair, as the Triton kernels'
        ``mask_scores`` (a block before the whole query block holds two documents iff its first key's id differs
        from the block's last query's)."""
        edge = (j * BLOCK_K + BLOCK_K - 1 > qb * BLOCK_Q) | (j * BLOCK_K + BLOCK_K > N)
        if HAS_DOCS:
            if edge | (gl.load(docs_row + j * BLOCK_K) != doc_q_last):
                kpos = j * BLOCK_K + offs_k
                doc_k = gl.load(docs_row + kpos, mask=kpos < N, other=-1)
                ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < N) & (doc_q[:, None] == doc_k[None, :])
                s = gl.where(ok, s, float("-inf"))
        else:
            if edge:
                kpos = j * BLOCK_K + offs_k
                ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < N)
                s = gl.where(ok, s, float("-inf"))
        return s

    @gluon.jit
    def store_query_rows(
        X,
        tile,
        b,
        first_head,
        qb,
        stride_b,
        stride_h,
        stride_n,
        stride_d,
        BLOCK_Q: gl.constexpr,
        M: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        layout: gl.constexpr,
    ):
        """Store ``tile`` [M, D] (heads of query block ``qb`` stacked, in ``layout``) into X [B, H, N, D] through
        its strides, in X's dtype."""
        rows = gl.arange(0, M, gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, layout))
        heads64 = (first_head + rows // BLOCK_Q).to(gl.int64)
        qpos64 = (qb * BLOCK_Q + rows % BLOCK_Q).to(gl.int64)
        ptrs = (
            X
            + b.to(gl.int64) * stride_b
            + heads64[:, None] * stride_h
            + qpos64[:, None] * stride_n
            + cols[None, :] * stride_d
        )
        gl.store(ptrs, tile.to(X.dtype.element_ty))
