"""Forward of exact block-sparse attention hand-scheduled in Gluon for Hopper (``kernel_options.fwd_gluon``).

Math (as forward.py: causal, length and document masks; no dropout), per query row q over the keys k of its
query block's selected key blocks, online in base 2:
    s = scale_log2 <Q_q, K_k>;  m = max_k s;  l = sum_k exp2(s - m)
    O_q = sum_k exp2(s - m) V_k / l;  lse = (m + log2 l) ln 2

Notation: as forward.py; M = HEADS_PER_PROGRAM * BQ rows per program (heads of one query block stacked);
NUM_BUF = the depth of the K/V ring in shared memory. One program = one query tile of ``_fwd_kernel`` (same grid,
late query blocks first), walking its index row in order.

What the hand schedule adds over the Triton kernel: the q tile arrives once by TMA and stays in shared memory;
the K/V tiles of step t + NUM_BUF - 1 are in flight by TMA while step t computes, and each step's P V product
runs while the next step waits for its tiles and scores. That is faster than the Triton forward at head dim
64 over 64-key blocks (64-row programs, two per SM) and slower at the other shapes measured, so the default
takes it only there (``plan.tuning.forward_config``; docs/kernel_tuning.md). Computing the next step's scores during
this step's softmax (two score tiles live, a ring of 3) measures slower, so the kernel does not.

Known limits (the launcher runs the Triton kernel outside them, :func:`gluon_fwd_supported`): Hopper (sm_90),
bf16/fp16, tensors TMA addresses, N a multiple of BLOCK_Q, BLOCK_K in {64, 128}, M in {64, 128, 256}, no
dropout, sequence lengths, query-block map or split rows. Gluon kernels cannot run in Triton's
interpreter; the CPU tests compile it for sm_90a instead (tests/kernels/test_kernel_gluon.py).
"""

from __future__ import annotations

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

