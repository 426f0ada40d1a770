"""Selection quality on sampled query blocks: attention-mass recall per query row.

For a query row r (one query position of one query head) the *attention-mass recall* is the share of
r's dense causal attention that falls inside the key blocks its query block selected::

    recall[r] = sum over selected blocks j of  sum_{key in block j} P_dense[r, key]      (in [0, 1])

1.0 means the sparse attention of that row equals the dense one; a row that needs one key the
selection misses scores low even when the rest of its block is served well. Reported over all real
rows (and query heads) of a few sampled query blocks: the mean and the 5th percentile (the rows that
lose the most, which averages hide).

Each sampled block costs one dense row-block of attention (``O(G * BQ * N * D)``), under
``no_grad`` on detached inputs, so measuring 8 blocks at 64K stays cheap.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..index import BlockIndex
from .distill import dense_row_block_mass

__all__ = ["selection_quality", "sample_query_blocks", "row_mass_recall", "needle_block_recall", "RECALL_QUANTILE"]

RECALL_QUANTILE = 0.05
"""The low quantile of per-row recall that is reported next to the mean (``mass_recall_p5``)."""


def sample_query_blocks(num_q_blocks: int, count: int, generator: torch.Generator | None = None) -> Tensor:
    """int64 ``[min(count, NQB)]`` distinct query-block ids, sorted (drawn on the CPU generator given)."""
    count = min(count, num_q_blocks)
    picked = torch.randperm(num_q_blocks, generator=generator)[:count]
    return torch.sort(picked).values


@torch.no_grad()
def row_mass_recall(
    q: Tensor,
    k: Tensor,
    index: BlockIndex,
    *,
    scale: float,
    query_blocks: Tensor,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention-mass recall of every real query row of the sampled blocks, for the index and for the
    best selection of the same size.

    The *oracle* selection takes, per (batch, KV head, query block), as many key blocks as the index
    selected, choosing those with the largest mean row mass (which maximises the mean recall of the
    block's rows): what a perfect selector could reach with this budget. Comparing both tells whether
    the selector or the budget (top_k, window, sinks) limits the recall.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]``; index: the selection to grade.
        scale: logit scale. query_blocks: int64 ``[S]`` query blocks to measure.
        seq_lens: optional int ``[B]`` (rows and keys past it are not real).
        document_ids: optional int ``[B, N]`` (packed documents): the dense attention each row is
            graded against sees its own document only.

    Returns:
        float32 ``[R]`` recall of each real row (rows of all batches, heads and sampled blocks) under
        the index, and ``[R]`` under the oracle selection.
    """
    query_blocks = query_blocks.to(q.device)
    row_mass, row_ok = dense_row_block_mass(
        q, k, block_q=index.block_q, block_k=index.block_k, scale=scale, seq_lens=seq_lens,
        query_blocks=query_blocks, document_ids=document_ids,
    )  # [B, HKV, S, G*BQ, NKB], [B, HKV, S, G*BQ]
    selected = index.to_dense()[:, :, query_blocks]  # [B, HKV, S, NKB]
    recall = torch.where(selected.unsqueeze(3), row_mass, 0.0).sum(dim=-1)
    block_mass = torch.where(row_ok.unsqueeze(-1), row_mass, 0.0).sum(dim=3)  # [B, HKV, S, NKB]
    order = torch.argsort(block_mass, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=q.device).expand_as(order))
    oracle = rank < selected.sum(dim=-1, keepdim=True)
    oracle_recall = torch.where(oracle.unsqueeze(3), row_mass, 0.0).sum(dim=-1)
    return recall[row_ok], oracle_recall[row_ok]


@torch.no_grad()
def needle_block_recall(index: BlockIndex, pairs: Tensor) -> Tensor:
    """Share of (question, needle) pairs whose needle's key block the question's query block selected.

    For retrieval evaluations where the position of what a query row must read is known.

    Args:
        index: the selection of the forward that answered.
        pairs: int64 ``[M, 3]`` rows ``(sample b, query position, needle position)``.

    Returns:
        float32 ``[HKV]`` recall per KV head (NaN for M = 0).
    """
    pairs = pairs.to(index.device)
    batch, query_pos, needle_pos = pairs.unbind(dim=1)
    dense = index.to_dense()  # [B, HKV, NQB, NKB]
    hit = dense[batch, :, query_pos // index.block_q, needle_pos // index.block_k]  # [M, HKV]
    return hit.to(torch.float32).mean(dim=0)


@torch.no_grad()
def selection_quality(
    q: Tensor,
    k: Tensor,
    index: BlockIndex,
    *,
    scale: float,
    query_blocks: Tensor,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Mean and 5th percentile of the per-row attention-mass recall (:func:`row_mass_recall`), for
    the index and for the oracle selection of the same size.

    Returns:
        ``{"mass_recall_mean", "mass_recall_p5", "oracle_mass_recall_mean", "oracle_mass_recall_p5"}``
        scalar float32 tensors on q's device (NaN when no sampled row holds a real query).
    """
    recall, oracle = row_mass_recall(q, k, index, scale=scale, query_blocks=query_blocks, seq_lens=seq_lens,
                                     document_ids=document_ids)
    out = {}
    for prefix, values in (("", recall), ("oracle_", oracle)):
        if values.numel() == 0:
            out[f"{prefix}mass_recall_mean"] = out[f"{prefix}mass_recall_p5"] = torch.full((), float("nan"), device=q.device)
        else:
            out[f"{prefix}mass_recall_mean"] = values.mean()
            out[f"{prefix}mass_recall_p5"] = torch.quantile(values, RECALL_QUANTILE)
    return out
