"""Triton kernels of the token selector's token-level distillation loss: the per-row KL from the row's dense attention
over keys to the softmax of its index logits, streamed over the keys without an [rows, N] tensor, forward and
backward.

Math (the reference is kernels/reference/token_kl.py), per batch b, KV head h and listed row r at position pos_r:

    p_g[r, t]    = exp(scale q_g[r] . k[t] - lse_g[r])   over the allowed keys t (causal, before seq_lens, same
                   document), lse_g the log-sum-exp of head g's logits;  p[r, t] = max over g of p_g[r, t]
    z[r, t]      = temperature[h] * m[r, t],  m[r, t] = max over e of u[r, e] . w[t];  lse_z[r] its log-sum-exp
    Z[r] = sum_t p,  A[r] = sum_t p log p,  C[r] = sum_t p z
    kl[r]        = A / Z - log Z - C / Z + lse_z          (= sum_t p/Z (log(p/Z) - (z - lse_z)); 0 without keys)

Backward, with g[r] the loss's gradient of kl[r] and gz[r, t] = g[r] (softmax(z)[r, t] - p[r, t] / Z[r]):

    d temperature[h] = sum_{r,t} gz m;   du[r, e] = temperature sum_t gz [e wins at (r, t)] w[t];
    dw[t] = temperature sum_r gz [e wins] u[r, e]      (ties between index heads share the gradient equally, as
                                                        torch.amax's backward does)

Notation: B batch, H KV heads, G query heads per KV head, N length, D head dim, E index heads, S index dim (padded to
S_P2 >= 16), BQ query block, R listed query blocks, M = R * BQ listed rows, KEYS keys per step.

Layers: (1) three kernels, each one program per (listed block, b * H + h, span of SPAN keys), so the work of a few
listed blocks spreads over the GPU: ``_token_kl_lse_kernel`` (pass 1) walks the span once per head g and once for
the index logits, storing each walk's running max and sum; ``_token_kl_moments_kernel`` (pass 2) walks it once more
with the combined lse_g for the span's parts of Z, A and C; ``_token_kl_backward_kernel`` walks it once per index
head e: recomputes p and z and adds du, dw and the temperature's gradient (atomics: spans share du, listed blocks
share dw). Helpers: the program's rows (``_listed_rows``), the key mask (``_allowed``), a key tile (``_key_tile``),
the logits (``_head_logits``, ``_index_logits``) and the target (``_target``). (2) the launchers, which combine the
spans' partial results in PyTorch; (3) the autograd op ``_TokenKL``, and the launchers as the ``torch.library`` custom
ops ``sparse_train::token_kl_fwd`` / ``sparse_train::token_kl_bwd`` (fake impls, ``register_autograd``) that
torch.compile, export and dispatch modes call (eager calls on plain tensors skip the op's Python dispatch:
``_launch.direct_call``); (4) the public function :func:`token_kl`.

Known limits: float16 / bfloat16 / float32 inputs (float32 products in IEEE precision; bf16 on CUDA only), block
sizes 16..128 powers of two, D <= 256, S <= 128; the backward spills registers with more than one index head, and
at GQA 8 the second pass and the backward sit at the 255-register limit (a few bytes may spill).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.token_kl import reference_token_kl
from ._jit import dot
from ._launch import direct_call, kernel_document_ids, kernel_seq_lens, launch

__all__ = [
    "BLOCK_SIZES",
    "KERNEL_DTYPES",
    "KEYS",
    "MAX_HEAD_DIM",
    "MAX_INDEX_DIM",
    "NUM_WARPS",
    "TokenKLStats",
    "kernels_take",
    "token_kl",
    "token_kl_backward_launch",
    "token_kl_forward_launch",
]

KEYS = 32
"""Keys per step of both kernels (with NUM_WARPS, the largest step whose backward compiles without register spills
for one index head at D = 128 on sm_90a: the compile test)."""
NUM_WARPS = 8
SPAN = 2048
"""Keys per program: each (listed block, batch row, KV head) splits its keys into spans of SPAN, one program each,
so a few listed blocks still fill the GPU at long N (the spans' partial sums are combined in PyTorch)."""
LSE_STAGES = 3
"""Pipeline stages of the first forward pass (one head's logits or the index logits per walk)."""
MOMENTS_STAGES = 2
"""Pipeline stages of the second forward pass (every head's logits per key tile)."""
BACKWARD_STAGES = 1
"""Pipeline stages of the backward (every head's logits and the index products per key tile): more exceed the
shared memory of sm_90 at G = 4, D = 128."""
BLOCK_SIZES = (16, 32, 64, 128)
"""The query block sizes BQ the kernels take."""
MAX_HEAD_DIM = 256
"""The largest head dim D of q and k the kernels take."""
MAX_INDEX_DIM = 128
"""The largest index dim S the kernels take."""
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The input dtypes the kernels take."""


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _allowed(keys, positions, row_ok, limit, docs_row, row_docs, N, HAS_DOCS: tl.constexpr):
    """bool [BQ, KEYS]: key t allowed for row r (causal, before the row's length, same document, a valid row)."""
    allowed = (keys[None, :] <= positions[:, None]) & (keys[None, :] < limit) & row_ok[:, None]
    if HAS_DOCS:
        key_docs = tl.load(docs_row + keys.to(tl.int64), mask=keys < N, other=-1)  # [KEYS]
        allowed = allowed & (key_docs[None, :] == row_docs[:, None])
    return allowed


@triton.jit
def _head_logits(q_head, stride_qd, k_tile, offs_d, row_ok, scale, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    """[BQ, KEYS] float32: scale * q_g[r] . k[t] for one query head (q rows at ``q_head`` [BQ, 1])."""
    q = tl.load(
        q_head + offs_d[None, :].to(tl.int64) * stride_qd,
        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BQ, D]
    return dot(q, tl.trans(k_tile), IEEE) * scale


@triton.jit
def _index_logits(
    u_rows,
    stride_ue,
    stride_us,
    w_tile,
    offs_s,
    row_ok,
    S,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KEYS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """[BQ, KEYS] float32: max over the E index heads of u[r, e] . w[t] (u rows at ``u_rows`` [BQ, 1])."""
    best = tl.full([BLOCK_Q, KEYS], float("-inf"), tl.float32)
    for e in tl.static_range(E):
        u = tl.load(
            u_rows + e * stride_ue + offs_s[None, :].to(tl.int64) * stride_us,
            mask=row_ok[:, None] & (offs_s[None, :] < S),
            other=0.0,
        )  # [BQ, S]
        best = tl.maximum(best, dot(u, tl.trans(w_tile), IEEE))
    return best


@triton.jit
def _listed_rows(QUERY_BLOCKS, SEQ_LENS, DOCS, listed, b64, N, BLOCK_Q: tl.constexpr, HAS_SEQ_LENS: tl.constexpr,
                 HAS_DOCS: tl.constexpr):  # fmt: skip
    """The program's rows: (positions [BQ], row_ok [BQ] (inside the sequence and its length), rows64 [BQ] (their
    index in the listed layout), the length, key_limit (keys at or past it are padding: never read, so NaN stays out
    of every product), keys_end (the last key + 1 any row reaches), the batch row's document ids, the rows' ones)."""
    block = tl.load(QUERY_BLOCKS + listed)
    r = tl.arange(0, BLOCK_Q)  # [BQ]
    positions = block * BLOCK_Q + r
    limit = N
    if HAS_SEQ_LENS:
        limit = tl.load(SEQ_LENS + b64)
    row_ok = (positions < N) & (positions < limit)
    rows64 = (listed * BLOCK_Q + r).to(tl.int64)
    docs_row = DOCS + b64 * N
    row_docs = r
    if HAS_DOCS:
        row_docs = tl.load(docs_row + tl.minimum(positions, N - 1).to(tl.int64))
    key_limit = tl.minimum(limit, N)
    keys_end = tl.minimum((block + 1) * BLOCK_Q, key_limit)
    return positions, row_ok, rows64, limit, key_limit, keys_end, docs_row, row_docs


@triton.jit
def _key_tile(head, keys, key_limit, stride_n, stride_c, offs_c, C):
    """[KEYS, C] rows ``keys`` of a [N, C] operand (K or W of one head), 0 at and past ``key_limit``."""
    return tl.load(
        head + keys[:, None].to(tl.int64) * stride_n + offs_c[None, :].to(tl.int64) * stride_c,
        mask=(keys[:, None] < key_limit) & (offs_c[None, :] < C),
        other=0.0,
    )


@triton.jit
def _target(q_heads, stride_qh, stride_qd, lse_rows, M, k_tile, offs_d, row_ok, allowed, scale, GROUP: tl.constexpr,
            BLOCK_Q: tl.constexpr, KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """[BQ, KEYS] float32 p: the max over the G heads of each head's probability exp(logit - lse_g) on the allowed
    keys, 0 elsewhere (the heads' q rows at ``q_heads`` [BQ, 1] for g = 0, their lse at ``lse_rows`` [BQ])."""
    p = tl.zeros([BLOCK_Q, KEYS], tl.float32)
    for g in tl.static_range(GROUP):
        lse_g = tl.load(lse_rows + g * M)  # [BQ]
        logits = _head_logits(q_heads + g * stride_qh, stride_qd, k_tile, offs_d, row_ok, scale, HEAD_DIM, IEEE)
        p = tl.maximum(p, tl.where(allowed, tl.exp(logits - lse_g[:, None]), 0.0))
    return p


@triton.jit
def _span_program(U, W, QR, K, TEMP, QUERY_BLOCKS, SEQ_LENS, DOCS, stride_ub, stride_uh, stride_um, stride_wb,
                  stride_wh, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, H, N, GROUP: tl.constexpr,
                  BLOCK_Q: tl.constexpr, SPAN: tl.constexpr, HAS_SEQ_LENS: tl.constexpr,
                  HAS_DOCS: tl.constexpr):  # fmt: skip
    """What every kernel's program (listed block, b * H + h, span) starts from: ``_listed_rows``' rows, the span's
    keys [lo, hi), the head's temperature, and the program's bases: K and W of the head, u's rows [BQ, 1], the
    group's q rows [BQ, 1] (head g = 0)."""
    listed = tl.program_id(0)
    bh = tl.program_id(1)
    b64 = (bh // H).to(tl.int64)
    h = bh % H
    h64 = h.to(tl.int64)
    positions, row_ok, rows64, limit, key_limit, keys_end, docs_row, row_docs = _listed_rows(
        QUERY_BLOCKS, SEQ_LENS, DOCS, listed, b64, N, BLOCK_Q, HAS_SEQ_LENS, HAS_DOCS
    )
    lo = tl.program_id(2) * SPAN
    hi = tl.minimum(lo + SPAN, keys_end)
    temperature = tl.load(TEMP + h).to(tl.float32)
    k_head = K + b64 * stride_kb + h64 * stride_kh
    w_head = W + b64 * stride_wb + h64 * stride_wh
    u_rows = U + b64 * stride_ub + h64 * stride_uh + rows64[:, None] * stride_um  # [BQ, 1]
    q_heads = QR + b64 * stride_qb + h64 * GROUP * stride_qh + rows64[:, None] * stride_qm  # [BQ, 1], head g = 0
    bh64 = b64 * H + h64
    return (bh64, h, positions, row_ok, rows64, limit, key_limit, docs_row, row_docs, lo, hi, temperature, k_head,
            w_head, u_rows, q_heads)  # fmt: skip


@triton.jit
def _token_kl_lse_kernel(
    U,
    W,
    QR,
    K,
    TEMP,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    PART_MAX,
    PART_SUM,
    stride_ub,
    stride_uh,
    stride_um,
    stride_ue,
    stride_us,
    stride_wb,
    stride_wh,
    stride_wn,
    stride_ws,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    H,
    N,
    M,
    S,
    scale,
    GROUP: tl.constexpr,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KEYS: tl.constexpr,
    SPAN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr,
):
    (bh64, h, positions, row_ok, rows64, limit, key_limit, docs_row, row_docs, lo, hi, temperature, k_head, w_head,
     u_rows, q_heads) = _span_program(
        U, W, QR, K, TEMP, QUERY_BLOCKS, SEQ_LENS, DOCS, stride_ub, stride_uh, stride_um, stride_wb, stride_wh,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, H, N, GROUP, BLOCK_Q, SPAN, HAS_SEQ_LENS, HAS_DOCS,
    )  # fmt: skip
    offs_d = tl.arange(0, D_P2)
    offs_s = tl.arange(0, S_P2)
    # this span's partial (max, sum) of each head's logits (g < GROUP) and of the index logits (g = GROUP)
    part = (tl.program_id(2).to(tl.int64) * tl.num_programs(1) + bh64) * (GROUP + 1) * M + rows64  # [BQ], g = 0
    for g in tl.static_range(GROUP + 1):
        run_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_Q], tl.float32)
        if g < GROUP:
            q = tl.load(
                q_heads + g * stride_qh + offs_d[None, :].to(tl.int64) * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            )  # [BQ, D], held for the walk
        for start in range(lo, hi, KEYS):
            keys = start + tl.arange(0, KEYS)  # [KEYS]
            allowed = _allowed(keys, positions, row_ok, limit, docs_row, row_docs, N, HAS_DOCS)
            if g < GROUP:
                k_tile = _key_tile(k_head, keys, key_limit, stride_kn, stride_kd, offs_d, HEAD_DIM)  # [KEYS, D]
                logits = dot(q, tl.trans(k_tile), IEEE) * scale
            else:
                w_tile = _key_tile(w_head, keys, key_limit, stride_wn, stride_ws, offs_s, S)  # [KEYS, S]
                logits = temperature * _index_logits(
                    u_rows, stride_ue, stride_us, w_tile, offs_s, row_ok, S, E, BLOCK_Q, KEYS, IEEE
                )
            logits = tl.where(allowed, logits, float("-inf"))  # [BQ, KEYS]
            new_max = tl.maximum(run_max, tl.max(logits, axis=1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
            run_max = new_max
        tl.store(PART_MAX + part + g * M, run_max)
        tl.store(PART_SUM + part + g * M, run_sum)


@triton.jit
def _token_kl_moments_kernel(
    U,
    W,
    QR,
    K,
    TEMP,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    LSE_S,
    PARTS,
    stride_ub,
    stride_uh,
    stride_um,
    stride_ue,
    stride_us,
    stride_wb,
    stride_wh,
    stride_wn,
    stride_ws,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    H,
    N,
    M,
    S,
    scale,
    GROUP: tl.constexpr,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KEYS: tl.constexpr,
    SPAN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr,
):
    (bh64, h, positions, row_ok, rows64, limit, key_limit, docs_row, row_docs, lo, hi, temperature, k_head, w_head,
     u_rows, q_heads) = _span_program(
        U, W, QR, K, TEMP, QUERY_BLOCKS, SEQ_LENS, DOCS, stride_ub, stride_uh, stride_um, stride_wb, stride_wh,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, H, N, GROUP, BLOCK_Q, SPAN, HAS_SEQ_LENS, HAS_DOCS,
    )  # fmt: skip
    offs_d = tl.arange(0, D_P2)
    offs_s = tl.arange(0, S_P2)
    lse_rows = LSE_S + bh64 * GROUP * M + rows64  # [BQ], head g = 0
    # this span's part of Z = sum p, A = sum p log p, C = sum p z, p the max over heads of the heads' probabilities
    mass = tl.zeros([BLOCK_Q], tl.float32)
    plogp = tl.zeros([BLOCK_Q], tl.float32)
    pz = tl.zeros([BLOCK_Q], tl.float32)
    for start in range(lo, hi, KEYS):
        keys = start + tl.arange(0, KEYS)
        allowed = _allowed(keys, positions, row_ok, limit, docs_row, row_docs, N, HAS_DOCS)
        k_tile = _key_tile(k_head, keys, key_limit, stride_kn, stride_kd, offs_d, HEAD_DIM)  # [KEYS, D]
        p = _target(q_heads, stride_qh, stride_qd, lse_rows, M, k_tile, offs_d, row_ok, allowed, scale, GROUP, BLOCK_Q,
                    KEYS, HEAD_DIM, IEEE)  # fmt: skip
        w_tile = _key_tile(w_head, keys, key_limit, stride_wn, stride_ws, offs_s, S)  # [KEYS, S]
        z = temperature * _index_logits(u_rows, stride_ue, stride_us, w_tile, offs_s, row_ok, S, E, BLOCK_Q, KEYS, IEEE)
        mass += tl.sum(p, axis=1)
        plogp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), axis=1)
        pz += tl.sum(tl.where(allowed, p * z, 0.0), axis=1)
    part = (tl.program_id(2).to(tl.int64) * tl.num_programs(1) + bh64) * M + rows64  # [BQ] in [SPANS, B * H, M]
    plane = tl.num_programs(2).to(tl.int64) * tl.num_programs(1) * M  # one moment's [SPANS, B * H, M]
    tl.store(PARTS + part, mass)
    tl.store(PARTS + plane + part, plogp)
    tl.store(PARTS + 2 * plane + part, pz)


@triton.jit
def _token_kl_backward_kernel(
    U,
    W,
    QR,
    K,
    TEMP,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    GRAD,
    LSE_S,
    LSE_Z,
    ZP,
    DU,
    DW,
    DTEMP,
    stride_ub,
    stride_uh,
    stride_um,
    stride_ue,
    stride_us,
    stride_wb,
    stride_wh,
    stride_wn,
    stride_ws,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    H,
    N,
    M,
    S,
    scale,
    GROUP: tl.constexpr,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KEYS: tl.constexpr,
    SPAN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr,
):
    (bh64, h, positions, row_ok, rows64, limit, key_limit, docs_row, row_docs, lo, hi, temperature, k_head, w_head,
     u_rows, q_heads) = _span_program(
        U, W, QR, K, TEMP, QUERY_BLOCKS, SEQ_LENS, DOCS, stride_ub, stride_uh, stride_um, stride_wb, stride_wh,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, H, N, GROUP, BLOCK_Q, SPAN, HAS_SEQ_LENS, HAS_DOCS,
    )  # fmt: skip
    if lo < hi:
        offs_d = tl.arange(0, D_P2)
        offs_s = tl.arange(0, S_P2)
        lse_rows = LSE_S + bh64 * GROUP * M + rows64  # [BQ], head g = 0
        stats = bh64 * M + rows64
        mass = tl.load(ZP + stats)
        keyed = row_ok & (mass > 0)
        lse_z = tl.load(LSE_Z + stats)
        grad = tl.where(keyed, tl.load(GRAD + stats), 0.0)  # [BQ]
        inv_mass = tl.where(keyed, 1.0 / tl.where(keyed, mass, 1.0), 0.0)
        d_temperature = tl.zeros([BLOCK_Q], tl.float32)
        s_ok = offs_s < S
        for e in tl.static_range(E):
            u_e = tl.load(
                u_rows + e * stride_ue + offs_s[None, :].to(tl.int64) * stride_us,
                mask=row_ok[:, None] & s_ok[None, :],
                other=0.0,
            )  # [BQ, S]
            du = tl.zeros([BLOCK_Q, S_P2], tl.float32)
            for start in range(lo, hi, KEYS):
                keys = start + tl.arange(0, KEYS)
                allowed = _allowed(keys, positions, row_ok, limit, docs_row, row_docs, N, HAS_DOCS) & keyed[:, None]
                k_tile = _key_tile(k_head, keys, key_limit, stride_kn, stride_kd, offs_d, HEAD_DIM)  # [KEYS, D]
                p = _target(q_heads, stride_qh, stride_qd, lse_rows, M, k_tile, offs_d, row_ok, allowed, scale,
                            GROUP, BLOCK_Q, KEYS, HEAD_DIM, IEEE)  # fmt: skip
                w_tile = _key_tile(w_head, keys, key_limit, stride_wn, stride_ws, offs_s, S)  # [KEYS, S]
                best = _index_logits(
                    u_rows, stride_ue, stride_us, w_tile, offs_s, row_ok, S, E, BLOCK_Q, KEYS, IEEE
                )  # [BQ, KEYS]
                if E == 1:
                    share = tl.full([BLOCK_Q, KEYS], 1.0, tl.float32)
                else:  # this head's part of the max: 1 / (heads at the max) where it is one of them
                    ties = tl.zeros([BLOCK_Q, KEYS], tl.float32)
                    own = tl.zeros([BLOCK_Q, KEYS], tl.float32)
                    for e2 in tl.static_range(E):
                        u_2 = tl.load(
                            u_rows + e2 * stride_ue + offs_s[None, :].to(tl.int64) * stride_us,
                            mask=row_ok[:, None] & s_ok[None, :],
                            other=0.0,
                        )
                        at_max = (dot(u_2, tl.trans(w_tile), IEEE) == best).to(tl.float32)
                        ties += at_max
                        if e2 == e:
                            own = at_max
                    share = own / tl.maximum(ties, 1.0)
                soft = tl.where(allowed, tl.exp(temperature * best - lse_z[:, None]), 0.0)
                gz = tl.where(allowed, grad[:, None] * (soft - p * inv_mass[:, None]), 0.0)  # [BQ, KEYS]
                if e == 0:
                    d_temperature += tl.sum(tl.where(allowed, gz * best, 0.0), axis=1)
                g_e = gz * share
                du += dot(g_e.to(w_tile.dtype), w_tile, IEEE)  # [BQ, S]
                dw = dot(tl.trans(g_e.to(u_e.dtype)), u_e, IEEE) * temperature  # [KEYS, S]
                dw_ptr = DW + (bh64 * N + keys[:, None].to(tl.int64)) * S_P2 + offs_s[None, :]
                tl.atomic_add(dw_ptr, dw, mask=(keys[:, None] < N) & s_ok[None, :])
            # the spans of one row share du: atomics
            du_ptr = DU + ((bh64 * M + rows64[:, None]) * E + e) * S_P2 + offs_s[None, :]
            tl.atomic_add(du_ptr, du * temperature, mask=s_ok[None, :])
        tl.atomic_add(DTEMP + h, tl.sum(d_temperature, axis=0))


# ----------------------------------------------------------------------------------------------
# Layer 2: launchers
# ----------------------------------------------------------------------------------------------
def _meta(u: Tensor, q_rows: Tensor, k: Tensor, block_q: int, seq_lens, document_ids) -> dict:
    _, heads, seq_len, dim = k.shape
    return dict(
        GROUP=q_rows.shape[1] // heads,
        E=u.shape[3],
        BLOCK_Q=block_q,
        KEYS=KEYS,
        SPAN=SPAN,
        HEAD_DIM=dim,
        D_P2=max(16, triton.next_power_of_2(dim)),
        S_P2=max(16, triton.next_power_of_2(u.shape[4])),
        HAS_SEQ_LENS=seq_lens is not None,
        HAS_DOCS=document_ids is not None,
        IEEE=u.dtype == torch.float32,
        num_warps=NUM_WARPS,
    )


def _grid(query_blocks: Tensor, k: Tensor) -> tuple[int, int, int]:
    """(listed blocks, B * H, key spans): one program per listed block, batch row and KV head, and SPAN keys."""
    B, H, N, _ = k.shape
    return query_blocks.shape[0], B * H, triton.cdiv(N, SPAN)


def _combine_lse(part_max: Tensor, part_sum: Tensor) -> Tensor:
    """The log-sum-exp over the spans (dim 0) of the spans' (running max, sum of exp(x - max)); -inf without
    terms."""
    top = part_max.amax(dim=0)
    safe = torch.where(top == float("-inf"), 0.0, top)
    total = (part_sum * torch.exp(part_max - safe)).sum(dim=0)
    return torch.where(total > 0, safe + torch.log(total), float("-inf"))


def token_kl_forward_launch(u, w, q_rows, k, temperature, query_blocks, block_q, scale, seq_lens, document_ids):
    """(kl, lse_s, lse_z, mass): float32 ``[B, H, M]``, ``[B, H, G, M]``, ``[B, H, M]``, ``[B, H, M]``. No
    validation: ``query_blocks`` int32 ``[R]`` in range, ``seq_lens`` int32 ``[B]`` clamped to N or None,
    ``document_ids`` int32 ``[B, N]`` contiguous or None, ``temperature`` float32 ``[H]``."""
    B, H, N, _ = k.shape
    M, G = u.shape[2], q_rows.shape[1] // H
    if B * H * M == 0:
        kl = torch.zeros((B, H, M), device=k.device, dtype=torch.float32)
        return kl, kl.new_zeros((B, H, G, M)), torch.full_like(kl, float("-inf")), torch.zeros_like(kl)
    grid = _grid(query_blocks, k)
    args = (
        u, w, q_rows, k, temperature, query_blocks, kernel_seq_lens(seq_lens, N, u),
        kernel_document_ids(document_ids, u),
    )  # fmt: skip
    strides = (*u.stride(), *w.stride(), *q_rows.stride(), *k.stride(), H, N, M, u.shape[4], scale)
    meta = _meta(u, q_rows, k, block_q, seq_lens, document_ids)
    # pass 1: each span's partial log-sum-exp of every head's logits and of the index logits, combined
    part_max = torch.empty((grid[2], B * H, G + 1, M), device=k.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    launch(_token_kl_lse_kernel, grid, *args, part_max, part_sum, *strides, num_stages=LSE_STAGES, **meta)
    lse = _combine_lse(part_max, part_sum).view(B, H, G + 1, M)
    lse_s, lse_z = lse[:, :, :G].contiguous(), lse[:, :, G].contiguous()
    # pass 2: each span's Z, A and C, summed
    parts = torch.empty((3, grid[2], B * H, M), device=k.device, dtype=torch.float32)
    launch(_token_kl_moments_kernel, grid, *args, lse_s, parts, *strides, num_stages=MOMENTS_STAGES, **meta)
    mass, plogp, pz = parts.sum(dim=1).view(3, B, H, M).unbind(0)
    keyed = mass > 0
    safe_mass = torch.where(keyed, mass, 1.0)
    kl = torch.where(keyed, plogp / safe_mass - torch.log(safe_mass) - pz / safe_mass + lse_z, 0.0)
    return kl, lse_s, lse_z, mass


def token_kl_backward_launch(
    grad, u, w, q_rows, k, temperature, query_blocks, block_q, scale, seq_lens, document_ids, lse_s, lse_z, mass
):
    """(du ``[B, H, M, E, S]``, dw ``[B, H, N, S]``, d temperature ``[H]``), float32. Validation as the forward's."""
    B, H, N, _ = k.shape
    _, _, M, E, S = u.shape
    s_p2 = max(16, triton.next_power_of_2(S))
    du = torch.zeros((B, H, M, E, s_p2), device=k.device, dtype=torch.float32)
    dw = torch.zeros((B, H, N, s_p2), device=k.device, dtype=torch.float32)
    d_temperature = torch.zeros((H,), device=k.device, dtype=torch.float32)
    if grad.numel() > 0:
        launch(
            _token_kl_backward_kernel, _grid(query_blocks, k), u, w, q_rows, k, temperature, query_blocks,
            kernel_seq_lens(seq_lens, N, du), kernel_document_ids(document_ids, du), grad.contiguous(), lse_s, lse_z,
            mass, du, dw, d_temperature, *u.stride(), *w.stride(), *q_rows.stride(), *k.stride(), H, N, M, S, scale,
            num_stages=BACKWARD_STAGES, **_meta(u, q_rows, k, block_q, seq_lens, document_ids),
        )  # fmt: skip
    return du[..., :S], dw[..., :S], d_temperature


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd op
# ----------------------------------------------------------------------------------------------
class TokenKLStats(NamedTuple):
    """The forward's results: the per-row KL ``[B, H, M]`` and what the backward reads: each head's lse
    ``[B, H, G, M]``, the index logits' lse ``[B, H, M]`` and the target's mass Z ``[B, H, M]`` (float32, detached).
    They depend only on the inputs: a recompute of the same call (activation checkpointing) passes them back to
    :func:`token_kl` and skips both forward passes."""

    kl: Tensor
    lse_s: Tensor
    lse_z: Tensor
    mass: Tensor


def _forward_stats(u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, stats):
    """(kl, lse_s, lse_z, mass): the forward launch, or fresh copies of an earlier call's ``stats`` (None or empty:
    none; a checkpoint recompute passes them; autograd and the custom op take ownership of what they return)."""
    if stats:
        return tuple(t.clone() for t in stats)
    temperature32 = temperature.detach().float().contiguous()
    return token_kl_forward_launch(u, w, q_rows, k, temperature32, query_blocks, block_q, scale, seq_lens, document_ids)


def _backward_grads(grad, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, lse_s,
                    lse_z, mass):  # fmt: skip
    """(du, dw, d_temperature) in the dtypes of u, w and temperature: the backward launch."""
    du, dw, d_temperature = token_kl_backward_launch(
        grad.float(), u, w, q_rows, k, temperature.detach().float().contiguous(), query_blocks, block_q, scale,
        seq_lens, document_ids, lse_s, lse_z, mass,
    )  # fmt: skip
    return du.to(u.dtype), dw.to(w.dtype), d_temperature.to(temperature.dtype)


class _TokenKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, stats):
        kl, lse_s, lse_z, mass = _forward_stats(
            u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, stats
        )
        ctx.save_for_backward(u, w, temperature, q_rows, k, query_blocks, lse_s, lse_z, mass)
        ctx.extras = (block_q, scale, seq_lens, document_ids)
        ctx.mark_non_differentiable(lse_s, lse_z, mass)
        return kl, lse_s, lse_z, mass

    @staticmethod
    def backward(ctx, grad, *_):
        u, w, temperature, q_rows, k, query_blocks, lse_s, lse_z, mass = ctx.saved_tensors
        block_q, scale, seq_lens, document_ids = ctx.extras
        grads = _backward_grads(
            grad, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, lse_s, lse_z, mass
        )
        return *grads, *([None] * 8)


# ``sparse_train::token_kl_fwd`` / ``sparse_train::token_kl_bwd``: the two launchers as torch.library custom ops
# (torch.compile, export and dispatch modes run them as graph nodes; eager calls on plain tensors take ``_TokenKL``).
# ``stats`` is the forward's four results of an earlier call (kl, lse_s, lse_z, mass) or an empty list.
@torch.library.custom_op("sparse_train::token_kl_fwd", mutates_args=())
def _token_kl_fwd_op(
    u: Tensor,
    w: Tensor,
    temperature: Tensor,
    q_rows: Tensor,
    k: Tensor,
    query_blocks: Tensor,
    block_q: int,
    scale: float,
    seq_lens: Tensor | None,
    document_ids: Tensor | None,
    stats: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    kl, lse_s, lse_z, mass = _forward_stats(
        u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, stats
    )
    if stats:
        return kl, lse_s, lse_z, mass
    # with B * H = 1, lse_s and lse_z are views of one buffer (their .contiguous() copies nothing): outputs of a custom
    # op may not alias each other
    return kl, lse_s, lse_z.clone(), mass


@_token_kl_fwd_op.register_fake
def _(u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, stats):
    B, H, M = u.shape[:3]
    G = q_rows.shape[1] // H
    rows = u.new_empty((B, H, M), dtype=torch.float32)
    return rows, u.new_empty((B, H, G, M), dtype=torch.float32), torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("sparse_train::token_kl_bwd", mutates_args=())
def _token_kl_bwd_op(
    grad: Tensor,
    u: Tensor,
    w: Tensor,
    temperature: Tensor,
    q_rows: Tensor,
    k: Tensor,
    query_blocks: Tensor,
    block_q: int,
    scale: float,
    seq_lens: Tensor | None,
    document_ids: Tensor | None,
    lse_s: Tensor,
    lse_z: Tensor,
    mass: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    du, dw, d_temperature = _backward_grads(
        grad, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, lse_s, lse_z, mass
    )
    # contiguous: du and dw are the first S columns of buffers padded to S_P2
    return du.contiguous(), dw.contiguous(), d_temperature


@_token_kl_bwd_op.register_fake
def _(grad, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, lse_s, lse_z, mass):
    return u.new_empty(u.shape), w.new_empty(w.shape), temperature.new_empty(temperature.shape)


def _token_kl_setup(ctx, inputs, output) -> None:
    u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, stats = inputs
    _, lse_s, lse_z, mass = output
    ctx.save_for_backward(u, w, temperature, q_rows, k, query_blocks, seq_lens, document_ids, lse_s, lse_z, mass)
    ctx.extras = (block_q, scale, len(stats))
    ctx.mark_non_differentiable(lse_s, lse_z, mass)


def _token_kl_backward(ctx, grad, *_):
    u, w, temperature, q_rows, k, query_blocks, seq_lens, document_ids, lse_s, lse_z, mass = ctx.saved_tensors
    block_q, scale, num_stats = ctx.extras
    du, dw, d_temperature = torch.ops.sparse_train.token_kl_bwd(
        grad, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids, lse_s, lse_z, mass
    )
    return du, dw, d_temperature, *([None] * 7), [None] * num_stats


_token_kl_fwd_op.register_autograd(_token_kl_backward, setup_context=_token_kl_setup)


# ----------------------------------------------------------------------------------------------
# Layer 4: public function
# ----------------------------------------------------------------------------------------------
def kernels_take(u: Tensor, w: Tensor, k: Tensor, block_q: int) -> bool:
    """Whether :func:`token_kl` runs these inputs' shapes and dtypes in the kernels (float64 goes to the reference):
    u and w of one dtype, both kernel dtypes, k of a kernel dtype, ``block_q`` in BLOCK_SIZES, D <= MAX_HEAD_DIM and
    S <= MAX_INDEX_DIM."""
    return (
        u.dtype == w.dtype
        and u.dtype in KERNEL_DTYPES
        and k.dtype in KERNEL_DTYPES
        and block_q in BLOCK_SIZES
        and k.shape[-1] <= MAX_HEAD_DIM
        and u.shape[-1] <= MAX_INDEX_DIM
    )


def token_kl(
    u: Tensor,
    w: Tensor,
    q_rows: Tensor,
    k: Tensor,
    temperature: Tensor,
    query_blocks: Tensor,
    *,
    block_q: int,
    scale: float,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    stats: TokenKLStats | None = None,
    with_stats: bool = False,
) -> Tensor | tuple[Tensor, TokenKLStats | None]:
    """Per-row token-level KL ``[B, H, M]`` float32 (module docstring), differentiable in ``u``, ``w`` and
    ``temperature``: :func:`~sparse_train.kernels.reference.token_kl.reference_token_kl`'s result without its
    ``[rows, N]`` tensors. With ``with_stats``: ``(kl, stats)``, the forward's :class:`TokenKLStats` (None on the
    float64 reference path); passing them back as ``stats`` with the same inputs skips the forward kernels.

    Args:
        u: ``[B, H, M, E, S]`` index queries of the listed rows (M = R * BQ, block by block), any strides.
        w: ``[B, H, N, S]`` index keys, u's dtype.
        q_rows: ``[B, H * G, M, D]`` the attention's queries at the listed rows, k's dtype (no gradient).
        k: ``[B, H, N, D]`` the attention's keys (no gradient).
        temperature: ``[H]`` the index logits' multiplier.
        query_blocks: int ``[R]``, each listed block's id, in [0, ceil(N / BQ)).
        block_q: BQ, a power of two in [16, 128]. scale: the attention logits' scale.
        seq_lens: optional int ``[B]``. document_ids: optional int ``[B, N]``, non-decreasing per row.

    Float16 / bfloat16 / float32 inputs on CUDA (float16 / float32 under the interpreter); float64 goes to the
    reference.

    Raises:
        ValueError: shapes that disagree, a block size or head dim outside the limits, u and w or q_rows and k of
            different dtypes, tensors on different devices, ``stats`` of other shapes.
    """
    if u.dtype == torch.float64 or q_rows.dtype == torch.float64:
        kl = reference_token_kl(
            u, w, q_rows, k, temperature, query_blocks, block_q=block_q, scale=scale, seq_lens=seq_lens,
            document_ids=document_ids,
        ).float()  # fmt: skip
        return (kl, None) if with_stats else kl
    B, H, N, D = k.shape
    if u.dim() != 5 or u.shape[:2] != (B, H) or w.shape != (B, H, N, u.shape[4]):
        raise ValueError(
            f"u must be [B, H, M, E, S] and w [B, H, N, S] with k [B, H, N, D] = {tuple(k.shape)}; got "
            f"{tuple(u.shape)} and {tuple(w.shape)}"
        )
    M = u.shape[2]
    if block_q not in BLOCK_SIZES or M != query_blocks.shape[0] * block_q:
        raise ValueError(f"block_q must be one of {BLOCK_SIZES} with M = R * block_q, got {block_q} and M = {M}")
    if q_rows.dim() != 4 or q_rows.shape[0] != B or q_rows.shape[1] % H or q_rows.shape[2:] != (M, D):
        raise ValueError(f"q_rows must be [B, H * G, M, D] = [{B}, H * G, {M}, {D}], got {tuple(q_rows.shape)}")
    if D > MAX_HEAD_DIM or u.shape[4] > MAX_INDEX_DIM:
        raise ValueError(
            f"the kernels take D <= {MAX_HEAD_DIM} and S <= {MAX_INDEX_DIM}, got D = {D}, S = {u.shape[4]}"
        )
    if u.dtype != w.dtype or q_rows.dtype != k.dtype:
        raise ValueError(f"u and w, q_rows and k must share a dtype, got {u.dtype}/{w.dtype}, {q_rows.dtype}/{k.dtype}")
    if temperature.shape != (H,):
        raise ValueError(f"temperature must be [H] = [{H}], got {tuple(temperature.shape)}")
    devices = {t.device for t in (u, w, q_rows, k, temperature)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    blocks = query_blocks.to(k.device, torch.int32).contiguous()
    lens = None if seq_lens is None else seq_lens.to(k.device, torch.int64).clamp(0, N).to(torch.int32).contiguous()
    docs = None if document_ids is None else document_ids.to(k.device, torch.int32).contiguous()
    group = q_rows.shape[1] // H
    if stats is not None and not (
        isinstance(stats, TokenKLStats) and stats.kl.shape == (B, H, M) and stats.lse_s.shape == (B, H, group, M)
    ):
        raise ValueError("stats must be the TokenKLStats of a call with the same shapes")
    if direct_call(u, w, temperature, q_rows, k):
        kl, *saved = _TokenKL.apply(
            u, w, temperature, q_rows.detach(), k.detach(), blocks, block_q, scale, lens, docs, stats
        )
    else:
        kl, *saved = torch.ops.sparse_train.token_kl_fwd(
            u, w, temperature, q_rows.detach(), k.detach(), blocks, block_q, scale, lens, docs,
            [] if stats is None else [t.detach() for t in stats],
        )  # fmt: skip
    return (kl, TokenKLStats(kl.detach(), *(t.detach() for t in saved))) if with_stats else kl
