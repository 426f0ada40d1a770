"""Triton kernel for the selector's distillation target: attention mass per selected key block.

Math (per KV head group, query block i and selected slot t holding key block j):
    P[g, r, k] = exp(scale * <Q[g, r], K[k]> - lse[g, r])     (the main attention's own probabilities)
    m[g, r, t] = sum over valid keys k of block j of P[g, r, k]   (row r's mass on the slot)
    M[i, t]    = max (ROW_MAX) or sum over live rows r of block i and heads g of the group of m
    target[i, t] = M[i, t] / sum_t' M[i, t']                  (normalised over the selected set)

Notation: B batch, HQ/HKV query/KV heads, G = HQ/HKV, N length, D head dim, BQ/BK block sizes,
K index capacity, HPP query heads stacked into one program's rows (M_ROWS = HPP*BQ), NSUB = G/HPP.
A row is live when it is a real query (q < N and q < seq_lens[b]) with a finite lse; a key is valid
when k <= q and k < seq_lens[b]. The PyTorch reference is
:func:`sparse_train.kernels.reference_block_mass.reference_sparse_block_mass` (same semantics, any
rows_per_block); the dense one :func:`~sparse_train.kernels.reference_block_mass.reference_dense_block_mass`.

Cost: one QK^T tile product per (query tile, selected block), half of the forward's two, and no
softmax state: the forward's lse already normalises every row. Known limits: the forward kernel's
dtypes, head dims and block sizes; all rows of each block are used (no row subsampling); the output
is float32 and takes no gradient (the target is a constant of the selector's loss).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..plan import block_mass_config, forward_config, forward_num_splits
from ..validation import check_choice, check_inputs, check_scale
from .forward import LOG2E, kernel_seq_lens, launch, sparse_attn_forward
from .reference_block_mass import ROW_POOLS

__all__ = ["triton_block_mass", "triton_dense_block_mass"]


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _block_mass_kernel(
    Q, K, LSE, IDX, CNT, SEQLENS, OUT,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    slb, slh, sln,
    sib, sih, siq, sik,
    scb, sch, scq,
    N, HKV, NQB, KCAP, scale_log2,
    G: tl.constexpr, HPP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, IEEE: tl.constexpr, ROW_MAX: tl.constexpr,
):
    NSUB: tl.constexpr = G // HPP
    M_ROWS: tl.constexpr = HPP * BQ
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1)
    qb = pid0 // NSUB
    hsub = pid0 % NSUB
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    b64 = b.to(tl.int64)

    offs_m = tl.arange(0, M_ROWS)
    offs_d = tl.arange(0, D)
    offs_k = tl.arange(0, BK)
    head64 = (hkv * G + hsub * HPP + offs_m // BQ).to(tl.int64)      # [M_ROWS]
    qpos = qb * BQ + offs_m % BQ                                      # [M_ROWS]
    if HAS_SEQLENS:
        seqlen = tl.minimum(tl.load(SEQLENS + b).to(tl.int32), N)
    else:
        seqlen = N
    row_real = qpos < seqlen
    qpos64 = qpos.to(tl.int64)
    q = tl.load(Q + b64 * sqb + head64[:, None] * sqh + qpos64[:, None] * sqn + offs_d[None, :] * sqd,
                mask=row_real[:, None], other=0.0)                    # [M_ROWS, D]
    lse = tl.load(LSE + b64 * slb + head64 * slh + qpos64 * sln, mask=row_real, other=float("-inf"))
    # dead rows (padding, empty selection) subtract +inf: their probabilities are exactly 0
    live = row_real & (lse > float("-inf"))
    lse2 = tl.where(live, lse * 1.4426950408889634, float("inf"))     # [M_ROWS] log2 domain

    cnt = tl.load(CNT + b64 * scb + hkv * sch + qb * scq)
    idx_base = IDX + b64 * sib + hkv * sih + qb * siq
    k_base = K + b64 * skb + hkv.to(tl.int64) * skh
    out_base = OUT + ((pid_bh.to(tl.int64) * NSUB + hsub) * NQB + qb) * KCAP
    for t in range(0, cnt):
        j = tl.load(idx_base + t * sik)
        kpos = j * BK + offs_k                                        # [BK]
        key_in = kpos < seqlen
        k = tl.load(k_base + kpos.to(tl.int64)[:, None] * skn + offs_d[None, :] * skd,
                    mask=key_in[:, None], other=0.0)                  # [BK, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))                                # [M_ROWS, BK]
        ok = (kpos[None, :] <= qpos[:, None]) & key_in[None, :]
        p = tl.where(ok, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        row_mass = tl.sum(p, 1)                                       # [M_ROWS]
        if ROW_MAX:
            tl.store(out_base + t, tl.max(row_mass, 0))
        else:
            tl.store(out_base + t, tl.sum(row_mass, 0))


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def block_mass_launch(q: Tensor, k: Tensor, lse: Tensor, indices: Tensor, counts: Tensor, *, block_q: int,
                      block_k: int, scale: float, seq_lens: Tensor | None = None, row_max: bool = True) -> Tensor:
    """Unnormalised mass float32 ``[B, HKV, NQB, K]`` pooled over rows by max (``row_max``) or sum
    (zeros in empty slots). No validation; q, k, lse, indices, counts are passed with their strides,
    seq_lens made contiguous (`kernel_seq_lens`)."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    G = HQ // HKV
    NQB, KCAP = indices.shape[2], indices.shape[3]
    config = block_mass_config(G, block_q)
    hpp = config.heads_per_program
    nsub = G // hpp
    out = torch.zeros((B, HKV, nsub, NQB, KCAP), device=q.device, dtype=torch.float32)
    seq_arg = kernel_seq_lens(seq_lens, N, counts)
    launch(
        _block_mass_kernel, (NQB * nsub, B * HKV),
        q, k, lse, indices, counts, seq_arg, out,
        *q.stride(), *k.stride(), *lse.stride(), *indices.stride(), *counts.stride(),
        N, HKV, NQB, KCAP, float(scale * LOG2E),
        G=G, HPP=hpp, BQ=block_q, BK=block_k, D=D,
        HAS_SEQLENS=seq_lens is not None, IEEE=q.dtype == torch.float32, ROW_MAX=row_max,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.amax(dim=2) if row_max else out.sum(dim=2)


# ----------------------------------------------------------------------------------------------
# Layer 3/4: public function (no autograd: the target is a constant)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_block_mass(q: Tensor, k: Tensor, lse: Tensor, index, *, scale: float,
                      seq_lens: Tensor | None = None, row_pool: str = "max") -> tuple[Tensor, Tensor]:
    """Distillation target over the selected blocks, from the forward's lse.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]`` (any strides; detached here).
        lse: ``[B, HQ, N]`` float32 natural-log row log-sum-exp of the main attention over ``index``.
        index: the :class:`~sparse_train.BlockIndex` the attention used.
        scale: logit scale of the main attention (finite).
        seq_lens: optional int ``[B]``, values in ``[0, N]``; keys and query rows at positions >=
            seq_lens[b] are dead (never loaded: NaN/inf there cannot reach the target).
        row_pool: ``"max"`` (default: each slot's largest single-row mass) or ``"mean"``.

    Returns:
        ``target`` float32 ``[B, HKV, NQB, K]`` (each valid row sums to 1 over its selected slots,
        zeros on empty slots) and ``row_valid`` bool ``[B, HKV, NQB]``.

    Raises:
        ValueError: shapes that do not match the index, an lse of the wrong shape/dtype/device, or an
            unknown ``row_pool``.
    """
    check_choice("row_pool", row_pool, ROW_POOLS)
    check_inputs(q, k, k, index, seq_lens)
    scale = check_scale(scale, q.shape[-1])
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(
            f"lse must be float32 {tuple(q.shape[:3])} on {q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}"
        )
    mass = block_mass_launch(
        q.detach(), k.detach(), lse.detach(), index.indices, index.counts,
        block_q=index.block_q, block_k=index.block_k, scale=scale, seq_lens=seq_lens, row_max=row_pool == "max",
    )
    total = mass.sum(dim=-1, keepdim=True)
    row_valid = total.squeeze(-1) > 0
    target = torch.where(total > 0, mass / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return target, row_valid


@torch.no_grad()
def triton_dense_block_mass(q: Tensor, k: Tensor, query_blocks: Tensor, *, block_q: int, block_k: int, scale: float,
                            seq_lens: Tensor | None = None, row_pool: str = "max") -> tuple[Tensor, Tensor]:
    """Dense causal attention mass of a few query blocks on every key block, through the kernels.

    The index used here gives each query block of ``query_blocks`` every causally reachable key
    block (so its slot t holds key block t) and the other query blocks nothing; the forward kernel
    then yields the rows' dense lse (its output is discarded; empty rows cost nothing) and the
    block-mass kernel the pooled, renormalised mass per slot. Cost: two passes over S query blocks x N
    keys, never an N x N buffer (the PyTorch reference materialises S x G x BQ x N fp32 logits).

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]`` (kernel-supported dtype, head dim and blocks).
        query_blocks: int ``[S]`` distinct query-block ids.
        block_q, block_k, scale, seq_lens, row_pool: as :func:`triton_block_mass`.

    Returns:
        ``target`` float32 ``[B, HKV, S, NKB]`` (each valid row sums to 1 over its causal blocks) and
        ``row_valid`` bool ``[B, HKV, S]``: the semantics of
        :func:`sparse_train.kernels.reference_block_mass.reference_dense_block_mass` with all rows.
    """
    from ..index import BlockIndex, causal_last_block  # the index layer sits above the kernels

    batch, _, seq_len, _ = q.shape
    num_kv_heads = k.shape[1]
    num_q_blocks = -(-seq_len // block_q)
    num_k_blocks = -(-seq_len // block_k)
    picks = query_blocks.to(device=q.device, dtype=torch.int64)
    reach = causal_last_block(num_q_blocks, seq_len, block_q, block_k, q.device) + 1  # [NQB]
    counts = torch.zeros(num_q_blocks, dtype=torch.int32, device=q.device)
    counts[picks] = reach[picks].to(torch.int32)
    capacity = num_k_blocks  # the last query block reaches every key block
    slots = torch.arange(capacity, device=q.device, dtype=torch.int32)
    indices = torch.where(slots.view(1, -1) < counts.view(-1, 1), slots.view(1, -1), -1)  # [NQB, K]
    index = BlockIndex.from_canonical(
        indices.expand(batch, num_kv_heads, -1, -1).contiguous(),
        counts.expand(batch, num_kv_heads, -1).contiguous(),
        seq_len=seq_len, block_q=block_q, block_k=block_k, check="none",
    )
    scale = check_scale(scale, q.shape[-1])
    group = q.shape[1] // num_kv_heads
    config = forward_config(group, block_q, block_k, q.shape[-1])
    num_splits = forward_num_splits(picks.numel(), batch, num_kv_heads, group, config.heads_per_program, capacity,
                                    q.device)
    _, lse = sparse_attn_forward(q, k, k, index.indices, index.counts, block_q=block_q, block_k=block_k,
                                 scale=scale, seq_lens=seq_lens, num_splits=num_splits, config=config)
    target, row_valid = triton_block_mass(q, k, lse, index, scale=scale, seq_lens=seq_lens, row_pool=row_pool)
    out = torch.zeros(batch, num_kv_heads, picks.numel(), num_k_blocks, device=q.device, dtype=torch.float32)
    out[..., :capacity] = target[:, :, picks]
    return out, row_valid[:, :, picks]
