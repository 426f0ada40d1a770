"""Token index scores on candidate key blocks (``SparseAttentionConfig.selector_candidates``): an upper bound ranks
every block pair, the exact token score is computed for the best-bounded few.

A block pair's exact token score costs BQ x BK products of width S; its bound (the index query against the
element-wise max and min of the key block's index keys, ``kernels/reference/index_candidates.py``) costs BQ products
of width 2S and is at least the score. The C blocks with the largest bound among a query block's dynamic blocks
(causal, neither window nor sink, sharing a document) are scored exactly; the others score -inf. When the k-th best
exact score is at least every bound left out, the candidates hold the row's true top k (the row is *certified*,
:func:`certified_rows`); otherwise a block outside them may have scored higher.

:func:`candidate_block_scores` runs both steps with the Triton kernels where they run (CUDA, eager or compiled through
their custom ops: the bound kernel, the selection's top-k kernel for the picks, the candidate kernel), the PyTorch
references otherwise;
:func:`dynamic_block_bounds` gives the bounds the picks rank, for :func:`certified_rows`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import triton_kernels
from ..kernels.reference.index_candidates import reference_candidate_index_scores, reference_index_score_bounds
from ..plan.device import triton_runs_on
from .scorer import SelectionGeometry, allowed_dynamic_blocks

__all__ = ["candidate_block_scores", "candidate_blocks", "certified_rows", "dynamic_block_bounds"]


def candidate_block_scores(
    u: Tensor,
    w: Tensor,
    geometry: SelectionGeometry,
    candidates: int,
    *,
    window: int,
    sinks: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(scores, picked): the exact token scores of each row's ``candidates`` best-bounded dynamic key blocks, -inf
    elsewhere, float32 ``[B, H, R, NKB]`` (differentiable in u and w; float64 for float64 inputs); the picked block
    ids ``[B, H, R, candidates]`` (:func:`candidate_blocks`).

    u ``[B, H, M, E, S]`` and w ``[B, H, N, S]`` as
    :func:`~sparse_train.kernels.triton.index_scores.index_block_scores` takes them, with the block sizes of
    ``geometry``; ``window`` and ``sinks`` are the layer's (the blocks the index adds anyway)."""
    blocks = dict(block_q=geometry.block_q, block_k=geometry.block_k)
    masks = dict(seq_lens=seq_lens, document_ids=document_ids, query_blocks=query_blocks)
    picked = candidate_blocks(u, w, geometry, candidates, window=window, sinks=sinks, **masks)
    kernels = triton_kernels().index_candidates if triton_runs_on(u) else None
    if kernels is not None and not (torch.is_grad_enabled() and (u.requires_grad or w.requires_grad)):
        exact = kernels.candidate_index_scores(u, w, picked, **blocks, **masks)
    else:
        exact = reference_candidate_index_scores(u, w, picked, **blocks, **masks)  # [B, H, R, C]
    return _spread(exact, picked, geometry.num_k_blocks), picked


