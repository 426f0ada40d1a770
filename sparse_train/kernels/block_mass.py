"""Triton kernel of the selector's distillation target: attention mass per selected key block.

Math, per query block i of KV head h and selected slot t holding key block j (P from the forward's lse):
    m[g, r, t] = sum over valid keys k of block j of exp(scale <Q[g, r], K[k]> - lse[g, r])
    M[i, t] = max (ROW_MAX) or sum over the live rows r of block i and the heads g of group h of m[g, r, t]
    target[i, t] = M[i, t] / sum_t' M[i, t']     (renormalised over the selected set; 0 without mass)

Notation: as in forward.py (B, HQ, HKV, GROUP, N, HEAD_DIM = D, BLOCK_Q / BLOCK_K, NQB, K capacity,
HEADS_PER_PROGRAM heads stacked into M = HEADS_PER_PROGRAM * BQ rows, HEAD_SUBSETS per group). A row is
live when it is a real query (q < N and q < seq_lens[b]) with a finite lse; a key is valid when k <= q,
k < seq_lens[b] and, with packed documents (HAS_DOCS), doc[b, k] == doc[b, q]. The reference is
kernels/reference_block_mass.py (any rows_per_block).

Layers: (1) ``@triton.jit`` kernel ``_block_mass_kernel`` (one QK^T tile product per (query tile,
selected block), no softmax state: the forward's lse already normalises every row); (2) the launcher
``block_mass_launch``; no autograd op (the target is a constant of the selector's loss); (4) the public
functions ``triton_block_mass`` (selected blocks) and ``triton_dense_block_mass`` (every causal block
of a few query blocks, through the forward and this kernel). Tile configuration: sparse_train/plan.py.

Known limits: the forward kernel's dtypes, head dims and block sizes; all rows of each block are used
(no row subsampling); float32 output, no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..index import BlockIndex, causal_last_block
from ..plan import block_mass_config, forward_config
from ..validation import check_choice, check_document_ids, check_inputs, check_scale
from ._jit import (
    LOG2E,
    documents_row,
    dot,
    index_row,
    load_documents,
    load_rows,
    query_tile,
    sequence_length,
    tile_pointers,
)
from ._launch import kernel_document_ids, kernel_seq_lens, launch
from .forward import sparse_attn_forward
from .reference_block_mass import ROW_POOLS, renormalise

__all__ = ["block_mass_launch", "triton_block_mass", "triton_dense_block_mass"]


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _block_mass_kernel(
    Q, K, LSE, INDICES, COUNTS, SEQ_LENS, DOCS, OUT,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_lb, stride_lh, stride_ln,
    stride_ib, stride_ih, stride_iq, stride_ik,
    stride_cb, stride_ch, stride_cq,
    N, HKV, NQB, CAPACITY, scale_log2,
    GROUP: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SEQ_LENS: tl.constexpr, IEEE: tl.constexpr, ROW_MAX: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    HEAD_SUBSETS: tl.constexpr = GROUP // HEADS_PER_PROGRAM
    scale_log2 = tl.cast(scale_log2, tl.float32)  # fp64 when launched from an inductor graph (see forward.py)
    qb, b, hkv, head, qpos = query_tile(NQB, HKV, GROUP, HEADS_PER_PROGRAM, BLOCK_Q, False)  # head, qpos: [M]
    b64, hkv64, head64, qpos64 = b.to(tl.int64), hkv.to(tl.int64), head.to(tl.int64), qpos.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    if HAS_SEQ_LENS:
        seqlen = tl.minimum(seqlen, N)
    row_real = qpos < seqlen
    q = load_rows(Q, b64, head64, qpos64, offs_d, stride_qb, stride_qh, stride_qn, stride_qd, row_real)  # [M, D]
    lse = tl.load(LSE + b64 * stride_lb + head64 * stride_lh + qpos64 * stride_ln, mask=row_real, other=float("-inf"))
    # dead rows (padding, empty selection) subtract +inf: their probabilities are exactly 0
    live = row_real & (lse > float("-inf"))
    lse2 = tl.where(live, lse * LOG2E, float("inf"))  # [M] log2 domain
    if HAS_DOCS:
        docs_row = documents_row(DOCS, b64, N)
        doc_q = load_documents(docs_row, qpos, N)  # [M]

    selected, count = index_row(INDICES, COUNTS, b64, hkv64, qb.to(tl.int64), stride_ib, stride_ih, stride_iq,
                             stride_cb, stride_ch, stride_cq)
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    head_subset = tl.program_id(0) % HEAD_SUBSETS
    out_row = OUT + ((tl.program_id(1).to(tl.int64) * HEAD_SUBSETS + head_subset) * NQB + qb) * CAPACITY
    for t in range(0, count):
        j = tl.load(selected + t * stride_ik)  # t-th selected key block
        kpos = j * BLOCK_K + offs_k  # [BK]
        key_in = kpos < seqlen
        k = tl.load(tile_pointers(k_base, kpos.to(tl.int64), offs_d, stride_kn, stride_kd),
                    mask=key_in[:, None], other=0.0)  # [BK, D]
        s = dot(q, tl.trans(k), IEEE)  # [M, BK]
        ok = (kpos[None, :] <= qpos[:, None]) & key_in[None, :]
        if HAS_DOCS:
            ok = ok & (doc_q[:, None] == load_documents(docs_row, kpos, N)[None, :])
        p = tl.where(ok, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        row_mass = tl.sum(p, 1)  # [M]
        if ROW_MAX:
            tl.store(out_row + t, tl.max(row_mass, 0))
        else:
            tl.store(out_row + t, tl.sum(row_mass, 0))


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def block_mass_launch(q: Tensor, k: Tensor, lse: Tensor, indices: Tensor, counts: Tensor, *, block_q: int,
                      block_k: int, scale: float, seq_lens: Tensor | None = None, row_max: bool = True,
                      document_ids: Tensor | None = None) -> Tensor:
    """Unnormalised mass float32 ``[B, HKV, NQB, K]`` pooled over rows by max (``row_max``) or sum
    (zeros in empty slots). No validation; q, k, lse, indices, counts are passed with their strides,
    seq_lens and document_ids ``[B, N]`` made contiguous int32 (``kernel_seq_lens``, ``kernel_document_ids``)."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    group = HQ // HKV
    NQB, capacity = indices.shape[2], indices.shape[3]
    config = block_mass_config(group, block_q)
    head_subsets = group // config.heads_per_program
    out = torch.zeros((B, HKV, head_subsets, NQB, capacity), device=q.device, dtype=torch.float32)
    launch(
        _block_mass_kernel, (NQB * head_subsets, B * HKV),
        q, k, lse, indices, counts, kernel_seq_lens(seq_lens, N, counts), kernel_document_ids(document_ids, counts),
        out,
        *q.stride(), *k.stride(), *lse.stride(), *indices.stride(), *counts.stride(),
        N, HKV, NQB, capacity, float(scale * LOG2E.value),
        GROUP=group, HEADS_PER_PROGRAM=config.heads_per_program, BLOCK_Q=block_q, BLOCK_K=block_k, HEAD_DIM=D,
        HAS_SEQ_LENS=seq_lens is not None, IEEE=q.dtype == torch.float32, ROW_MAX=row_max,
        HAS_DOCS=document_ids is not None, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.amax(dim=2) if row_max else out.sum(dim=2)


# ----------------------------------------------------------------------------------------------
# Layer 4: public functions (no autograd: the target is a constant)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_block_mass(q: Tensor, k: Tensor, lse: Tensor, index, *, scale: float,
                      seq_lens: Tensor | None = None, row_pool: str = "max",
                      document_ids: Tensor | None = None, check_values: bool = True) -> tuple[Tensor, Tensor]:
    """Distillation target over the selected blocks, from the forward's lse.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]`` (any strides; detached here).
        lse: ``[B, HQ, N]`` float32 natural-log row log-sum-exp of the main attention over ``index``.
        index: the :class:`~sparse_train.BlockIndex` the attention used.
        scale: logit scale of the main attention (finite).
        seq_lens: optional int ``[B]``, values in ``[0, N]``; keys and query rows at positions >=
            seq_lens[b] are dead (never loaded: NaN/inf there cannot reach the target).
        row_pool: ``"max"`` (default: each slot's largest single-row mass) or ``"mean"``.
        document_ids: optional int ``[B, N]``, non-decreasing (packed documents): keys of another
            document than the row's are masked, as in the attention that produced ``lse``.
        check_values: check the values of ``seq_lens`` and ``document_ids`` (host syncs on CUDA; see
            ``sparse_train.sparse_attention``).

    Returns:
        ``target`` float32 ``[B, HKV, NQB, K]`` (each valid row sums to 1 over its selected slots,
        zeros on empty slots) and ``row_valid`` bool ``[B, HKV, NQB]``.

    Raises:
        ValueError: shapes that do not match the index, an lse of the wrong shape/dtype/device, bad
            seq_lens or document_ids, or an unknown ``row_pool``.
    """
    check_choice("row_pool", row_pool, ROW_POOLS)
    check_inputs(q, k, k, index, seq_lens, document_ids=document_ids, seq_lens_values=check_values)
    scale = check_scale(scale, q.shape[-1])
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(
            f"lse must be float32 {tuple(q.shape[:3])} on {q.device}, got {lse.dtype} {tuple(lse.shape)} on {lse.device}"
        )
    mass = block_mass_launch(
        q.detach(), k.detach(), lse.detach(), index.indices, index.counts,
        block_q=index.block_q, block_k=index.block_k, scale=scale, seq_lens=seq_lens, row_max=row_pool == "max",
        document_ids=document_ids,
    )
    target = renormalise(mass)
    return target, mass.sum(dim=-1) > 0


