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

import math

import torch
from torch import Tensor

from ..index.block_index import BlockIndex, causal_last_block
from ..kernels import triton_kernels
from ..kernels.reference.attention import philox4x32_10
from ..plan.device import triton_runs_on
from .distill import dense_row_block_mass

__all__ = [
    "selection_quality",
    "sample_query_blocks",
    "draw_query_blocks",
    "row_mass_recall",
    "needle_block_recall",
    "oracle_budget",
    "RECALL_QUANTILE",
    "ORACLE_RECALL_GOAL",
]

RECALL_QUANTILE = 0.05
"""The low quantile of per-row recall that is reported next to the mean (``mass_recall_p5``)."""

ORACLE_RECALL_GOAL = 0.90
"""Mean row recall for which :func:`oracle_budget` reports the density a perfect selector needs."""


def sample_query_blocks(num_q_blocks: int, count: int, generator: torch.Generator | None = None) -> Tensor:
    """int64 ``[min(count, NQB)]`` distinct query-block ids, sorted (drawn on the CPU generator given)."""
    count = min(count, num_q_blocks)
    picked = torch.randperm(num_q_blocks, generator=generator)[:count]
    return torch.sort(picked).values


_DRAW_KEY = 0x5D15_71A7_0000_0001
"""Philox key of :func:`draw_query_blocks` (any fixed value: it only has to differ from nothing else)."""


def _draw_kernel_runs(draw: Tensor) -> bool:
    """The draw kernel (``kernels/triton/draw.py``) takes CUDA draws, eager or compiled, where Triton imports."""
    return triton_runs_on(draw)


def draw_query_blocks(num_q_blocks: int, count: int, draw: Tensor) -> Tensor:
    """int64 ``[min(count, NQB)]`` distinct query-block ids, sorted, on ``draw``'s device: a pure
    function of the draw number ``draw`` (an integer 0-d tensor, e.g. a step counter buffer).

    Every block gets a Philox word of (block, draw) and the ``count`` smallest words win (ties, about
    one in 2**32 per pair, go to the lower block id): a uniform sample without replacement, computed on
    the device from a tensor, so it needs no generator object, reads nothing back to the host and
    traces into a ``torch.compile(fullgraph=True)`` graph or a CUDA graph (the draw number lives on
    the device and the caller advances it there)."""
    count = min(count, num_q_blocks)
    draw = draw.to(torch.int64).view(1)
    if _draw_kernel_runs(draw):  # the same words in one launch instead of ~250 small ones
        word = triton_kernels().draw.triton_draw_words(num_q_blocks, draw, _DRAW_KEY)
    else:
        word, _, _, _ = philox4x32_10(_DRAW_KEY, torch.arange(num_q_blocks, device=draw.device), draw, draw >> 32)
    picked = torch.argsort(word, stable=True)[:count]
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
        q,
        k,
        block_q=index.block_q,
        block_k=index.block_k,
        scale=scale,
        seq_lens=seq_lens,
        query_blocks=query_blocks,
        document_ids=document_ids,
    )  # [B, HKV, S, G*BQ, NKB], [B, HKV, S, G*BQ]
    return _recalls(row_mass, row_ok, _oracle_order(row_mass, row_ok), index, query_blocks)


def _oracle_order(row_mass: Tensor, row_ok: Tensor) -> tuple[Tensor, Tensor]:
    """Per sampled (batch, KV head, query block): each key block's mass summed over the real rows
    ``[B, HKV, S, NKB]``, and the key blocks by descending mass (the oracle's order, same shape)."""
    block_mass = torch.where(row_ok.unsqueeze(-1), row_mass, 0.0).sum(dim=3)
    return block_mass, torch.argsort(block_mass, dim=-1, descending=True, stable=True)


def _recalls(
    row_mass: Tensor, row_ok: Tensor, oracle_order: tuple[Tensor, Tensor], index: BlockIndex, query_blocks: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`row_mass_recall` from the sampled blocks' row masses and :func:`_oracle_order`."""
    selected = index.to_dense()[:, :, query_blocks]  # [B, HKV, S, NKB]
    recall = torch.where(selected.unsqueeze(3), row_mass, 0.0).sum(dim=-1)
    _, order = oracle_order
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=row_mass.device).expand_as(order)
    )
    oracle = rank < selected.sum(dim=-1, keepdim=True)
    oracle_recall = torch.where(oracle.unsqueeze(3), row_mass, 0.0).sum(dim=-1)
    return recall[row_ok], oracle_recall[row_ok]