__all__ = ["fwd_gluon_arguments", "gluon_fwd_supported", "launch_fwd_gluon"]


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
if HAS_GLUON:
    # row reductions through gl.reduce with Gluon combine functions: gl.max / gl.sum are @triton.jit helpers,
    # which TRITON_INTERPRET=1 (the CPU suite, which compiles this kernel for sm_90a) turns into Python
    @gluon.jit
    def _maximum(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _online_softmax_step(
        s,
        m_i,
        l_i,
        qb,
        j,
        qpos,
        offs_k,
        N,
        scale_log2,
        docs_row,
        doc_q,
        doc_q_last,
        BLOCK_Q: gl.constexpr,
        BLOCK_K: gl.constexpr,
        HAS_DOCS: gl.constexpr,
    ):
        # one key block of the online softmax: the forward's masks, the new running max and sum; returns the
        # unnormalised probabilities, the rescale factor of what was summed before, the new max and sum
        s = mask_query_scores(
            s * scale_log2, qb, j, qpos, offs_k, N, docs_row, doc_q, doc_q_last, BLOCK_Q, BLOCK_K, HAS_DOCS
        )
        m_new = gl.maximum(m_i, gl.reduce(s, 1, _maximum))
        # a row with nothing valid so far keeps m = -inf; 0 as the base gives exp2 = 0, not NaN
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_base)
        p = gl.exp2(s - m_base[:, None])  # [M, BK]
        l_new = l_i * alpha + gl.reduce(p, 1, _add)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _fwd_gluon_kernel(
        desc_q,
        desc_k,
        desc_v,
        O,
        LSE,
        INDICES,
        COUNTS,
        DOCS,
        stride_ob,
        stride_oh,
        stride_on,
        stride_od,
        stride_lb,
        stride_lh,
        stride_ln,
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
        scale_log2,
        GROUP: gl.constexpr,
        HEADS_PER_PROGRAM: gl.constexpr,
        BLOCK_Q: gl.constexpr,
        BLOCK_K: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        NUM_BUF: gl.constexpr,
        HAS_DOCS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        M: gl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q
        # the query rows split over the warps in both MMA shapes, so a score row is held by the warps that hold
        # the same output row (the P -> operand conversion and the rescale stay inside each thread)
        scores_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_K, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        rows_layout: gl.constexpr = gl.SliceLayout(1, scores_layout)
        acc_rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)

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
        q_box = gl.allocate_shared_memory(desc_q.dtype, desc_q.block_type.shape, desc_q.layout)  # [1, heads, BQ, D]
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        mbarrier.expect(q_ready, desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [b, first_head, qb * BLOCK_Q, 0], q_ready, q_box)
        k_ring, v_ring, ready = kv_ring(desc_k, desc_v, selected, stride_ik, b, hkv, count, BLOCK_K, HEAD_DIM, NUM_BUF)

        q_smem = q_box.reshape([M, HEAD_DIM])  # [M, D]
        offs_m = gl.arange(0, M, rows_layout)  # [M]
        offs_k = gl.arange(0, BLOCK_K, gl.SliceLayout(0, scores_layout))  # [BK]
        qpos = qb * BLOCK_Q + offs_m % BLOCK_Q  # [M]
        docs_row, doc_q, doc_q_last = query_documents(DOCS, b, qb, qpos, N, BLOCK_Q, HAS_DOCS)
        m_i = gl.full([M], float("-inf"), gl.float32, rows_layout)
        l_i = gl.zeros([M], gl.float32, rows_layout)
        zero_scores = gl.zeros([M, BLOCK_K], gl.float32, scores_layout)
        # loop-carried as an in-flight accumulator: each step's P V product is waited for by the next step
        acc = warpgroup_mma_init(gl.zeros([M, HEAD_DIM], gl.float32, acc_layout))
        mbarrier.wait(q_ready, phase=0)
        for t in range(count):
            slot = t % NUM_BUF
            j = gl.load(selected + t * stride_ik)
            mbarrier.wait(ready.index(slot), phase=(t // NUM_BUF) & 1)
            s = warpgroup_mma(
                q_smem,
                k_ring.index(slot).reshape([BLOCK_K, HEAD_DIM]).permute((1, 0)),
                zero_scores,
                use_acc=False,
                is_async=True,
            )  # [M, BK] = Q K^T
            # S done, and with it the previous P V product: the ring slot it read takes step t + NUM_BUF - 1
            s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
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
            p, alpha, m_i, l_i = _online_softmax_step(
                s, m_i, l_i, qb, j, qpos, offs_k, N, scale_log2, docs_row, doc_q, doc_q_last, BLOCK_Q, BLOCK_K, HAS_DOCS
            )
            acc = acc * gl.convert_layout(alpha, acc_rows_layout)[:, None]
            p_operand = gl.convert_layout(p.to(desc_v.dtype), operand_layout)
            acc = warpgroup_mma(
                p_operand, v_ring.index(slot).reshape([BLOCK_K, HEAD_DIM]), acc, is_async=True
            )  # [M, D]
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.invalidate(q_ready)
        invalidate_ring(ready, NUM_BUF)

        # rows without a valid key (l = 0) give o = 0 and lse = -inf, as _fwd_kernel
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)  # [M]
        o = acc * gl.convert_layout(1.0 / l_safe, acc_rows_layout)[:, None]
        store_query_rows(
            O, o, b, first_head, qb, stride_ob, stride_oh, stride_on, stride_od, BLOCK_Q, M, HEAD_DIM, acc_layout
        )
        lse_heads64 = (first_head + offs_m // BLOCK_Q).to(gl.int64)
        gl.store(LSE + b.to(gl.int64) * stride_lb + lse_heads64 * stride_lh + qpos.to(gl.int64) * stride_ln, lse)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def gluon_fwd_supported(
    q,
    k,
    v,
    *,
    block_q: int,
    block_k: int,
    heads_per_program: int,
    num_splits: int,
    has_seq_lens: bool,
    has_docs: bool,
    dropout: bool,
    query_map: bool,
) -> str | None:
    """None when the Gluon forward can take this call, else why not (the launcher then runs ``_fwd_kernel``)."""
    common = gluon_call_supported(
        q,
        k,
        v,
        None,
        block_q=block_q,
        block_k=block_k,
        has_seq_lens=has_seq_lens,
        has_docs=has_docs,
        dropout=dropout,
        query_map=query_map,
    )
    if common is not None:
        return common
    if num_splits != 1:
        return f"{num_splits} splits per index row (the Gluon forward walks whole rows)"
    if heads_per_program * block_q not in (64, 128, 256):
        return f"{heads_per_program} heads x BQ={block_q} rows per program (64, 128 or 256 supported)"
    return None


def fwd_gluon_arguments(
    q,
    k,
    v,
    o,
    lse,
    indices,
    counts,
    document_ids=None,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    heads_per_program: int,
    num_buf: int,
):
    """The grid, positional arguments and keyword arguments of :func:`launch_fwd_gluon` (the CPU tests compile
    the kernel from them without a GPU)."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    group = HQ // HKV
    nqb = indices.shape[2]
    rows = heads_per_program * block_q
    args = (
        gluon_descriptor(q, heads_per_program, block_q),
        gluon_descriptor(k, 1, block_k),
        gluon_descriptor(v, 1, block_k),
        o,
        lse,
        indices,
        counts,
        lse if document_ids is None else document_ids,
        *o.stride(),
        *lse.stride(),
        *indices.stride(),
        *counts.stride(),
        N,
        HKV,
        nqb,
        scale * LOG2E,
    )
    kwargs = dict(
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=D,
        NUM_BUF=num_buf,
        HAS_DOCS=document_ids is not None,
        num_warps=min(8, 4 * (rows // 64)),
    )
    return (nqb * (group // heads_per_program), B * HKV), args, kwargs


def launch_fwd_gluon(*tensors, **options):
    """Run the Gluon forward (q ``[B, HQ, N, D]``, k, v ``[B, HKV, N, D]`` in TMA-addressable strides, o
    ``[B, HQ, N, D]`` and lse ``[B, HQ, N]`` float32 written through their strides, the index's indices /
    counts, document ids int32 contiguous ``[B, N]`` or None; arguments as :func:`fwd_gluon_arguments`).
    Returns the compiled kernel."""
    grid, args, kwargs = fwd_gluon_arguments(*tensors, **options)
    return _fwd_gluon_kernel[grid](*args, **kwargs)
