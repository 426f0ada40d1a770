"""Triton forward kernel for exact block-sparse attention over a canonical block index.

Math (per query row q of head h, over the selected key blocks S of its query block):
    s_qk = scale * <Q_q, K_k>, masked to -inf unless (k in a selected block, k <= q, k < seq_len[b])
    lse_q = log sum_k exp(s_qk);  P_qk = exp(s_qk - lse_q)   (denominator never sees dropout)
    O_q = sum_k keep_qk / (1 - p) * P_qk V_k;  keep_qk = philox(seed, ((b*HQ+h)*N+q)*N+k) >= thr(p)

Notation: B batch, HQ/HKV query/KV heads, G = HQ/HKV (GQA group), N sequence length, D head dim,
BQ/BK query/key block sizes, NQB/NKB number of query/key blocks, K index capacity, M = HPP*BQ rows
of one program (HPP = query heads of the group handled by one program, stacked along rows),
NSPLIT = number of programs that share one row of the index (split-KV).

Layers: (1) @triton.jit kernels `_fwd_kernel` (online softmax over the selected blocks, optionally a
slice of them) and `_merge_kernel` (exact merge of split partials); (2) launchers `sparse_attn_forward`,
`launch` (retries with fewer pipeline stages when a config exceeds shared memory); the split count and
the tile configuration come from sparse_train/plan.py.  The autograd op lives in op.py.  Compiled output checked on the H200:
`wgmma.mma_async` in the PTX of every kernel (forward 16, dQ 24, KV-centric 32 sites), no mma.sync.

Known limits: head dims 16/32/64/128 (power of two); BQ, BK in {16, 32, 64, 128}; fp32 inputs are
supported for the interpreter and tests (fp32 dots use input_precision="ieee"), bf16/fp16 are the GPU
dtypes.  Rows are processed in the order of the index (ascending key blocks).  Split partials use an
fp32 workspace of NSPLIT * B * HQ * N * (D + 2) * 4 bytes.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..plan import forward_config

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# last compiled kernel per launcher (for inspecting registers/PTX in benchmarks; not used for compute)
LAST_COMPILED: dict = {}


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, IDX, CNT, SEQLENS, PO, PM, PL,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, son, sod,
    slb, slh, sln,
    sib, sih, siq, sik,
    scb, sch, scq,
    N, HQ, HKV, NQB, scale_log2, seed, threshold, inv_keep,
    G: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, DROPOUT: tl.constexpr, NSPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    NSUB: tl.constexpr = G // HPP
    M: tl.constexpr = HPP * BQ
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    # programs that share K/V (same query block, different head subsets) are adjacent in launch
    # order so the second one finds K/V in L2; late (long) query blocks start first.
    qb = NQB - 1 - pid0 // NSUB
    hsub = pid0 % NSUB
    b = pid_bh // HKV
    hkv = pid_bh % HKV

    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    offs_k = tl.arange(0, BK)
    head = hkv * G + hsub * HPP + offs_m // BQ            # [M] query head of each stacked row
    qpos = qb * BQ + offs_m % BQ                          # [M] query position
    row_ok = qpos < N
    b64 = b.to(tl.int64)
    head64 = head.to(tl.int64)
    qpos64 = qpos.to(tl.int64)

    q_ptr = Q + b64 * sqb + head64[:, None] * sqh + qpos64[:, None] * sqn + offs_d[None, :] * sqd
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)   # [M, D]

    if HAS_SEQLENS:
        seqlen = tl.load(SEQLENS + b).to(tl.int32)
    else:
        seqlen = N
    cnt = tl.load(CNT + b64 * scb + hkv * sch + qb * scq)
    # split-KV: this program walks slots [lo, hi) of the row
    per = tl.cdiv(cnt, NSPLIT)
    lo = pid_s * per
    hi = tl.minimum(lo + per, cnt)
    idx_base = IDX + b64 * sib + hkv * sih + qb * siq
    k_base = K + b64 * skb + hkv.to(tl.int64) * skh
    v_base = V + b64 * svb + hkv.to(tl.int64) * svh
    q_first = qb * BQ                                     # first query of the tile
    # dropout counter of (row, key) = row_off + k ; row_off = ((b*HQ+h)*N + q)*N
    row_off = ((b64 * HQ + head64) * N + qpos64) * N      # [M] int64

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for t in range(lo, hi):
        j = tl.load(idx_base + t * sik)
        kpos = j * BK + offs_k                            # [BK]
        kpos64 = kpos.to(tl.int64)
        # keys past the sequence length load as 0: masked logits alone would let garbage (even NaN)
        # in the padding reach the output through 0 * NaN in the P @ V product
        kv_ok = kpos < seqlen
        k = tl.load(k_base + kpos64[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok[:, None], other=0.0)  # [BK, D]
        v = tl.load(v_base + kpos64[:, None] * svn + offs_d[None, :] * svd, mask=kv_ok[:, None], other=0.0)  # [BK, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                    # [M, BK]
        s = s * scale_log2                                # log2 domain: exp(x) = exp2(x * log2 e)
        # masks before max/exp; only blocks that cross the diagonal or the sequence end need them
        if (j * BK + BK - 1 > q_first) | (j * BK + BK > seqlen):
            ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seqlen)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing valid so far keeps m = -inf; use 0 as base so exp2 gives 0, not NaN
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])                  # [M, BK] unnormalised probabilities
        l_i = l_i * alpha + tl.sum(p, 1)                  # denominator without dropout
        acc = acc * alpha[:, None]
        if DROPOUT:
            r = tl.randint(seed, row_off[:, None] + kpos64[None, :])
            p = tl.where(r.to(tl.int64) >= threshold, p, 0.0)
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)              # [M, D]
        m_i = m_new

    if NSPLIT == 1:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc * (inv_keep / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        o_ptr = O + b64 * sob + head64[:, None] * soh + qpos64[:, None] * son + offs_d[None, :] * sod
        tl.store(o_ptr, o.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + b64 * slb + head64 * slh + qpos64 * sln, lse, mask=row_ok)
    else:
        # partial state (m in log2 domain, l, unnormalised acc); workspace [NSPLIT, B*HQ, N, (D)]
        prow = (pid_s * (tl.num_programs(1) // HKV) * HQ + b64 * HQ + head64) * N + qpos64   # [M]
        tl.store(PO + prow[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PM + prow, m_i, mask=row_ok)
        tl.store(PL + prow, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(
    O, LSE, PO, PM, PL,
    sob, soh, son, sod, slb, slh, sln,
    N, HQ, inv_keep, ROWS_TOTAL,
    NSPLIT: tl.constexpr, BR: tl.constexpr, D: tl.constexpr,
):
    # exact merge of split partials: m = max m_s; l = sum 2^(m_s-m) l_s; o = sum 2^(m_s-m) o_s / l
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)                    # [BR] global row = (b*HQ+h)*N + q
    ok = rows < ROWS_TOTAL
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, D)
    m = tl.full([BR], float("-inf"), tl.float32)
    for s in tl.static_range(NSPLIT):
        m = tl.maximum(m, tl.load(PM + s * ROWS_TOTAL + rows64, mask=ok, other=float("-inf")))
    m_base = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    for s in tl.static_range(NSPLIT):
        w = tl.exp2(tl.load(PM + s * ROWS_TOTAL + rows64, mask=ok, other=float("-inf")) - m_base)
        l += w * tl.load(PL + s * ROWS_TOTAL + rows64, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(PO + (s * ROWS_TOTAL + rows64)[:, None] * D + offs_d[None, :],
                                    mask=ok[:, None], other=0.0)
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc * (inv_keep / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    bh = rows64 // N
    qpos = rows64 % N
    bb = bh // HQ
    hh = bh % HQ
    o_ptr = O + bb[:, None] * sob + hh[:, None] * soh + qpos[:, None] * son + offs_d[None, :] * sod
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + bb * slb + hh * slh + qpos * sln, lse, mask=ok)


# ----------------------------------------------------------------------------------------------
# Layer 2: launchers
# ----------------------------------------------------------------------------------------------
def kernel_seq_lens(seq_lens, seq_len: int, fallback):
    """The SEQLENS argument of the kernels: int32, contiguous (the kernels index it as `SEQLENS + b`,
    without a stride), values clamped to [0, N] on the device (no host sync: an unvalidated value,
    e.g. under torch.compile, can never widen a masked load past the end of K/V).  ``fallback`` is the
    dummy pointer passed when there are no seq_lens."""
    if seq_lens is None:
        return fallback
    return seq_lens.to(torch.int64).clamp(0, seq_len).to(torch.int32).contiguous()


def launch(kernel, grid, *args, num_warps, num_stages, **meta):
    """Launch a @triton.jit kernel; if the config exceeds shared memory on this GPU, retry with one
    pipeline stage less (same results: stages only change prefetch depth)."""
    from triton.runtime.errors import OutOfResources

    while True:
        try:
            return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **meta)
        except OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1


def sparse_attn_forward(q, k, v, indices, counts, *, block_q, block_k, scale, seq_lens=None,
                        dropout_p=0.0, dropout_seed=0, num_splits=1, config=None, out=None):
    """Launch the forward.  q [B, HQ, N, D]; k, v [B, HKV, N, D]; indices int32 [B, HKV, NQB, K];
    counts int32 [B, HKV, NQB]; seq_lens int [B] or None.  Returns (o [B, HQ, N, D] q.dtype,
    lse [B, HQ, N] float32).  `config`: a `plan.ForwardConfig` (default `plan.forward_config`).  `out=(o, lse)` writes into given buffers (tests poison them with NaN
    to prove every element is written).  No validation here (op.py validates before calling), but
    every tensor argument is either passed with its strides or made contiguous here, and
    `dropout_seed` may be any int whose low 64 bits are the Philox key."""
    from .reference import dropout_threshold, philox_key  # the one definition of the keep bits

    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    NQB = indices.shape[2]
    if config is None:
        config = forward_config(G, block_q, block_k, D)
    hpp = config.heads_per_program
    if out is not None:
        o, lse = out
    else:
        o = torch.empty((B, HQ, N, D), device=q.device, dtype=q.dtype)
        lse = torch.empty((B, HQ, N), device=q.device, dtype=torch.float32)
    dropout = dropout_p > 0.0
    threshold = int(dropout_threshold(dropout_p)) if dropout else 0
    inv_keep = 1.0 / (1.0 - dropout_p) if dropout else 1.0
    nw, ns = config.num_warps, config.num_stages
    ieee = q.dtype == torch.float32
    grid = (NQB * (G // hpp), B * HKV, num_splits)
    seql = kernel_seq_lens(seq_lens, N, counts)
    if num_splits > 1:
        rows = B * HQ * N
        po = torch.empty((num_splits, rows, D), device=q.device, dtype=torch.float32)
        pm = torch.empty((num_splits, rows), device=q.device, dtype=torch.float32)
        pl = torch.empty((num_splits, rows), device=q.device, dtype=torch.float32)
    else:
        po = pm = pl = lse  # unused
    LAST_COMPILED["fwd"] = launch(
        _fwd_kernel, grid, q, k, v, o, lse, indices, counts, seql, po, pm, pl,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        *indices.stride(), *counts.stride(),
        N, HQ, HKV, NQB, float(scale * LOG2E), philox_key(dropout_seed), threshold, inv_keep,
        G=G, HPP=hpp, BQ=block_q, BK=block_k, D=D,
        HAS_SEQLENS=seq_lens is not None, DROPOUT=dropout, NSPLIT=num_splits, IEEE=ieee,
        num_warps=nw, num_stages=ns,
    )
    if num_splits > 1:
        BR = 32
        rows = B * HQ * N
        _merge_kernel[(triton.cdiv(rows, BR),)](
            o, lse, po, pm, pl, *o.stride(), *lse.stride(), N, HQ, inv_keep, rows,
            NSPLIT=num_splits, BR=BR, D=D, num_warps=4,
        )
    return o, lse
