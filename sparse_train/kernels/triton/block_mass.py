"""Triton kernel of the selector's distillation target: attention mass per selected key block.

Math, per query block i of KV head h and selected slot t holding key block j (P from the forward's lse):
    m[g, r, t] = sum over valid keys k of block j of exp(scale <Q[g, r], K[k]> - lse[g, r])
    M[i, t] = max (ROW_MAX) or sum over the live rows r of block i and the heads g of group h of m[g, r, t]
    target[i, t] = M[i, t] / sum_t' M[i, t']     (renormalised over the selected set; 0 without mass)
Sampled dense target (every causal block j of a few query blocks): per row, per block, the base-2 log of the
unnormalised mass L[g, r, j] = log2 sum_k 2^(scale_log2 <Q[g, r], K[k]>); lse[g, r] = logsumexp_j L; then
m[g, r, j] = 2^(L[g, r, j] - lse2[g, r]) pooled and renormalised as above (no forward pass needed).

Notation: as in forward.py (B, HQ, HKV, GROUP, N, HEAD_DIM = D, BLOCK_Q / BLOCK_K, NQB, K capacity,
HEADS_PER_PROGRAM heads stacked into M = HEADS_PER_PROGRAM * BQ rows, HEAD_SUBSETS per group). A row is
live when it is a real query (q < N and q < seq_lens[b]) with a finite lse; a key is valid when k <= q,
k < seq_lens[b] and, with packed documents (HAS_DOCS), doc[b, k] == doc[b, q]. The reference is
kernels/reference/block_mass.py (any rows_per_block).

Layers: (1) ``@triton.jit`` kernels ``_block_mass_kernel`` (one QK^T tile product per (query tile,
selected block), no softmax state: the forward's lse already normalises every row) and
``_row_log_mass_kernel`` (one QK^T tile product per (query tile of a sampled block, causal key block); a
program walks one chunk of the key blocks, so a long row is spread over many programs); (2) the
launchers ``block_mass_launch`` and ``row_log_mass_launch``; no autograd op (the target is a constant of
the selector's loss); (4) the public functions ``triton_block_mass`` (selected blocks) and
``triton_dense_block_mass`` (every causal block of a few query blocks). Tile configuration:
sparse_train/plan/plan.py.

Known limits: the forward kernel's dtypes, head dims and block sizes; all rows of each block are used
(no row subsampling); float32 output, no gradient. The sampled dense target holds a float32
``[B, HQ, S', NKB, BQ]`` buffer of per-row log masses (S' sampled blocks at a time, sized to
``DENSE_TARGET_BUFFER_BYTES``): 67 MB for 8 blocks at 64K with 32 query heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...index.block_index import check_inputs
from ...plan.tuning import block_mass_config, row_log_mass_chunk
from ...validation import (
    check_choice,
    check_document_ids,
    check_geometry,
    check_integer_tensor,
    check_qkv,
    check_scale,
    check_seq_lens,
)
from ..reference.block_mass import ROW_POOLS, renormalise
from ._jit import (
    LN2,
    LOG2E,
    documents_row,
    dot,
    index_row,
    load_documents,
    load_rows,
    query_tile,
    sequence_length,
    tile_pointers,
    tile_rows,
)
from ._launch import kernel_document_ids, kernel_seq_lens, launch
from .op import triton_supports

__all__ = [
    "DENSE_TARGET_BUFFER_BYTES",
    "block_mass_launch",
    "pool_row_log_mass",
    "row_log_mass_launch",
    "triton_block_mass",
    "triton_dense_block_mass",
]

DENSE_TARGET_BUFFER_BYTES = 256 * 2**20
"""Largest per-row log-mass buffer of :func:`triton_dense_block_mass`; more sampled query blocks than fit
are processed in groups (fixed shapes, no host read), so ``distill="dense"`` stays bounded in memory."""


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _block_mass_kernel(
    Q,
    K,
    LSE,
    INDICES,
    COUNTS,
    SEQ_LENS,
    DOCS,
    OUT,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
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
    CAPACITY,
    scale_log2,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    IEEE: tl.constexpr,
    ROW_MAX: tl.constexpr,
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

    selected, count = index_row(
        INDICES, COUNTS, b64, hkv64, qb.to(tl.int64), stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq
    )
    k_base = K + b64 * stride_kb + hkv64 * stride_kh
    head_subset = tl.program_id(0) % HEAD_SUBSETS
    out_row = OUT + ((tl.program_id(1).to(tl.int64) * HEAD_SUBSETS + head_subset) * NQB + qb) * CAPACITY
    for t in range(0, count):
        j = tl.load(selected + t * stride_ik)  # t-th selected key block
        kpos = j * BLOCK_K + offs_k  # [BK]
        key_in = kpos < seqlen
        k = tl.load(
            tile_pointers(k_base, kpos.to(tl.int64), offs_d, stride_kn, stride_kd), mask=key_in[:, None], other=0.0
        )  # [BK, D]
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


@triton.jit
def _row_log_mass_kernel(
    Q,
    K,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    OUT,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    N,
    HQ,
    HKV,
    NKB,
    NUM_SAMPLED,
    BLOCKS_PER_CHUNK,
    scale_log2,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    HEAD_SUBSETS: tl.constexpr = GROUP // HEADS_PER_PROGRAM
    scale_log2 = tl.cast(scale_log2, tl.float32)
    chunk = tl.program_id(0)
    sample = tl.program_id(1) // HEAD_SUBSETS
    head_subset = tl.program_id(1) % HEAD_SUBSETS
    b = tl.program_id(2) // HKV
    hkv = tl.program_id(2) % HKV
    qb = tl.load(QUERY_BLOCKS + sample)
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    if HAS_SEQ_LENS:
        seqlen = tl.minimum(seqlen, N)
    # the last key block any row of this query block can see (the launcher's buffer holds -inf past it)
    last_block = (tl.minimum(tl.minimum((qb + 1) * BLOCK_Q, seqlen), N) - 1) // BLOCK_K
    first = chunk * BLOCKS_PER_CHUNK
    if first <= last_block:
        head, qpos = tile_rows(qb, hkv, head_subset, GROUP, HEADS_PER_PROGRAM, BLOCK_Q)  # [M]
        b64, head64, qpos64 = b.to(tl.int64), head.to(tl.int64), qpos.to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_k = tl.arange(0, BLOCK_K)
        row_real = qpos < seqlen
        q = load_rows(Q, b64, head64, qpos64, offs_d, stride_qb, stride_qh, stride_qn, stride_qd, row_real)  # [M, D]
        if HAS_DOCS:
            docs_row = documents_row(DOCS, b64, N)
            doc_q = load_documents(docs_row, qpos, N)  # [M]
        k_base = K + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
        # OUT [B, HQ, S, NKB, BQ]: the BQ rows of one (head, key block) are adjacent, so each store is coalesced
        out_rows = OUT + (((b64 * HQ + head64) * NUM_SAMPLED + sample) * NKB) * BLOCK_Q + (qpos - qb * BLOCK_Q)  # [M]
        for j in range(first, tl.minimum(first + BLOCKS_PER_CHUNK, last_block + 1)):
            kpos = j * BLOCK_K + offs_k  # [BK]
            key_in = kpos < seqlen
            k = tl.load(
                tile_pointers(k_base, kpos.to(tl.int64), offs_d, stride_kn, stride_kd), mask=key_in[:, None], other=0.0
            )  # [BK, D]
            s = dot(q, tl.trans(k), IEEE) * scale_log2  # [M, BK]
            ok = (kpos[None, :] <= qpos[:, None]) & key_in[None, :]
            if HAS_DOCS:
                ok = ok & (doc_q[:, None] == load_documents(docs_row, kpos, N)[None, :])
            s = tl.where(ok, s, float("-inf"))
            row_max = tl.max(s, 1)  # [M]
            seen = row_max > float("-inf")
            shift = tl.where(seen, row_max, 0.0)
            total = tl.sum(tl.exp2(s - shift[:, None]), 1)  # [M]; >= 1 where seen
            log_mass = tl.where(seen, shift + tl.log2(total), float("-inf"))
            tl.store(out_rows + j * BLOCK_Q, log_mass, mask=row_real)  # j * BQ < N: int32 is safe


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def block_mass_launch(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    indices: Tensor,
    counts: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    seq_lens: Tensor | None = None,
    row_max: bool = True,
    document_ids: Tensor | None = None,
) -> Tensor:
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
        _block_mass_kernel,
        (NQB * head_subsets, B * HKV),
        q,
        k,
        lse,
        indices,
        counts,
        kernel_seq_lens(seq_lens, N, counts),
        kernel_document_ids(document_ids, counts),
        out,
        *q.stride(),
        *k.stride(),
        *lse.stride(),
        *indices.stride(),
        *counts.stride(),
        N,
        HKV,
        NQB,
        capacity,
        float(scale * LOG2E.value),
        GROUP=group,
        HEADS_PER_PROGRAM=config.heads_per_program,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=D,
        HAS_SEQ_LENS=seq_lens is not None,
        IEEE=q.dtype == torch.float32,
        ROW_MAX=row_max,
        HAS_DOCS=document_ids is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out.amax(dim=2) if row_max else out.sum(dim=2)


def row_log_mass_launch(
    q: Tensor,
    k: Tensor,
    query_blocks: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Base-2 log of each row's unnormalised mass on each key block, float32 ``[B, HQ, S, NKB, BQ]``
    (row r of sampled block s at ``[..., s, :, r]``; -inf where the row sees no key of the block, for
    dead rows and past the last causal block). No validation; ``query_blocks`` int32 ``[S]`` in range,
    seq_lens and document_ids made kernel arguments (``kernel_seq_lens``, ``kernel_document_ids``)."""
    B, HQ, N, D = q.shape
    HKV = k.shape[1]
    group = HQ // HKV
    num_sampled = query_blocks.numel()
    num_k_blocks = -(-N // block_k)
    config = block_mass_config(group, block_q)
    head_subsets = group // config.heads_per_program
    per_chunk = row_log_mass_chunk(num_k_blocks, num_sampled * head_subsets * B * HKV, q.device)
    out = torch.full((B, HQ, num_sampled, num_k_blocks, block_q), float("-inf"), device=q.device, dtype=torch.float32)
    launch(
        _row_log_mass_kernel,
        (-(-num_k_blocks // per_chunk), num_sampled * head_subsets, B * HKV),
        q,
        k,
        query_blocks,
        kernel_seq_lens(seq_lens, N, query_blocks),
        kernel_document_ids(document_ids, query_blocks),
        out,
        *q.stride(),
        *k.stride(),
        N,
        HQ,
        HKV,
        num_k_blocks,
        num_sampled,
        per_chunk,
        float(scale * LOG2E.value),
        GROUP=group,
        HEADS_PER_PROGRAM=config.heads_per_program,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=D,
        HAS_SEQ_LENS=seq_lens is not None,
        IEEE=q.dtype == torch.float32,
        HAS_DOCS=document_ids is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 4: public functions (no autograd: the target is a constant)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_block_mass(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    index,
    *,
    scale: float,
    seq_lens: Tensor | None = None,
    row_pool: str = "max",
    document_ids: Tensor | None = None,
    check_values: bool = True,
) -> tuple[Tensor, Tensor]:
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
            f"lse must be float32 {tuple(q.shape[:3])} on {q.device}, got {lse.dtype} {tuple(lse.shape)} on "
            f"{lse.device}"
        )
    mass = block_mass_launch(
        q.detach(),
        k.detach(),
        lse.detach(),
        index.indices,
        index.counts,
        block_q=index.block_q,
        block_k=index.block_k,
        scale=scale,
        seq_lens=seq_lens,
        row_max=row_pool == "max",
        document_ids=document_ids,
    )
    target = renormalise(mass)
    return target, mass.sum(dim=-1) > 0


def pool_row_log_mass(log_mass: Tensor, num_kv_heads: int, row_pool: str) -> tuple[Tensor, Tensor]:
    """``[B, HQ, S, NKB, BQ]`` base-2 row log masses (:func:`row_log_mass_launch`) -> the renormalised
    target float32 ``[B, HKV, S, NKB]`` and ``row_valid`` bool ``[B, HKV, S]``: each row normalised by
    its own log-sum-exp over the key blocks, then pooled over the rows and the group's heads."""
    batch, num_heads, num_sampled, num_k_blocks, block_q = log_mass.shape
    lse2 = torch.logsumexp(log_mass * LN2.value, dim=3, keepdim=True) * LOG2E.value  # [B, HQ, S, 1, BQ]
    live = lse2 > float("-inf")
    # selection, not multiplication: a dead row's -inf - -inf is NaN
    mass = torch.where(live, torch.exp2(log_mass - torch.where(live, lse2, 0.0)), 0.0)
    mass = mass.view(batch, num_kv_heads, num_heads // num_kv_heads, num_sampled, num_k_blocks, block_q)
    pooled = mass.amax(dim=(2, 5)) if row_pool == "max" else mass.sum(dim=(2, 5))
    row_valid = live.view(batch, num_kv_heads, -1, num_sampled, block_q).any(dim=4).any(dim=2)
    return renormalise(pooled), row_valid


@torch.no_grad()
def triton_dense_block_mass(
    q: Tensor,
    k: Tensor,
    query_blocks: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    seq_lens: Tensor | None = None,
    row_pool: str = "max",
    document_ids: Tensor | None = None,
    check_values: bool = True,
) -> tuple[Tensor, Tensor]:
    """Dense causal attention mass of a few query blocks on every key block, through the kernels.

    One kernel pass over the sampled blocks' causal area (``_row_log_mass_kernel``: each row's log mass
    per key block, the long rows of late query blocks split over many programs), then a few PyTorch
    reductions (each row's log-sum-exp over its blocks, the pooling). No forward pass and no N x N
    buffer; the per-row buffer is ``[B, HQ, S', NKB, BQ]`` float32 with S' sampled blocks at a time.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]`` (kernel-supported dtype, head dim and blocks).
        query_blocks: int ``[S]`` query-block ids in ``[0, NQB)`` (repeats allowed: each gets its row).
        block_q, block_k, scale, seq_lens, row_pool, document_ids, check_values: as :func:`triton_block_mass`
            (``check_values`` also checks the range of ``query_blocks``: one host sync on CUDA; unchecked
            ids are clamped into range on the device).

    Returns:
        ``target`` float32 ``[B, HKV, S, NKB]`` (each valid row sums to 1 over its causal blocks) and
        ``row_valid`` bool ``[B, HKV, S]``: the semantics of
        :func:`sparse_train.kernels.reference.block_mass.reference_dense_block_mass` with all rows.

    Raises:
        ValueError: bad q/k shapes or dtypes, an input the kernels do not support (device, dtype, head dim,
            block sizes), scale, seq_lens, document_ids, row_pool, or a ``query_blocks`` that is not a 1-D
            integer tensor (or, with ``check_values``, out of range).
    """
    check_choice("row_pool", row_pool, ROW_POOLS)
    batch, _, num_kv_heads, seq_len, head_dim = check_qkv(q, k, k)
    check_geometry(seq_len, block_q, block_k)
    support = triton_supports(q, block_q, block_k)
    if not support.ok:  # a clear error, not a compile failure inside the kernel
        raise ValueError(f"triton_dense_block_mass cannot run this input: {support.message}")
    check_seq_lens(seq_lens, batch, seq_len, q.device, values=check_values)
    check_document_ids(document_ids, batch, seq_len, q.device, values=check_values)
    scale = check_scale(scale, head_dim)
    picks = check_integer_tensor("query_blocks", query_blocks, dim=1).to(device=q.device, dtype=torch.int32)
    num_q_blocks = -(-seq_len // block_q)
    if check_values and not torch.compiler.is_compiling() and bool(((picks < 0) | (picks >= num_q_blocks)).any()):
        raise ValueError(
            f"query_blocks must lie in [0, {num_q_blocks}) (N={seq_len}, BQ={block_q}), got values in "
            f"[{int(picks.min())}, {int(picks.max())}]"
        )
    # an unchecked id may change which rows are computed, never make the kernel read outside q
    picks = picks.clamp(0, num_q_blocks - 1)
    num_k_blocks = -(-seq_len // block_k)
    row_bytes = batch * q.shape[1] * num_k_blocks * block_q * 4
    per_group = max(1, DENSE_TARGET_BUFFER_BYTES // row_bytes)
    targets, valids = [], []
    for start in range(0, picks.numel(), per_group):
        log_mass = row_log_mass_launch(
            q.detach(),
            k.detach(),
            picks[start : start + per_group].contiguous(),
            block_q=block_q,
            block_k=block_k,
            scale=scale,
            seq_lens=seq_lens,
            document_ids=document_ids,
        )
        target, row_valid = pool_row_log_mass(log_mass, num_kv_heads, row_pool)
        targets.append(target)
        valids.append(row_valid)
    if not targets:
        return (
            q.new_zeros((batch, num_kv_heads, 0, num_k_blocks), dtype=torch.float32),
            torch.zeros((batch, num_kv_heads, 0), dtype=torch.bool, device=q.device),
        )
    return torch.cat(targets, dim=2), torch.cat(valids, dim=2)