@torch.no_grad()
def oracle_budget(
    q: Tensor,
    k: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    query_blocks: Tensor,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    goal: float = ORACLE_RECALL_GOAL,
) -> Tensor:
    """Block density a perfect selector needs for a mean row recall of ``goal``: a property of the
    model's attention, not of any selector.

    For each sampled (batch, KV head, query block) the oracle adds key blocks in order of their mean
    row mass (the order that raises the mean recall of the block's rows fastest) until the mean recall
    of its real rows reaches ``goal``; the result is the number of blocks it needed, summed over the
    sampled query blocks, over their causally reachable blocks. Every row reaches recall 1 on its
    reachable blocks, so the count never exceeds them. A value above the configured density says the
    budget (``top_k``, ``window``, ``sinks``), not the selector, keeps the recall below ``goal``.

    Args: as :func:`row_mass_recall`, with the block sizes given directly; ``goal`` in (0, 1].

    Returns:
        float32 scalar on q's device (NaN when no sampled query block holds a real row).
    """
    query_blocks = query_blocks.to(q.device)
    row_mass, row_ok = dense_row_block_mass(
        q,
        k,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        seq_lens=seq_lens,
        query_blocks=query_blocks,
        document_ids=document_ids,
    )  # [B, HKV, S, G*BQ, NKB], [B, HKV, S, G*BQ]
    return _oracle_budget(_oracle_order(row_mass, row_ok), row_ok, q.shape[2], block_q, block_k, query_blocks, goal)


def _oracle_budget(
    oracle_order: tuple[Tensor, Tensor],
    row_ok: Tensor,
    seq_len: int,
    block_q: int,
    block_k: int,
    query_blocks: Tensor,
    goal: float,
) -> Tensor:
    """:func:`oracle_budget` from :func:`_oracle_order` of the sampled blocks."""
    block_mass, order = oracle_order
    rows = row_ok.sum(dim=-1).to(block_mass.dtype)  # [B, HKV, S]
    mean_recall = torch.cumsum(block_mass.gather(-1, order), dim=-1) / rows.clamp(min=1).unsqueeze(-1)
    # Rounding may leave the full sum a hair below 1: the last reachable block always meets the goal.
    needed = (mean_recall < goal - 1e-6).sum(dim=-1) + 1  # [B, HKV, S]
    num_q_blocks = math.ceil(seq_len / block_q)
    reachable = causal_last_block(num_q_blocks, seq_len, block_q, block_k, block_mass.device)[query_blocks] + 1  # [S]
    needed = torch.minimum(needed, reachable.view(1, 1, -1))
    live = rows > 0
    total = torch.where(live, reachable.view(1, 1, -1), 0).sum().to(torch.float32)
    return torch.where(live, needed, 0).sum().to(torch.float32) / total  # 0 / 0 = NaN without a real row


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
        ``{"mass_recall_mean", "mass_recall_p5", "oracle_mass_recall_mean", "oracle_mass_recall_p5",
        "oracle_density_r90"}`` scalar float32 tensors on q's device (NaN when no sampled row holds a
        real query); the last is :func:`oracle_budget` (the density a perfect selector needs for a
        mean recall of 0.90).
    """
    query_blocks = query_blocks.to(q.device)
    row_mass, row_ok = dense_row_block_mass(
        q,
        k,
        block_q=index.block_q,
        block_k=index.block_k,
        scale=scale,
        seq_lens=seq_lens,
        query_blocks=query_blocks,
        document_ids=document_ids,
    )  # [B, HKV, S, G*BQ, NKB], [B, HKV, S, G*BQ]
    oracle_order = _oracle_order(row_mass, row_ok)
    recall, oracle = _recalls(row_mass, row_ok, oracle_order, index, query_blocks)
    out = {}
    for prefix, values in (("", recall), ("oracle_", oracle)):
        if values.numel() == 0:
            out[f"{prefix}mass_recall_mean"] = out[f"{prefix}mass_recall_p5"] = torch.full(
                (), float("nan"), device=q.device
            )
        else:
            out[f"{prefix}mass_recall_mean"] = values.mean()
            out[f"{prefix}mass_recall_p5"] = torch.quantile(values, RECALL_QUANTILE)
    out["oracle_density_r90"] = _oracle_budget(
        oracle_order, row_ok, q.shape[2], index.block_q, index.block_k, query_blocks, ORACLE_RECALL_GOAL
    )
    return out
