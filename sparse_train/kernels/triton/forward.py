"""Triton forward of exact block-sparse attention over a canonical block index.

Math, per query row q of head h over the keys k of its query block's selected key blocks:
    s_qk = scale <Q_q, K_k>, -inf unless k <= q, k < seq_len[b] and doc[b, k] == doc[b, q] (HAS_DOCS)
    lse_q = log sum_k exp(s_qk)
    O_q = sum_k keep_qk / (1 - p) exp(s_qk - lse_q) V_k;  keep_qk = philox(seed, ((b*HQ+h)*N+q)*N+k) >= p 2^32

Notation: B batch, HQ/HKV query/KV heads, GROUP = HQ/HKV (GQA), N length, HEAD_DIM = D, BLOCK_Q /
BLOCK_K = BQ/BK block sizes, NQB query blocks, K index capacity; one program owns one query block of
HEADS_PER_PROGRAM heads of a group, stacked into M = HEADS_PER_PROGRAM * BQ rows (the group's
HEAD_SUBSETS = GROUP / HEADS_PER_PROGRAM subsets are separate programs); NUM_SPLITS programs share a
row of the index (split-KV). The softmax runs in base 2 (m, l, exp2) with an online running max m and
sum l; the denominator never sees dropout.

Query-block map (HAS_QUERY_MAP, context parallelism): q, o and lse hold only the L rows of the listed
global query blocks; program tiles, index rows and the rows of q/o/lse are LOCAL blocks, the positions
of masks, document ids and dropout counters GLOBAL (``_jit.map_query_rows``).

Layers: (1) ``@triton.jit`` kernels ``_fwd_kernel`` (online softmax over the selected blocks, or over
one split of them) and ``_merge_kernel`` (exact merge of split partials); (2) the launcher
``sparse_attn_forward`` (allocate, grid, launch). The autograd op and the public function
(``triton_sparse_attention``) are in op.py, shared with the backward; the split count and the tile
configuration come from sparse_train/plan/plan.py; the PyTorch reference is reference.py.

Gluon forward (``ForwardConfig.gluon``, default on a Hopper GPU at head dim 64 over 64-key blocks, where it
measured faster): the same tiles' products hand-scheduled in Gluon (gluon/forward.py), bitwise this kernel's
outputs, documents included; where it does not apply (dropout, sequence lengths, a query-block map, split rows,
N not a multiple of BLOCK_Q) ``_fwd_kernel`` runs.

K/V loads: pointer tiles, or (``ForwardConfig.tma_loads``, Hopper and newer, a layout TMA addresses:
``_launch.tma_descriptor``) one TMA copy per tile, which keeps the [BK, D] address tensors out of the
registers.

Known limits: head dims 16/32/64/128; BQ, BK in {16, 32, 64, 128}; bf16/fp16 on the GPU, fp32 only for
the interpreter and tests (its dots use input_precision="ieee"); rows are walked in index order
(ascending key blocks); a selected block of another document costs its loads and products (the mask
zeroes it; selections should drop such blocks upstream); split partials use an fp32 workspace of
NUM_SPLITS * B * HQ * N * (D + 2) * 4 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...plan.tuning import forward_config
from ..gluon.forward import gluon_fwd_supported, launch_fwd_gluon
from ..reference.attention import dropout_threshold, philox_key  # the one definition of the keep bits
from ._jit import (
    LN2,
    LOG2E,
    dot,
    dropout_keep,
    index_row,
    load_key_tile,
    load_rows,
    map_query_rows,
    mask_scores,
    query_documents,
    query_tile,
    sequence_length,
    tile_pointers,
)
from ._launch import (
    LAST_COMPILED,
    attention_output,
    kernel_document_ids,
    kernel_query_map,
    kernel_seq_lens,
    launch,
    tma_operands,
)

__all__ = ["sparse_attn_forward"]

_MERGE_ROWS = 32  # rows per program of the merge kernel


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    INDICES,
    COUNTS,
    SEQ_LENS,
    DOCS,
    QUERY_MAP,
    QUERY_ROW0,
    PARTIAL_O,
    PARTIAL_M,
    PARTIAL_L,
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
    L,
    HQ,
    HKV,
    NQB,
    scale_log2,
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
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_QUERY_MAP: tl.constexpr,
    TMA_LOADS: tl.constexpr,
):
    M: tl.constexpr = HEADS_PER_PROGRAM * BLOCK_Q
    # qb: the LOCAL query block (index row, rows of q/o/lse); qb_global, qpos: GLOBAL (masks, dropout)
    qb, b, hkv, head, qpos = query_tile(NQB, HKV, GROUP, HEADS_PER_PROGRAM, BLOCK_Q, True)  # head, qpos: [M]
    qb_global, qpos, qrow64 = map_query_rows(QUERY_MAP, QUERY_ROW0, qb, qpos, BLOCK_Q, HAS_QUERY_MAP)
    split = tl.program_id(2)
    b64, hkv64, head64, qpos64 = b.to(tl.int64), hkv.to(tl.int64), head.to(tl.int64), qpos.to(tl.int64)
    row_ok = qpos < N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    q = load_rows(Q, b64, head64, qrow64, offs_d, stride_qb, stride_qh, stride_qn, stride_qd, row_ok)  # [M, D]
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    selected, count = index_row(
        INDICES, COUNTS, b64, hkv64, qb.to(tl.int64), stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq
    )
    # split-KV: this program walks slots [lo, hi) of its index row
    per_split = tl.cdiv(count, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, count)
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    v_base = V + b64 * stride_vb + hkv64 * stride_vh
    q_first = qb_global * BLOCK_Q  # first (global) query of the tile
    # float scalars arrive as fp32 from a direct launch but as fp64 from a graph inductor compiled (the
    # distillation path launches this kernel outside the custom op): keep the softmax state fp32
    scale_log2 = tl.cast(scale_log2, tl.float32)
    inv_keep = tl.cast(inv_keep, tl.float32)
    # dropout counter of (row, key) = row_counter + k, row_counter = ((b*HQ + h)*N + q)*N
    row_counter = ((b64 * HQ + head64) * N + qpos64) * N  # [M]
    docs_row, doc_q, doc_q_last = query_documents(DOCS, b64, qpos, q_first, N, BLOCK_Q, HAS_DOCS)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for t in range(lo, hi):
        j = tl.load(selected + t * stride_ik)  # t-th selected key block
        kpos = j * BLOCK_K + offs_k  # [BK]
        kpos64 = kpos.to(tl.int64)
        # keys past the sequence length load as 0: masked logits alone would let garbage (even NaN)
        # in the padding reach the output through 0 * NaN in the P @ V product
        kv_ok = kpos < seqlen
        # TMA: one bulk copy per tile, no [BK, D] address tensor in registers; V's rows in [seqlen, N) are
        # zeroed, K's need not be (their scores are masked to -inf below)
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
            False,
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
        s = s * scale_log2  # log2 domain: exp(x) = exp2(x * log2 e)
        s = mask_scores(
            s, qpos, kpos, seqlen, j * BLOCK_K, q_first, docs_row, doc_q, doc_q_last, N, HAS_DOCS, BLOCK_K
        )  # masks before max/exp
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing valid so far keeps m = -inf; use 0 as base so exp2 gives 0, not NaN
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])  # [M, BK] unnormalised probabilities
        l_i = l_i * alpha + tl.sum(p, 1)  # denominator without dropout
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(dropout_keep(seed, row_counter[:, None] + kpos64[None, :], threshold), p, 0.0)
        acc += dot(p.to(v.dtype), v, IEEE)  # [M, D]
        m_i = m_new

    if NUM_SPLITS == 1:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc * (inv_keep / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        o_ptrs = tile_pointers(O + b64 * stride_ob + head64[:, None] * stride_oh, qrow64, offs_d, stride_on, stride_od)
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + b64 * stride_lb + head64 * stride_lh + qrow64 * stride_ln, lse, mask=row_ok)
    else:
        # partial state (m in the log2 domain, l, unnormalised acc) in workspaces [NUM_SPLITS, B*HQ*L(, D)]
        if HAS_QUERY_MAP:
            rows_per_head = L
        else:
            rows_per_head = N
        partial_row = (split * (tl.num_programs(1) // HKV) * HQ + b64 * HQ + head64) * rows_per_head + qrow64  # [M]
        tl.store(PARTIAL_O + partial_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PARTIAL_M + partial_row, m_i, mask=row_ok)
        tl.store(PARTIAL_L + partial_row, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(
    O,
    LSE,
    PARTIAL_O,
    PARTIAL_M,
    PARTIAL_L,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ln,
    N,
    HQ,
    inv_keep,
    TOTAL_ROWS,
    NUM_SPLITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # exact merge of split partials: m = max_s m_s; l = sum_s 2^(m_s - m) l_s; o = sum_s 2^(m_s - m) o_s / l
    # N here: the rows per (batch, head) of o (L under a query-block map)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # row (b*HQ + h)*N + q
    ok = rows < TOTAL_ROWS
    inv_keep = tl.cast(inv_keep, tl.float32)  # fp64 when launched from an inductor graph (see _fwd_kernel)
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(PARTIAL_M + s * TOTAL_ROWS + rows64, mask=ok, other=float("-inf")))
    m_base = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(PARTIAL_M + s * TOTAL_ROWS + rows64, mask=ok, other=float("-inf")) - m_base)
        l += w * tl.load(PARTIAL_L + s * TOTAL_ROWS + rows64, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(
            PARTIAL_O + (s * TOTAL_ROWS + rows64)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0
        )
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc * (inv_keep / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) * LN2)
    batch_head = rows64 // N
    qpos = rows64 % N
    batch = batch_head // HQ
    head = batch_head % HQ
    o_ptrs = tile_pointers(
        O + batch[:, None] * stride_ob + head[:, None] * stride_oh, qpos, offs_d, stride_on, stride_od
    )
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + batch * stride_lb + head * stride_lh + qpos * stride_ln, lse, mask=ok)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def sparse_attn_forward(
    q,
    k,
    v,
    indices,
    counts,
    *,
    block_q,
    block_k,
    scale,
    seq_lens=None,
    dropout_p=0.0,
    dropout_seed=0,
    num_splits=1,
    config=None,
    document_ids=None,
    query_map=None,
    query_row0=None,
):
    """Launch the forward.  q ``[B, HQ, N, D]``; k, v ``[B, HKV, N, D]``; indices int32 ``[B, HKV, NQB, K]``;
    counts int32 ``[B, HKV, NQB]``; seq_lens int ``[B]`` or None; document_ids int ``[B, N]`` (non-decreasing)
    or None.  Returns (o ``[B, HQ, N, D]`` in q's
    dtype, lse ``[B, HQ, N]`` float32).  ``config``: a ``plan.ForwardConfig`` (default
    ``plan.tuning.forward_config``).

    Query-block map (context parallelism): ``query_map`` int32 ``[NQL]``, the global query block of each
    local block, and ``query_row0`` int64 ``[NQL]``, its first row in q (``kernels.reference.query_block_layout``);
    then q is ``[B, HQ, L, D]`` (the listed blocks' rows), indices / counts hold the index rows of the listed
    blocks (``[B, HKV, NQL, K]`` / ``[B, HKV, NQL]``), and o / lse come back ``[B, HQ, L, D]`` / ``[B, HQ, L]``.

    No validation here (op.py validates before calling), but every tensor argument is either passed with
    its strides or made contiguous here, and ``dropout_seed`` may be any int whose low 64 bits are the
    Philox key."""
    B, HQ, L, D = q.shape
    N = k.shape[2]
    HKV = k.shape[1]
    group = HQ // HKV
    NQB = indices.shape[2]
    if config is None:
        config = forward_config(group, block_q, block_k, D)
    heads_per_program = config.heads_per_program
    o = attention_output(q)  # [B, HQ, L, D] view of [B, L, HQ, D] memory
    lse = torch.empty((B, HQ, L), device=q.device, dtype=torch.float32)
    if B == 0:  # no sequence: nothing to launch (and a TMA descriptor takes no zero extent)
        return o, lse
    dropout = dropout_p > 0.0
    threshold = int(dropout_threshold(dropout_p)) if dropout else 0
    inv_keep = 1.0 / (1.0 - dropout_p) if dropout else 1.0
    grid = (NQB * (group // heads_per_program), B * HKV, num_splits)
    seq_lens_arg = kernel_seq_lens(seq_lens, N, counts)
    total_rows = B * HQ * L
    has_map = query_map is not None
    query_map, query_row0 = kernel_query_map(query_map, query_row0, counts)
    if num_splits > 1:
        partial_o = torch.empty((num_splits, total_rows, D), device=q.device, dtype=torch.float32)
        partial_m = torch.empty((num_splits, total_rows), device=q.device, dtype=torch.float32)
        partial_l = torch.empty((num_splits, total_rows), device=q.device, dtype=torch.float32)
    else:
        partial_o = partial_m = partial_l = lse  # unused
    gluon = (
        bool(config.gluon)
        and gluon_fwd_supported(
            q,
            k,
            v,
            block_q=block_q,
            block_k=block_k,
            heads_per_program=config.gluon_heads_per_program,
            num_splits=num_splits,
            has_seq_lens=seq_lens is not None,
            has_docs=document_ids is not None,
            dropout=dropout,
            query_map=has_map,
        )
        is None
    )
    if gluon:
        docs = None if document_ids is None else kernel_document_ids(document_ids, counts)
        LAST_COMPILED["fwd"] = launch_fwd_gluon(
            q,
            k,
            v,
            o,
            lse,
            indices,
            counts,
            docs,
            block_q=block_q,
            block_k=block_k,
            scale=float(scale),
            heads_per_program=config.gluon_heads_per_program,
            num_buf=config.gluon_stages,
        )
        return o, lse
    k_operand, v_operand, tma = tma_operands(k, v, block_k, bool(config.tma_loads))
    LAST_COMPILED["fwd"] = launch(
        _fwd_kernel,
        grid,
        q,
        k,
        v,
        o,
        lse,
        indices,
        counts,
        seq_lens_arg,
        kernel_document_ids(document_ids, counts),
        query_map,
        query_row0,
        partial_o,
        partial_m,
        partial_l,
        k_operand,
        v_operand,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o.stride(),
        *lse.stride(),
        *indices.stride(),
        *counts.stride(),
        N,
        L,
        HQ,
        HKV,
        NQB,
        float(scale * LOG2E.value),
        philox_key(dropout_seed),
        threshold,
        inv_keep,
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=D,
        HAS_SEQ_LENS=seq_lens is not None,
        DROPOUT=dropout,
        NUM_SPLITS=num_splits,
        IEEE=q.dtype == torch.float32,
        HAS_DOCS=document_ids is not None,
        HAS_QUERY_MAP=has_map,
        TMA_LOADS=tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(triton.cdiv(total_rows, _MERGE_ROWS),)](
            o,
            lse,
            partial_o,
            partial_m,
            partial_l,
            *o.stride(),
            *lse.stride(),
            L,
            HQ,
            inv_keep,
            total_rows,
            NUM_SPLITS=num_splits,
            BLOCK_ROWS=_MERGE_ROWS,
            HEAD_DIM=D,
            num_warps=4,
        )
    return o, lse
