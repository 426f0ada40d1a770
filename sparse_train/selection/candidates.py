"""Token index scores on candidate key blocks: an upper bound ranks every block pair, the exact score is
computed for the best-bounded few (``SparseAttentionConfig.selector_candidates``).

The exact token score of a (query block i, key block j) pair is (``kernels/reference/index_scores.py``)

    s[i, j] = max over valid rows r of block i, index heads e, valid keys t of block j with t <= r of  u[r, e] . w[t]

and costs BQ x BK products per pair. With the element-wise extremes of the block's index keys,
``w_max[j] = max_t w[t]`` and ``w_min[j] = min_t w[t]`` over its valid keys, every key of the block satisfies

    u . w[t] <= sum_s max(u_s w_max[j, s], u_s w_min[j, s]) = relu(u) . w_max[j] + min(u, 0) . w_min[j]

so the bound

    b[i, j] = max over valid rows r of block i and heads e of  relu(u[r, e]) . w_max[j] + min(u[r, e], 0) . w_min[j]

is >= s[i, j] (the causal and document limits only remove keys from the max, so ignoring them inside a block
keeps the bound) and costs BQ products of width 2S per pair instead of BQ x BK of width S. The C blocks with the
largest bound among a query block's dynamic blocks (causal, neither window nor sink, sharing a document) are
scored exactly; the others score -inf. When the k-th best exact score is at least the largest bound left out,
the candidates hold the row's true top k (the row is *certified* for k, :func:`certified_rows`); otherwise a block
outside the candidates may have scored higher.

Both steps are PyTorch ops here (there is no fused kernel for them); memory per chunk of query blocks is
bounded by :data:`~sparse_train.kernels.reference.index_scores.REFERENCE_CHUNK_BYTES`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.reference.index_scores import REFERENCE_CHUNK_BYTES, check_index_score_args

__all__ = ["candidate_index_scores", "certified_rows", "index_score_bounds"]


def _lengths(seq_lens: Tensor | None, batch: int, seq_len: int, device) -> Tensor:
    if seq_lens is None:
        return torch.full((batch,), seq_len, device=device, dtype=torch.int64)
    return seq_lens.to(device=device, dtype=torch.int64).clamp(0, seq_len)


def _row_positions(query_blocks: Tensor | None, rows: int, block_q: int, device) -> Tensor:
    """int64 ``[R, BQ]``: the sequence position of each row of u, block by block."""
    blocks = torch.arange(rows, device=device) if query_blocks is None else query_blocks.to(device, torch.int64)
    return blocks.view(-1, 1) * block_q + torch.arange(block_q, device=device)


def _query_rows(u: Tensor, start: int, count: int, block_q: int, compute: torch.dtype) -> Tensor:
    """u's rows of local query blocks ``start .. start + count - 1``: ``[B, H, C, BQ, E, S]`` in ``compute``
    (a partial last block repeats the last row; the callers mask those rows)."""
    batch, heads, rows, index_heads, dim = u.shape
    local = (start + torch.arange(count, device=u.device)).view(-1, 1) * block_q + torch.arange(
        block_q, device=u.device
    )
    picked = u.index_select(2, local.clamp(max=rows - 1).reshape(-1))
    return picked.view(batch, heads, count, block_q, index_heads, dim).to(compute)


def index_score_bounds(
    u: Tensor,
    w: Tensor,
    *,
    block_q: int,
    block_k: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """The upper bound ``b[i, j]`` of the module docstring for every (query block, key block) pair.

    Args and layout as :func:`~sparse_train.kernels.reference.index_scores.reference_index_block_scores` (u ``[B, H,
    M, E, S]``, w ``[B, H, N, S]``); ``document_ids`` is checked but not used (documents only remove keys).

    Returns:
        float32 ``[B, H, R, NKB]`` (float64 for float64 inputs): >= the exact score of every pair, -inf where the key
        block starts after the query block's last valid row or holds no valid key, or the block has no valid row.
    """
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    B, H, E, S, N, nkb = args.B, args.H, args.E, args.S, args.N, args.num_k_blocks
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    device = u.device
    lengths = _lengths(seq_lens, B, N, device)
    pad = nkb * block_k - N
    key_ok = torch.arange(nkb * block_k, device=device).view(1, -1) < lengths.view(B, 1)  # [B, NKB * BK]
    keys = torch.nn.functional.pad(w.to(compute), (0, 0, 0, pad)).view(B, H, nkb, block_k, S)
    key_ok = key_ok.view(B, 1, nkb, block_k, 1)
    w_max = torch.where(key_ok, keys, float("-inf")).amax(dim=3)  # [B, H, NKB, S]
    w_min = torch.where(key_ok, keys, float("inf")).amin(dim=3)
    block_has_key = key_ok.view(B, 1, nkb, block_k).any(dim=-1)  # [B, 1, NKB]
    # a block without a valid key gets zero extremes (its bound is masked below): no inf * 0
    w_max = torch.where(block_has_key.unsqueeze(-1), w_max, 0.0)
    w_min = torch.where(block_has_key.unsqueeze(-1), w_min, 0.0)
    extremes = torch.cat([w_max, w_min], dim=-1)  # [B, H, NKB, 2S]
    positions = _row_positions(query_blocks, args.rows, block_q, device)  # [R, BQ]
    block_first = torch.arange(nkb, device=device) * block_k
    per_block = B * H * block_q * E * nkb * (8 if compute == torch.float64 else 4)
    step = max(1, min(max(args.rows, 1), REFERENCE_CHUNK_BYTES // max(1, per_block)))
    parts = []
    for start in range(0, args.rows, step):
        count = min(step, args.rows - start)
        rows = _query_rows(u, start, count, block_q, compute)  # [B, H, C, BQ, E, S]
        pos = positions[start : start + count]  # [C, BQ]
        row_ok = (pos.view(1, count, block_q) < lengths.view(B, 1, 1)) & (pos < N).view(1, count, block_q)
        rows = torch.where(row_ok.view(B, 1, count, block_q, 1, 1), rows, 0.0)
        split = torch.cat([rows.clamp(min=0), rows.clamp(max=0)], dim=-1)  # [B, H, C, BQ, E, 2S]
        bound = torch.einsum("bhcqex,bhjx->bhcqej", split, extremes)  # [B, H, C, BQ, E, NKB]
        reach = block_first.view(1, 1, -1) <= pos.view(count, block_q, 1)  # [C, BQ, NKB]
        valid = (
            reach.view(1, count, block_q, nkb) & row_ok.view(B, count, block_q, 1) & block_has_key.view(B, 1, 1, nkb)
        )
        bound = bound.masked_fill(~valid.view(B, 1, count, block_q, 1, nkb), float("-inf"))
        parts.append(bound.amax(dim=(3, 4)))
    if not parts:
        return w.new_empty((B, H, 0, nkb), dtype=compute)
    return torch.cat(parts, dim=2)


def candidate_index_scores(
    u: Tensor,
    w: Tensor,
    candidates: Tensor,
    *,
    block_q: int,
    block_k: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """Exact token index scores of the listed key blocks only; differentiable in u and w.

    Args:
        u, w, block_q, block_k, seq_lens, document_ids, query_blocks: as
            :func:`~sparse_train.kernels.reference.index_scores.reference_index_block_scores`.
        candidates: int ``[B, H, R, C]``, key-block ids in [0, NKB) per output row.

    Returns:
        float32 ``[B, H, R, C]`` (float64 for float64 inputs): the score of each listed pair, equal to that pair's
        entry of the full scores (-inf where it has no valid (row, key)).

    Raises:
        ValueError: as :func:`~sparse_train.kernels.reference.index_scores.check_index_score_args`, or for
            ``candidates`` of another shape, dtype or device.
    """
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    B, H, E, S, N, nkb = args.B, args.H, args.E, args.S, args.N, args.num_k_blocks
    if (
        not isinstance(candidates, Tensor)
        or candidates.dim() != 4
        or tuple(candidates.shape[:3]) != (B, H, args.rows)
        or candidates.dtype not in (torch.int32, torch.int64)
        or candidates.device != u.device
    ):
        raise ValueError(
            f"candidates must be an integer [B, H, R, C] = [{B}, {H}, {args.rows}, C] tensor on {u.device}, got "
            f"{getattr(candidates, 'shape', type(candidates).__name__)}"
        )
    count_c = candidates.shape[3]
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    device = u.device
    lengths = _lengths(seq_lens, B, N, device)
    key_ok = torch.arange(N, device=device).view(1, N) < lengths.view(B, 1)
    # padding may hold NaN: select zeros (not multiply) so that neither values nor gradients see it
    keys = torch.where(key_ok.view(B, 1, N, 1), w, 0).to(compute)
    keys = torch.nn.functional.pad(keys, (0, 0, 0, nkb * block_k - N)).view(B, H, nkb, block_k, S)
    docs = None if document_ids is None else document_ids.to(torch.int64)
    positions = _row_positions(query_blocks, args.rows, block_q, device)  # [R, BQ]
    offsets = torch.arange(block_k, device=device)
    batch_index = torch.arange(B, device=device).view(B, 1, 1, 1)
    head_index = torch.arange(H, device=device).view(1, H, 1, 1)
    per_block = B * H * block_q * E * count_c * block_k * (8 if compute == torch.float64 else 4)
    step = max(1, min(max(args.rows, 1), REFERENCE_CHUNK_BYTES // max(1, per_block)))
    parts = []
    for start in range(0, args.rows, step):
        count = min(step, args.rows - start)
        listed = candidates[:, :, start : start + count].to(torch.int64).clamp(0, nkb - 1)  # [B, H, C, CC]
        gathered = keys[batch_index, head_index, listed]  # [B, H, C, CC, BK, S]
        rows = _query_rows(u, start, count, block_q, compute)  # [B, H, C, BQ, E, S]
        pos = positions[start : start + count]  # [C, BQ]
        row_ok = (pos.view(1, count, block_q) < lengths.view(B, 1, 1)) & (pos < N).view(1, count, block_q)
        rows = torch.where(row_ok.view(B, 1, count, block_q, 1, 1), rows, 0.0)
        logits = torch.einsum("bhcqes,bhcjks->bhcqejk", rows, gathered)  # [B, H, C, BQ, E, CC, BK]
        key_pos = listed.unsqueeze(-1) * block_k + offsets  # [B, H, C, CC, BK]
        valid = (key_pos.unsqueeze(3) <= pos.view(1, 1, count, block_q, 1, 1)) & (
            key_pos < lengths.view(B, 1, 1, 1, 1)
        ).unsqueeze(3)  # [B, H, C, BQ, CC, BK]
        valid = valid & row_ok.view(B, 1, count, block_q, 1, 1)
        if docs is not None:
            row_doc = docs.gather(1, pos.clamp(max=N - 1).view(1, -1).expand(B, -1)).view(B, 1, count, block_q, 1, 1)
            key_doc = docs.gather(1, key_pos.clamp(max=N - 1).reshape(B, H * count * count_c * block_k))
            key_doc = key_doc.view(B, H, count, 1, count_c, block_k)
            valid = valid & (key_doc == row_doc)
        logits = logits.masked_fill(~valid.unsqueeze(4), float("-inf"))
        parts.append(logits.amax(dim=(3, 4, 6)))
    if not parts:
        return w.new_empty((B, H, 0, count_c), dtype=compute)
    return torch.cat(parts, dim=2)


def certified_rows(bounds: Tensor, candidates: Tensor, exact: Tensor, k: int | None = None) -> Tensor:
    """bool ``[B, H, R]``: the row's ``k`` best exact scores (default all C) are its true top ``k``, because the
    ``k``-th best of them is at least every bound left out of the candidates. ``bounds`` ``[B, H, R, NKB]`` (-inf
    where a block may not be picked), ``candidates`` ``[B, H, R, C]`` (the picked blocks), ``exact`` ``[B, H, R, C]``
    (their exact scores); ``k`` in [1, C]."""
    count = candidates.shape[-1]
    k = count if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= count:
        raise ValueError(f"k must be an int in [1, C={count}], got {k!r}")
    left_out = bounds.scatter(-1, candidates.to(torch.int64), float("-inf")).amax(dim=-1)
    kth = exact.topk(k, dim=-1).values[..., -1]
    return kth >= left_out