@torch.no_grad()
def triton_dense_block_mass(q: Tensor, k: Tensor, query_blocks: Tensor, *, block_q: int, block_k: int, scale: float,
                            seq_lens: Tensor | None = None, row_pool: str = "max",
                            document_ids: Tensor | None = None, check_values: bool = True) -> tuple[Tensor, Tensor]:
    """Dense causal attention mass of a few query blocks on every key block, through the kernels.

    The index used here gives each query block of ``query_blocks`` every causally reachable key
    block (so its slot t holds key block t) and the other query blocks nothing; the forward kernel
    then yields the rows' dense lse (its output is discarded; empty rows cost nothing) and the
    block-mass kernel the pooled, renormalised mass per slot. Cost: two passes over S query blocks x N
    keys, never an N x N buffer (the PyTorch reference materialises S x G x BQ x N fp32 logits).

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]`` (kernel-supported dtype, head dim and blocks).
        query_blocks: int ``[S]`` distinct query-block ids.
        block_q, block_k, scale, seq_lens, row_pool, document_ids, check_values: as :func:`triton_block_mass`.

    Returns:
        ``target`` float32 ``[B, HKV, S, NKB]`` (each valid row sums to 1 over its causal blocks) and
        ``row_valid`` bool ``[B, HKV, S]``: the semantics of
        :func:`sparse_train.kernels.reference_block_mass.reference_dense_block_mass` with all rows.
    """
    batch, _, seq_len, _ = q.shape
    num_kv_heads = k.shape[1]
    check_document_ids(document_ids, batch, seq_len, q.device, values=check_values)
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
    # One program per (query tile, KV head), no split-KV: the split partials and their merge span all
    # B * HQ * N rows while only the picked query blocks are live (8 of 1024 at 64K); on the H200 that
    # merge took 17.4 ms and the partials several GB (docs/benchmarks/speed_round2/README.md).
    _, lse = sparse_attn_forward(q, k, k, index.indices, index.counts, block_q=block_q, block_k=block_k,
                                 scale=scale, seq_lens=seq_lens, num_splits=1, config=config,
                                 document_ids=document_ids)
    target, row_valid = triton_block_mass(q, k, lse, index, scale=scale, seq_lens=seq_lens, row_pool=row_pool,
                                          document_ids=document_ids, check_values=check_values)
    out = torch.zeros(batch, num_kv_heads, picks.numel(), num_k_blocks, device=q.device, dtype=torch.float32)
    out[..., :capacity] = target[:, :, picks]
    return out, row_valid[:, :, picks]