@torch.no_grad()
def candidate_blocks(
    u: Tensor,
    w: Tensor,
    geometry: SelectionGeometry,
    candidates: int,
    *,
    window: int,
    sinks: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """int64 ``[B, H, R, C]``, C = min(``candidates``, NKB): each row's dynamic key blocks (causal, neither window
    nor sink, sharing a document) of largest bound with a finite bound, -1 in the slots left when a row has fewer.
    Slots in no fixed order (the kernel lists them in block order). Arguments as :func:`candidate_block_scores`'s.

    Where the kernels run and there are no documents, the bound kernel and the selection's top-k kernel
    (``kernels/triton/topk.py``, which applies the window, the sinks and causality itself) pick them; otherwise
    :func:`dynamic_block_bounds` and ``torch.topk``."""
    count = min(candidates, geometry.num_k_blocks)
    kernels = triton_kernels() if triton_runs_on(u) else None
    if kernels is not None and document_ids is None and geometry.num_k_blocks <= kernels.topk.MAX_KEY_BLOCKS:
        bounds = kernels.index_candidates.index_score_bounds(
            u, w, block_q=geometry.block_q, block_k=geometry.block_k, seq_lens=seq_lens, query_blocks=query_blocks
        )  # [B, H, R, NKB], -inf where no (row, key) pair is valid
        listed = None if query_blocks is None else query_blocks.to(u.device, torch.int32).contiguous()
        # seq_lens=None: a block past a sequence's end has a -inf bound, which the kernel never picks
        return kernels.topk.topk_blocks(
            bounds,
            seq_len=geometry.seq_len,
            block_q=geometry.block_q,
            block_k=geometry.block_k,
            k=count,
            window=window,
            sinks=sinks,
            seq_lens=None,
            query_blocks=listed,
        )
    bounds = dynamic_block_bounds(
        u,
        w,
        geometry,
        window=window,
        sinks=sinks,
        seq_lens=seq_lens,
        document_ids=document_ids,
        query_blocks=query_blocks,
    )
    top = bounds.topk(count, dim=-1)
    # a pick with a -inf bound is no candidate (fewer dynamic blocks than candidates)
    return torch.where(torch.isneginf(top.values), -1, top.indices)


@torch.no_grad()
def dynamic_block_bounds(
    u: Tensor,
    w: Tensor,
    geometry: SelectionGeometry,
    *,
    window: int,
    sinks: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """float32 ``[B, H, R, NKB]`` (float64 for float64 inputs): the upper bound of every block pair's token score,
    -inf on the blocks that are not dynamic (forced, after the query block, in another document) or hold no valid
    (row, key) pair. Arguments as :func:`candidate_block_scores`'s."""
    blocks = dict(block_q=geometry.block_q, block_k=geometry.block_k)
    masks = dict(seq_lens=seq_lens, document_ids=document_ids, query_blocks=query_blocks)
    if triton_runs_on(u):
        bounds = triton_kernels().index_candidates.index_score_bounds(u, w, **blocks, **masks)
    else:
        bounds = reference_index_score_bounds(u, w, **blocks, **masks)  # [B, H, R, NKB]
    allowed = allowed_dynamic_blocks(geometry, window, sinks, u.device, document_ids)
    if query_blocks is not None:
        allowed = allowed.index_select(allowed.dim() - 2, query_blocks.to(u.device, torch.int64))
    if allowed.dim() == 3:
        allowed = allowed.unsqueeze(1)  # [B, 1, R, NKB]
    return bounds.masked_fill(~allowed, float("-inf"))


def _spread(values: Tensor, picked: Tensor, columns: int) -> Tensor:
    """``[..., columns]``, -inf but ``values[..., c]`` at column ``picked[..., c]`` (slots of -1 write nothing: they go
    to an extra column, dropped)."""
    full = values.new_full((*values.shape[:-1], columns + 1), float("-inf"))
    return full.scatter(-1, torch.where(picked < 0, columns, picked), values)[..., :columns]


def certified_rows(bounds: Tensor, candidates: Tensor, exact: Tensor, k: int | None = None) -> Tensor:
    """bool ``[B, H, R]``: the row's ``k`` best exact scores (default all C) are its true top ``k``, because the
    ``k``-th best of them is at least every bound left out of the candidates. ``bounds`` ``[B, H, R, NKB]`` (-inf
    where a block may not be picked), ``candidates`` ``[B, H, R, C]`` (the picked blocks, -1 for none), ``exact``
    ``[B, H, R, C]`` (their exact scores, -inf for none); ``k`` in [1, C]."""
    count = candidates.shape[-1]
    k = count if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= count:
        raise ValueError(f"k must be an int in [1, C={count}], got {k!r}")
    columns = bounds.shape[-1]
    picked = candidates.to(torch.int64)
    extended = torch.cat([bounds, bounds.new_full((*bounds.shape[:-1], 1), float("-inf"))], dim=-1)
    left_out = extended.scatter(-1, torch.where(picked < 0, columns, picked), float("-inf"))
    kth = exact.topk(k, dim=-1).values[..., -1]
    return kth >= left_out.amax(dim=-1)
