"""Distillation targets for the selector and the KL loss that pulls the selector toward them.

Target: the attention mass each query row puts on each key block, pooled over the query block's rows
and the GQA group's query heads, renormalised over the key blocks::

    m[b, g, r, j] = sum_{key in block j} P[b, g, r, key]                  (row r's mass on block j)
    T[b, h, i, j] = pool over rows r of block i, heads g of group h of m[b, g, r, j], / sum over j

``row_pool="max"`` (default) keeps, for every key block, the largest share any row of the query
block gives it: a block one row needs badly ranks high even when the other 63 rows ignore it (the
question rows of a retrieval task; measured: top-4 needle-block recall of the target 0.94 with max
against 0.45 with the mean on a trained dense model). ``row_pool="mean"`` is the block's average
mass (what the attention of the whole block spends there), kept for comparison.

Two targets, each computed by the Triton kernels (``kernels/triton/block_mass.py``) where they run and by
their PyTorch reference (``kernels/reference/block_mass.py``) otherwise; the choice is
:func:`sparse_train.functional.choose_backend`, the same that routes the attention itself:

* :func:`sparse_block_mass` ("sparse" stage): only the *selected* blocks of a ``BlockIndex``; P is
  the main attention's own softmax over the selected set, ``exp(scale * q.k - lse)`` with the lse the
  kernel returned (or recomputed over the selected set when none is given), so the target sums to 1
  over the selected blocks. Cost: one pass of QK^T over the selected blocks; never an N x N matrix.
* :func:`dense_block_mass` ("dense" warm-up, "sampled" target, and the oracle of the quality
  metrics): every causal block, exact (N x N work for all query blocks, bounded memory).

All target computations run under ``no_grad`` on detached q/k: the main model never receives
gradients from the selector's objective. Shapes: q ``[B, HQ, N, D]``, k ``[B, HKV, N, D]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional import choose_backend
from ..index.block_index import BlockIndex
from ..kernels import triton_kernels
from ..kernels.reference.block_mass import (
    ROW_POOLS,
    dense_row_block_mass,
    pool_rows,
    query_row_positions,
    reference_dense_block_mass,
    reference_sparse_block_mass,
    renormalise,
)
from ..validation import check_choice

__all__ = [
    "query_row_positions",
    "pool_rows",
    "renormalise",
    "sparse_block_mass",
    "dense_block_mass",
    "dense_row_block_mass",
    "block_kl",
    "block_kl_sum",
]


def _kernels_run(q: Tensor, block_q: int, block_k: int, rows_per_block: int | None) -> bool:
    """The block-mass kernels run where the attention kernels run, on all rows of each block."""
    all_rows = rows_per_block is None or rows_per_block >= block_q
    return all_rows and choose_backend(q, block_q, block_k)[0] == "triton"


@torch.no_grad()
def sparse_block_mass(
    q: Tensor,
    k: Tensor,
    index: BlockIndex,
    *,
    scale: float,
    lse: Tensor | None = None,
    seq_lens: Tensor | None = None,
    rows_per_block: int | None = None,
    row_pool: str = "max",
    chunk_mb: int = 1024,
    document_ids: Tensor | None = None,
    check_values: bool = True,
) -> tuple[Tensor, Tensor]:
    """Attention mass on each *selected* block, pooled over rows, renormalised over the selected set:
    :func:`~sparse_train.kernels.triton.block_mass.triton_block_mass` when ``lse`` is given, all rows are
    used and the kernels support the input; its reference
    :func:`~sparse_train.kernels.reference.block_mass.reference_sparse_block_mass` (arguments, returns;
    ``document_ids`` masks keys of other documents, in both) otherwise. ``check_values=False`` skips the
    value checks of ``seq_lens`` / ``document_ids`` (host syncs on CUDA; ``sparse_train.sparse_attention``)."""
    check_choice("row_pool", row_pool, ROW_POOLS)
    if lse is not None and _kernels_run(q, index.block_q, index.block_k, rows_per_block):
        return triton_kernels().block_mass.triton_block_mass(
            q.detach(),
            k.detach(),
            lse,
            index,
            scale=scale,
            seq_lens=seq_lens,
            row_pool=row_pool,
            document_ids=document_ids,
            check_values=check_values,
        )
    return reference_sparse_block_mass(
        q,
        k,
        index,
        scale=scale,
        lse=lse,
        seq_lens=seq_lens,
        rows_per_block=rows_per_block,
        row_pool=row_pool,
        chunk_mb=chunk_mb,
        document_ids=document_ids,
        check_values=check_values,
    )


@torch.no_grad()
def dense_block_mass(
    q: Tensor,
    k: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    seq_lens: Tensor | None = None,
    rows_per_block: int | None = None,
    query_blocks: Tensor | None = None,
    row_pool: str = "max",
    chunk_mb: int = 256,
    document_ids: Tensor | None = None,
    check_values: bool = True,
) -> tuple[Tensor, Tensor]:
    """Exact attention mass of dense causal attention on every key block, pooled over rows:
    :func:`~sparse_train.kernels.triton.block_mass.triton_dense_block_mass` when all rows are used and the
    kernels support the input (``query_blocks=None`` = every query block: one kernel pass over the
    causal area, in groups of query blocks of bounded memory, no N x N buffer); its reference
    :func:`~sparse_train.kernels.reference.block_mass.reference_dense_block_mass` (arguments,
    returns; ``document_ids`` masks keys of other documents, in both) otherwise. ``check_values`` as
    :func:`sparse_block_mass`."""
    check_choice("row_pool", row_pool, ROW_POOLS)
    if _kernels_run(q, block_q, block_k, rows_per_block):
        triton_dense_block_mass = triton_kernels().block_mass.triton_dense_block_mass
        if query_blocks is None:
            query_blocks = torch.arange(-(-q.shape[2] // block_q), device=q.device)
        return triton_dense_block_mass(
            q.detach(),
            k.detach(),
            query_blocks,
            block_q=block_q,
            block_k=block_k,
            scale=scale,
            seq_lens=seq_lens,
            row_pool=row_pool,
            document_ids=document_ids,
            check_values=check_values,
        )
    return reference_dense_block_mass(
        q,
        k,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        seq_lens=seq_lens,
        rows_per_block=rows_per_block,
        query_blocks=query_blocks,
        row_pool=row_pool,
        chunk_mb=chunk_mb,
        document_ids=document_ids,
        check_values=check_values,
    )


def block_kl(target: Tensor, logits: Tensor, allowed: Tensor, row_valid: Tensor) -> Tensor:
    """Mean over valid rows of ``KL(target || softmax(logits over allowed))``.

    Args:
        target: float ``[..., M]``, zero outside ``allowed``, each valid row summing to 1 (no grad).
        logits: selector logits ``[..., M]`` (the only input with gradients).
        allowed: bool ``[..., M]`` (broadcastable): the support of the selector distribution.
        row_valid: bool ``[...]``: rows that enter the mean.

    Returns:
        Scalar float32 tensor (0 when no row is valid). Rows with nothing allowed never produce NaN
        values or NaN gradients.
    """
    total, rows = block_kl_sum(target, logits, allowed, row_valid)
    return total / rows.clamp(min=1).to(total.dtype)


def block_kl_sum(target: Tensor, logits: Tensor, allowed: Tensor, row_valid: Tensor) -> tuple[Tensor, Tensor]:
    """The parts of :func:`block_kl`: the SUM over valid rows of the KL (scalar float32, with
    gradients to ``logits``) and the number of valid rows (int64 scalar). Context parallelism adds the
    counts of every rank and divides each rank's sum by the total, so the ranks' losses (and their
    gradients) sum to the single-process mean."""
    allowed = allowed.expand_as(logits)
    any_allowed = allowed.any(dim=-1, keepdim=True)
    # A row without any allowed entry would be all -inf (NaN softmax); it is excluded anyway, so it
    # keeps finite logits to keep NaN out of the backward.
    masked = logits.masked_fill(~allowed & any_allowed, float("-inf"))
    log_p = torch.log_softmax(masked, dim=-1)
    positive = (target > 0) & allowed
    safe_target = torch.where(positive, target, 1.0)
    safe_log_p = torch.where(positive, log_p, 0.0)
    terms = torch.where(positive, target * (torch.log(safe_target) - safe_log_p), 0.0)
    per_row = terms.sum(dim=-1)
    valid = row_valid & any_allowed.squeeze(-1)
    per_row = torch.where(valid, per_row, 0.0)
    return per_row.sum(), valid.sum()
