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

Layers: (1) ``_token_kl_forward_kernel``: one program per (listed block, b * H + h); pass 1 walks the keys once per
head g for lse_g (the index logits' lse_z on the way), pass 2 walks them once more for Z, A and C; it stores kl and,
for the backward, lse_g, lse_z and Z. ``_token_kl_backward_kernel``: one program per (listed block, b * H + h), one
walk over the keys per index head e: recomputes p and z, accumulates du in registers, adds dw (atomics: the listed
blocks share keys) and the temperature's gradient. Helpers: the program's rows (``_listed_rows``), the key mask
(``_allowed``), a key tile (``_key_tile``), the logits (``_head_logits``, ``_index_logits``) and the target
(``_target``). (2) the launchers; (3) the autograd op ``_TokenKL``; (4) the public function :func:`token_kl`.

Known limits: float16 / bfloat16 / float32 inputs (float32 products in IEEE precision; bf16 on CUDA only), block
sizes 16..128 powers of two, D <= 256, S <= 128; the backward spills registers with more than one index head. Not yet
measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.token_kl import reference_token_kl
from ._jit import dot
from ._launch import kernel_document_ids, kernel_seq_lens

__all__ = ["KEYS", "NUM_WARPS", "token_kl", "token_kl_backward_launch", "token_kl_forward_launch"]

KEYS = 32
"""Keys per step of both kernels (with NUM_WARPS, the largest step whose backward compiles without register spills
for one index head at D = 128 on sm_90a: the compile test)."""
NUM_WARPS = 8


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
def _token_kl_forward_kernel(
    U,
    W,
    QR,
    K,
    TEMP,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    KL,
    LSE_S,
    LSE_Z,
    ZP,
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
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr,
):
    listed = tl.program_id(0)
    bh = tl.program_id(1)
    b64 = (bh // H).to(tl.int64)
    h = bh % H
    h64 = h.to(tl.int64)
    positions, row_ok, rows64, limit, key_limit, keys_end, docs_row, row_docs = _listed_rows(
        QUERY_BLOCKS, SEQ_LENS, DOCS, listed, b64, N, BLOCK_Q, HAS_SEQ_LENS, HAS_DOCS
    )
    offs_d = tl.arange(0, D_P2)
    offs_s = tl.arange(0, S_P2)
    temperature = tl.load(TEMP + h).to(tl.float32)
    k_head = K + b64 * stride_kb + h64 * stride_kh
    w_head = W + b64 * stride_wb + h64 * stride_wh
    u_rows = U + b64 * stride_ub + h64 * stride_uh + rows64[:, None] * stride_um  # [BQ, 1]
    q_heads = QR + b64 * stride_qb + h64 * GROUP * stride_qh + rows64[:, None] * stride_qm  # [BQ, 1], head g = 0
    lse_rows = LSE_S + (b64 * H + h64) * GROUP * M + rows64  # [BQ], head g = 0
    stats = (b64 * H + h64) * M + rows64  # [BQ] offsets of this program's rows in [B, H, M]
    # pass 1: lse of each head's logits (and of the index logits on head 0's walk)
    lse_z = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        q_head = q_heads + g * stride_qh
        run_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_Q], tl.float32)
        z_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        z_sum = tl.zeros([BLOCK_Q], tl.float32)
        for start in range(0, keys_end, KEYS):
            keys = start + tl.arange(0, KEYS)  # [KEYS]
            allowed = _allowed(keys, positions, row_ok, limit, docs_row, row_docs, N, HAS_DOCS)
            k_tile = _key_tile(k_head, keys, key_limit, stride_kn, stride_kd, offs_d, HEAD_DIM)  # [KEYS, D]
            logits = tl.where(
                allowed, _head_logits(q_head, stride_qd, k_tile, offs_d, row_ok, scale, HEAD_DIM, IEEE), float("-inf")
            )
            new_max = tl.maximum(run_max, tl.max(logits, axis=1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
            run_max = new_max
            if g == 0:
                w_tile = _key_tile(w_head, keys, key_limit, stride_wn, stride_ws, offs_s, S)  # [KEYS, S]
                z = tl.where(
                    allowed,
                    temperature
                    * _index_logits(u_rows, stride_ue, stride_us, w_tile, offs_s, row_ok, S, E, BLOCK_Q, KEYS, IEEE),
                    float("-inf"),
                )
                new_z = tl.maximum(z_max, tl.max(z, axis=1))
                safe_z = tl.where(new_z == float("-inf"), 0.0, new_z)
                z_sum = z_sum * tl.exp(z_max - safe_z) + tl.sum(tl.exp(z - safe_z[:, None]), axis=1)
                z_max = new_z
        lse_g = tl.where(run_sum > 0, run_max + tl.log(run_sum), float("-inf"))
        tl.store(lse_rows + g * M, lse_g)
        if g == 0:
            lse_z = tl.where(z_sum > 0, z_max + tl.log(z_sum), float("-inf"))
    # pass 2: Z = sum p, A = sum p log p, C = sum p z with p the max over heads of the heads' probabilities
    mass = tl.zeros([BLOCK_Q], tl.float32)
    plogp = tl.zeros([BLOCK_Q], tl.float32)
    pz = tl.zeros([BLOCK_Q], tl.float32)
    for start in range(0, keys_end, KEYS):
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
    keyed = row_ok & (mass > 0)
    safe_mass = tl.where(keyed, mass, 1.0)
    kl = tl.where(keyed, plogp / safe_mass - tl.log(safe_mass) - pz / safe_mass + lse_z, 0.0)
    tl.store(KL + stats, kl)
    tl.store(LSE_Z + stats, lse_z)
    tl.store(ZP + stats, mass)


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
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr,
):
    listed = tl.program_id(0)
    bh = tl.program_id(1)
    b64 = (bh // H).to(tl.int64)
    h = bh % H
    h64 = h.to(tl.int64)
    positions, row_ok, rows64, limit, key_limit, keys_end, docs_row, row_docs = _listed_rows(
        QUERY_BLOCKS, SEQ_LENS, DOCS, listed, b64, N, BLOCK_Q, HAS_SEQ_LENS, HAS_DOCS
    )
    offs_d = tl.arange(0, D_P2)
    offs_s = tl.arange(0, S_P2)
    temperature = tl.load(TEMP + h).to(tl.float32)
    k_head = K + b64 * stride_kb + h64 * stride_kh
    w_head = W + b64 * stride_wb + h64 * stride_wh
    u_rows = U + b64 * stride_ub + h64 * stride_uh + rows64[:, None] * stride_um  # [BQ, 1]
    q_heads = QR + b64 * stride_qb + h64 * GROUP * stride_qh + rows64[:, None] * stride_qm  # [BQ, 1], head g = 0
    lse_rows = LSE_S + (b64 * H + h64) * GROUP * M + rows64  # [BQ], head g = 0
    stats = (b64 * H + h64) * M + rows64
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
        for start in range(0, keys_end, KEYS):
            keys = start + tl.arange(0, KEYS)
            allowed = _allowed(keys, positions, row_ok, limit, docs_row, row_docs, N, HAS_DOCS) & keyed[:, None]
            k_tile = _key_tile(k_head, keys, key_limit, stride_kn, stride_kd, offs_d, HEAD_DIM)  # [KEYS, D]
            p = _target(q_heads, stride_qh, stride_qd, lse_rows, M, k_tile, offs_d, row_ok, allowed, scale, GROUP,
                        BLOCK_Q, KEYS, HEAD_DIM, IEEE)  # fmt: skip
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
            dw_ptr = DW + ((b64 * H + h64) * N + keys[:, None].to(tl.int64)) * S_P2 + offs_s[None, :]
            tl.atomic_add(dw_ptr, dw, mask=(keys[:, None] < N) & s_ok[None, :])
        du_ptr = DU + (((b64 * H + h64) * M + rows64[:, None]) * E + e) * S_P2 + offs_s[None, :]
        tl.store(du_ptr, du * temperature, mask=s_ok[None, :])
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
        HEAD_DIM=dim,
        D_P2=max(16, triton.next_power_of_2(dim)),
        S_P2=max(16, triton.next_power_of_2(u.shape[4])),
        HAS_SEQ_LENS=seq_lens is not None,
        HAS_DOCS=document_ids is not None,
        IEEE=u.dtype == torch.float32,
        num_warps=NUM_WARPS,
    )


def token_kl_forward_launch(u, w, q_rows, k, temperature, query_blocks, block_q, scale, seq_lens, document_ids):
    """(kl, lse_s, lse_z, mass): float32 ``[B, H, M]``, ``[B, H, G, M]``, ``[B, H, M]``, ``[B, H, M]``. No
    validation: ``query_blocks`` int32 ``[R]`` in range, ``seq_lens`` int32 ``[B]`` clamped to N or None,
    ``document_ids`` int32 ``[B, N]`` contiguous or None, ``temperature`` float32 ``[H]``."""
    B, H, N, _ = k.shape
    M, G = u.shape[2], q_rows.shape[1] // H
    kl = torch.empty((B, H, M), device=k.device, dtype=torch.float32)
    lse_s = torch.empty((B, H, G, M), device=k.device, dtype=torch.float32)
    lse_z, mass = torch.empty_like(kl), torch.empty_like(kl)
    if kl.numel() == 0:
        return kl, lse_s, lse_z, mass
    fallback = kl
    _token_kl_forward_kernel[(query_blocks.shape[0], B * H)](
        u, w, q_rows, k, temperature, query_blocks, kernel_seq_lens(seq_lens, N, fallback),
        kernel_document_ids(document_ids, fallback), kl, lse_s, lse_z, mass,
        *u.stride(), *w.stride(), *q_rows.stride(), *k.stride(), H, N, M, u.shape[4], scale,
        **_meta(u, q_rows, k, block_q, seq_lens, document_ids),
    )  # fmt: skip
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
        fallback = du
        _token_kl_backward_kernel[(query_blocks.shape[0], B * H)](
            u, w, q_rows, k, temperature, query_blocks, kernel_seq_lens(seq_lens, N, fallback),
            kernel_document_ids(document_ids, fallback), grad.contiguous(), lse_s, lse_z, mass, du, dw, d_temperature,
            *u.stride(), *w.stride(), *q_rows.stride(), *k.stride(), H, N, M, S, scale,
            **_meta(u, q_rows, k, block_q, seq_lens, document_ids),
        )  # fmt: skip
    return du[..., :S], dw[..., :S], d_temperature


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd op
# ----------------------------------------------------------------------------------------------
class _TokenKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, w, temperature, q_rows, k, query_blocks, block_q, scale, seq_lens, document_ids):
        temperature32 = temperature.detach().float().contiguous()
        kl, lse_s, lse_z, mass = token_kl_forward_launch(
            u, w, q_rows, k, temperature32, query_blocks, block_q, scale, seq_lens, document_ids
        )
        ctx.save_for_backward(u, w, temperature32, q_rows, k, query_blocks, lse_s, lse_z, mass)
        ctx.extras = (block_q, scale, seq_lens, document_ids, temperature.dtype)
        return kl

    @staticmethod
    def backward(ctx, grad):
        u, w, temperature32, q_rows, k, query_blocks, lse_s, lse_z, mass = ctx.saved_tensors
        block_q, scale, seq_lens, document_ids, temperature_dtype = ctx.extras
        du, dw, d_temperature = token_kl_backward_launch(
            grad.float(), u, w, q_rows, k, temperature32, query_blocks, block_q, scale, seq_lens, document_ids,
            lse_s, lse_z, mass,
        )  # fmt: skip
        return du.to(u.dtype), dw.to(w.dtype), d_temperature.to(temperature_dtype), *([None] * 7)


