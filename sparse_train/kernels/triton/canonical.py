"""Triton kernel of the block index's canonical merge: top-k picks, window and sinks in one pass per row.

Math, per (batch, KV head, query block i) row with last_i = (min((i + 1) BQ, N) - 1) // BK:
    C = {picks c : 0 <= c <= last_i} u {max(0, last_i - window + 1) .. last_i} u {0 .. min(sinks, last_i + 1) - 1}
    indices = the distinct blocks of C in increasing order, the lowest ``capacity`` of them, then -1
    count = min(|C|, capacity)

Notation: B batch, HKV KV heads, NQB query blocks, NKB key blocks, k picks per row (-1 = unused), BQ / BK block
sizes, N length, CP = next power of two of k + window + sinks candidate slots, CAP = ``capacity``.

Layers: (1) ``_canonical_kernel``, one program per row: no sort; each candidate's first occurrence and its rank
among the distinct candidates come from [CP, CP] comparisons, and output slot p takes the candidate of rank p;
(2) the launcher ``canonical_launch``; no autograd (indices are integers); (4) the public function
``triton_canonical_merge``. The reference is ``sparse_train.index.block_index.canonicalize`` (its ``check="none"`` path
without documents), the one owner of the invariants; tests compare the two exactly.

Known limits: no packed documents (``document_ids``: the PyTorch path), a given capacity; candidates outside
``[0, last_i]`` are dropped (``check="none"``: validation, where asked for, runs before, in PyTorch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["canonical_launch", "triton_canonical_merge"]


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _canonical_kernel(
    PICKS,
    INDICES,
    COUNTS,
    stride_pb,
    stride_ph,
    stride_pr,
    stride_pk,
    N,
    HKV,
    NQB,
    NKB,
    window,
    sinks,
    capacity,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K: tl.constexpr,
    CP: tl.constexpr,
    CAP_POW2: tl.constexpr,
):
    i = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // HKV
    h = batch_head % HKV
    last = (tl.minimum((i + 1) * BLOCK_Q, N) - 1) // BLOCK_K
    c = tl.arange(0, CP)  # candidate slot: picks, then window, then sinks
    picks_row = PICKS + b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph + i.to(tl.int64) * stride_pr
    pick = tl.load(picks_row + c.to(tl.int64) * stride_pk, mask=c < K, other=-1)  # [CP], the picks' dtype
    pick = tl.where((pick >= 0) & (pick < NKB), pick, -1).to(tl.int32)  # range test before narrowing: no wrap
    window_block = last - window + 1 + (c - K)
    sink_block = c - K - window
    forced = tl.where(c < K + window, window_block, tl.where(c < K + window + sinks, sink_block, -1))
    block = tl.where(c < K, pick, forced)
    live = (block >= 0) & (block <= last) & (block < NKB)  # [CP]
    block = tl.where(live, block, NKB)
    same_before = (block[:, None] == block[None, :]) & (c[None, :] < c[:, None])  # [CP, CP]: (slot, earlier slot)
    first = live & (tl.sum(same_before.to(tl.int32), axis=1) == 0)  # [CP] first slot holding its block
    below = first[None, :] & (block[None, :] < block[:, None])  # [CP, CP]: distinct blocks below each slot's
    rank = tl.sum(below.to(tl.int32), axis=1)  # [CP]
    p = tl.arange(0, CAP_POW2)
    takes = first[None, :] & (rank[None, :] == p[:, None])  # [CAP_POW2, CP]: slot holding the p-th block
    out = tl.max(tl.where(takes, block[None, :], -1), axis=1)  # [CAP_POW2]
    row = (b.to(tl.int64) * HKV + h) * NQB + i
    tl.store(INDICES + row * capacity + p, out, mask=p < capacity)
    tl.store(COUNTS + row, tl.minimum(tl.sum(first.to(tl.int32), axis=0), capacity))


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def canonical_launch(
    picks: Tensor, *, seq_len: int, block_q: int, block_k: int, window: int, sinks: int, capacity: int
) -> tuple[Tensor, Tensor]:
    """int32 ``indices [B, HKV, NQB, capacity]`` and ``counts [B, HKV, NQB]``, contiguous. No validation:
    ``picks`` integer ``[B, HKV, NQB, k]`` (any strides), window / sinks <= NKB, capacity in [1, NKB]."""
    B, HKV, NQB, k = picks.shape
    num_k_blocks = -(-seq_len // block_k)
    indices = torch.empty((B, HKV, NQB, capacity), device=picks.device, dtype=torch.int32)
    counts = torch.empty((B, HKV, NQB), device=picks.device, dtype=torch.int32)
    if B * HKV * NQB == 0:
        return indices, counts
    _canonical_kernel[(NQB, B * HKV)](
        picks,
        indices,
        counts,
        *picks.stride(),
        seq_len,
        HKV,
        NQB,
        num_k_blocks,
        window,
        sinks,
        capacity,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        K=k,
        CP=triton.next_power_of_2(max(1, k + window + sinks)),
        CAP_POW2=triton.next_power_of_2(capacity),
        num_warps=1,
    )
    return indices, counts


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_canonical_merge(
    picks: Tensor, *, seq_len: int, block_q: int, block_k: int, window: int, sinks: int, capacity: int
) -> tuple[Tensor, Tensor]:
    """Canonical ``(indices, counts)`` of ``picks`` plus window and sinks in one kernel: what
    ``sparse_train.index.block_index.canonicalize(picks, ..., capacity=capacity, check="none")`` returns (without
    documents).

    Args:
        picks: integer ``[B, HKV, NQB, k]`` candidate key blocks, -1 (or any value outside the causal range)
            for none; CUDA, or CPU under ``TRITON_INTERPRET=1``.
        seq_len, block_q, block_k: N, BQ, BK (checked by the caller, ``canonicalize``).
        window, sinks: forced blocks per row (ints >= 0; values above NKB mean NKB).
        capacity: K of the result, in [1, NKB]; longer rows keep their lowest ``capacity`` blocks.

    Returns:
        int32 ``indices [B, HKV, NQB, capacity]`` (-1 padded), int32 ``counts [B, HKV, NQB]``.
    """
    num_k_blocks = -(-seq_len // block_k)
    return canonical_launch(
        picks,
        seq_len=seq_len,
        block_q=block_q,
        block_k=block_k,
        window=min(window, num_k_blocks),
        sinks=min(sinks, num_k_blocks),
        capacity=capacity,
    )
