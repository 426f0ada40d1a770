"""Selection quality on sampled query blocks: oracle recall and captured attention mass.

For a sampled query block i (per batch and KV head) with m selected blocks, the *oracle* is the m key
blocks that dense causal attention puts the most mass on (mass pooled over the block's rows and the
group's heads, as in distillation). Two numbers:

* ``recall``: |selected ∩ oracle| / m (1.0 = the selection is the best possible set of its size);
* ``mass_captured``: dense attention mass inside the selected blocks (1.0 = nothing is lost).

Only a few query blocks are measured (each costs one dense row-block of attention), under
``no_grad`` on detached inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..index import BlockIndex
from .distill import dense_block_mass

__all__ = ["selection_quality", "sample_query_blocks"]


def sample_query_blocks(num_q_blocks: int, count: int, generator: torch.Generator | None = None) -> Tensor:
    """int64 ``[min(count, NQB)]`` distinct query-block ids, sorted (drawn on the CPU generator given)."""
    count = min(count, num_q_blocks)
    picked = torch.randperm(num_q_blocks, generator=generator)[:count]
    return torch.sort(picked).values


@torch.no_grad()
def selection_quality(
    q: Tensor,
    k: Tensor,
    index: BlockIndex,
    *,
    scale: float,
    query_blocks: Tensor,
    seq_lens: Tensor | None = None,
) -> dict[str, Tensor]:
    """Recall of the oracle blocks and captured mass, averaged over sampled rows.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]``; index: the selection to grade.
        scale: logit scale. query_blocks: int64 ``[S]`` query blocks to measure.
        seq_lens: optional int ``[B]``.

    Returns:
        ``{"recall": scalar, "mass_captured": scalar}`` float32 tensors on q's device (NaN when no
        sampled row holds a real query).
    """
    query_blocks = query_blocks.to(q.device)
    mass, row_valid = dense_block_mass(
        q, k, block_q=index.block_q, block_k=index.block_k, scale=scale, seq_lens=seq_lens, query_blocks=query_blocks
    )  # [B, HKV, S, NKB]
    selected = index.to_dense()[:, :, query_blocks]  # [B, HKV, S, NKB]
    budget = selected.sum(dim=-1, keepdim=True)
    order = torch.argsort(mass, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(mass.shape[-1], device=q.device).expand_as(order))
    oracle = rank < budget
    hits = (oracle & selected).sum(dim=-1).to(torch.float32)
    recall = hits / budget.squeeze(-1).clamp(min=1).to(torch.float32)
    captured = (mass * selected).sum(dim=-1)
    rows = row_valid.to(torch.float32)
    count = rows.sum()
    nan = torch.full((), float("nan"), device=q.device)
    return {
        "recall": torch.where(count > 0, (recall * rows).sum() / count.clamp(min=1), nan),
        "mass_captured": torch.where(count > 0, (captured * rows).sum() / count.clamp(min=1), nan),
    }