# ----------------------------------------------------------------------------------------------
# Layer 4: public function
# ----------------------------------------------------------------------------------------------
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
) -> Tensor:
    """Per-row token-level KL ``[B, H, M]`` float32 (module docstring), differentiable in ``u``, ``w`` and
    ``temperature``: :func:`~sparse_train.kernels.reference.token_kl.reference_token_kl`'s result without its
    ``[rows, N]`` tensors.

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
            different dtypes, tensors on different devices.
    """
    if u.dtype == torch.float64 or q_rows.dtype == torch.float64:
        return reference_token_kl(
            u, w, q_rows, k, temperature, query_blocks, block_q=block_q, scale=scale, seq_lens=seq_lens,
            document_ids=document_ids,
        ).float()  # fmt: skip
    B, H, N, D = k.shape
    if u.dim() != 5 or u.shape[:2] != (B, H) or w.shape != (B, H, N, u.shape[4]):
        raise ValueError(
            f"u must be [B, H, M, E, S] and w [B, H, N, S] with k [B, H, N, D] = {tuple(k.shape)}; got "
            f"{tuple(u.shape)} and {tuple(w.shape)}"
        )
    M = u.shape[2]
    if block_q not in (16, 32, 64, 128) or M != query_blocks.shape[0] * block_q:
        raise ValueError(f"block_q must be 16, 32, 64 or 128 with M = R * block_q, got {block_q} and M = {M}")
    if q_rows.dim() != 4 or q_rows.shape[0] != B or q_rows.shape[1] % H or q_rows.shape[2:] != (M, D):
        raise ValueError(f"q_rows must be [B, H * G, M, D] = [{B}, H * G, {M}, {D}], got {tuple(q_rows.shape)}")
    if D > 256 or u.shape[4] > 128:
        raise ValueError(f"the kernels take D <= 256 and S <= 128, got D = {D}, S = {u.shape[4]}")
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
    return _TokenKL.apply(u, w, temperature, q_rows.detach(), k.detach(), blocks, block_q, scale, lens, docs)
