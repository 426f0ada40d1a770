"""Triton kernel of the selector's top-k: the dynamic key blocks of every query block, in one pass.

Math, per (batch b, KV head h, query block i) row of the block scores s[j], j < NKB:
    allowed_j = j <= last_i and not (j > last_i - window) and not (j < sinks)   (window, sinks: forced blocks)
    v_j = -inf unless allowed_j;  v_j = EMPTY (-1e30) for allowed blocks at or past seq_lens[b] (no valid key)
    picks = the K largest v_j (ties: lower j first), in block order, then -1 (the row has fewer candidates)

Notation: B batch, HKV KV heads, NQB query blocks (R rows: all of them, or the listed ``query_blocks`` of
context parallelism), NKB key blocks, BQ / BK block sizes, N length, K = ``dynamic_k`` picks per row,
last_i = (min((i + 1) BQ, N) - 1) // BK the last causal key block. NaN scores rank as +inf.

Layers: (1) ``_topk_kernel``, one program per row: the row's NKB scores live in registers; a bitonic top-k of them
as order-preserving int32 (``tl.topk``) gives the K-th largest score, and one prefix count over the row picks every
block above it and the lowest of the blocks equal to it (half the bits in every exchange of the network of a top-k
over scores packed with their block ids into int64 keys); (2) the launcher
``topk_launch``; no autograd (top-k carries no gradient); (3) the launcher as the ``torch.library`` custom op
``sparse_train::selection_topk`` (a fake impl) and :func:`topk_blocks`, which calls it where torch.compile, export or
a dispatch mode needs a graph node (the candidate picks of ``selection/candidates.py``); (4) the public function
``triton_selection_candidates`` (the launcher, which a compiled graph takes as a user-defined Triton kernel).
Its reference is ``sparse_train.selection.scorer.selection_candidates`` (the PyTorch path, which ranks ties in no
fixed order; for distinct scores the two pick the same blocks).

Known limits: NKB <= ``MAX_KEY_BLOCKS`` (one register tile per row); no packed documents and no adaptive
budget (``top_p`` below 1): those stay on the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.scores import EMPTY_BLOCK_SCORE
from ._launch import direct_call

__all__ = ["MAX_KEY_BLOCKS", "topk_blocks", "topk_launch", "triton_selection_candidates"]

MAX_KEY_BLOCKS = 8192
"""Longest score row the kernel holds (8192 key blocks: 512K tokens at BK = 64)."""

_EMPTY_BLOCK_SCORE = tl.constexpr(EMPTY_BLOCK_SCORE)
NEG_INF_ORDERED = tl.constexpr(-(2**31) + 2**23 - 1)  # the sortable int32 of the bits of -inf (kernel's mapping)


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _topk_kernel(
    SCORES,
    SEQ_LENS,
    QUERY_BLOCKS,
    OUT,
    stride_sb,
    stride_sh,
    stride_sr,
    stride_sj,
    N,
    HKV,
    R,
    NKB,
    window,
    sinks,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
):
    r = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // HKV
    h = batch_head % HKV
    if HAS_QUERY_BLOCKS:
        i = tl.load(QUERY_BLOCKS + r).to(tl.int32)
    else:
        i = r
    last = (tl.minimum((i + 1) * BLOCK_Q, N) - 1) // BLOCK_K  # last causal key block
    j = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row = SCORES + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh + r.to(tl.int64) * stride_sr
    values = tl.load(row + j.to(tl.int64) * stride_sj, mask=j < NKB, other=float("-inf")).to(tl.float32)
    values = tl.where(values != values, float("inf"), values)  # NaN ranks first, as in torch.topk
    allowed = (j <= last) & (j <= last - window) & (j >= sinks)  # window 0: every causal block
    values = tl.where(allowed, values, float("-inf"))
    if HAS_SEQ_LENS:
        seq_len = tl.load(SEQ_LENS + b)
        values = tl.where(allowed & (j * BLOCK_K >= seq_len), _EMPTY_BLOCK_SCORE, values)
    # the K-th largest score is the threshold: every block above it is picked, and as many blocks equal to it,
    # lowest first, as fill the K picks (a bitonic top-k of the scores as order-preserving int32, then one
    # prefix count)
    bits = values.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # [BLOCK_N] int32 order of the bits = float order of the scores
    top = tl.topk(ordered, K_POW2)  # [K_POW2], largest first
    t = tl.arange(0, K_POW2)
    threshold = tl.max(tl.where(t == K - 1, top, NEG_INF_ORDERED), axis=0)
    above = ordered > threshold
    tied = (ordered == threshold) & (threshold != NEG_INF_ORDERED)  # -inf: the row ran out of allowed blocks
    tied_rank = tl.cumsum(tied.to(tl.int32), axis=0)  # [BLOCK_N] 1-based rank among the tied blocks
    picked = above | (tied & (tied_rank <= K - tl.sum(above.to(tl.int32), axis=0)))
    slot = tl.cumsum(picked.to(tl.int32), axis=0) - 1  # [BLOCK_N] the picks in block order
    out = OUT + ((b.to(tl.int64) * HKV + h) * R + r) * K
    tl.store(out + slot, j.to(tl.int64), mask=picked)
    filled = tl.sum(picked.to(tl.int32), axis=0)
    tl.store(out + t, tl.full([K_POW2], -1, tl.int64), mask=(t >= filled) & (t < K))


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def topk_warps(block_n: int) -> int:
    """Warps per row: one warp up to 1024 scores (the top-k network's exchanges stay shuffles within the warp,
    no shared memory or barrier), more warps for longer rows (32 keys per thread at most)."""
    return max(1, min(8, block_n // 1024))


def topk_launch(
    scores: Tensor,
    *,
    seq_len: int,
    block_q: int,
    block_k: int,
    k: int,
    window: int,
    sinks: int,
    seq_lens: Tensor | None,
    query_blocks: Tensor | None,
) -> Tensor:
    """int64 ``[B, HKV, R, k]``. No validation: ``seq_lens`` int32 ``[B]`` contiguous, ``query_blocks`` int32
    ``[R]`` contiguous in range, or None; ``window`` 0 means no window (every causal block stays allowed)."""
    B, HKV, R, NKB = scores.shape
    out = torch.empty((B, HKV, R, k), device=scores.device, dtype=torch.int64)
    block_n = triton.next_power_of_2(NKB)
    _topk_kernel[(R, B * HKV)](
        scores,
        out if seq_lens is None else seq_lens,
        out if query_blocks is None else query_blocks,
        out,
        *scores.stride(),
        seq_len,
        HKV,
        R,
        NKB,
        window,
        sinks,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        K=k,
        K_POW2=triton.next_power_of_2(k),
        BLOCK_N=block_n,
        HAS_SEQ_LENS=seq_lens is not None,
        HAS_QUERY_BLOCKS=query_blocks is not None,
        num_warps=topk_warps(block_n),
    )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 3: custom op (no autograd)
# ----------------------------------------------------------------------------------------------
def _selection_topk(
    scores: Tensor,
    seq_lens: Tensor | None,
    query_blocks: Tensor | None,
    seq_len: int,
    block_q: int,
    block_k: int,
    k: int,
    window: int,
    sinks: int,
) -> Tensor:
    """:func:`topk_launch` with positional arguments: the custom op's body and the eager call of
    :func:`topk_blocks`."""
    return topk_launch(
        scores,
        seq_len=seq_len,
        block_q=block_q,
        block_k=block_k,
        k=k,
        window=window,
        sinks=sinks,
        seq_lens=seq_lens,
        query_blocks=query_blocks,
    )


_selection_topk_op = torch.library.custom_op("sparse_train::selection_topk", mutates_args=())(_selection_topk)


@_selection_topk_op.register_fake
def _(scores, seq_lens, query_blocks, seq_len, block_q, block_k, k, window, sinks):
    B, HKV, R, _ = scores.shape
    return scores.new_empty((B, HKV, R, k), dtype=torch.int64)


def topk_blocks(
    scores: Tensor,
    *,
    seq_len: int,
    block_q: int,
    block_k: int,
    k: int,
    window: int,
    sinks: int,
    seq_lens: Tensor | None,
    query_blocks: Tensor | None,
) -> Tensor:
    """:func:`topk_launch` (arguments, returns; no validation, ``k >= 1``) as the ``torch.library`` custom op
    ``sparse_train::selection_topk`` where torch.compile, export or a dispatch mode needs a graph node, the launcher
    itself for eager calls on plain tensors (``_launch.direct_call``)."""
    call = _selection_topk if direct_call(scores, seq_lens, query_blocks) else torch.ops.sparse_train.selection_topk
    return call(scores, seq_lens, query_blocks, seq_len, block_q, block_k, k, window, sinks)


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_selection_candidates(
    scores: Tensor,
    geometry,
    *,
    window: int,
    sinks: int,
    seq_lens: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """Top-k dynamic key blocks per query block in one kernel; the semantics of
    :func:`sparse_train.selection.scorer.selection_candidates` without documents and ``top_p`` (ties go to the
    lower block).

    Args:
        scores: float ``[B, HKV, R, NKB]`` block logits, any strides (CUDA, or CPU under ``TRITON_INTERPRET=1``);
            R = NQB, or the length of ``query_blocks``. NKB <= :data:`MAX_KEY_BLOCKS`.
        geometry: the call's ``SelectionGeometry`` (N, BQ, BK, NKB and K = ``dynamic_k``).
        window, sinks: the forced blocks (excluded from the picks), ints >= 0.
        seq_lens: optional int ``[B]``: allowed key blocks starting at or past seq_lens[b] rank below every
            other allowed block.
        query_blocks: optional int ``[R]``, the global query-block id of each row (values not checked here:
            the callers build them).

    Returns:
        int64 ``[B, HKV, R, K]``, -1 where a row has fewer than K allowed blocks.

    Raises:
        ValueError: scores not 4-D or with NKB other than the geometry's or above the limit; seq_lens or
            query_blocks of the wrong shape.
    """
    if scores.dim() != 4 or scores.shape[3] != geometry.num_k_blocks:
        raise ValueError(f"scores must be [B, HKV, R, NKB={geometry.num_k_blocks}], got {tuple(scores.shape)}")
    if geometry.num_k_blocks > MAX_KEY_BLOCKS:
        raise ValueError(
            f"the top-k kernel holds rows of at most {MAX_KEY_BLOCKS} key blocks, got {geometry.num_k_blocks}"
        )
    B, HKV, R, _ = scores.shape
    k = geometry.dynamic_k
    if k == 0 or R == 0:
        return torch.full((B, HKV, R, k), -1, device=scores.device, dtype=torch.int64)
    if seq_lens is not None:
        if seq_lens.shape != (B,):
            raise ValueError(f"seq_lens must be [B] = [{B}], got {tuple(seq_lens.shape)}")
        seq_lens = seq_lens.to(device=scores.device, dtype=torch.int32).contiguous()
    if query_blocks is not None:
        if query_blocks.shape != (R,):
            raise ValueError(f"query_blocks must list the {R} rows of scores, got {tuple(query_blocks.shape)}")
        query_blocks = query_blocks.to(device=scores.device, dtype=torch.int32).contiguous()
    return topk_launch(
        scores.detach(),
        seq_len=geometry.seq_len,
        block_q=geometry.block_q,
        block_k=geometry.block_k,
        k=k,
        window=window,
        sinks=sinks,
        seq_lens=seq_lens,
        query_blocks=query_blocks,
    )
