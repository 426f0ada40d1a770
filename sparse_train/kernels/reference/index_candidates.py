"""PyTorch reference of the candidate index scores: an upper bound of every (query block, key block) token score,
and the exact token scores of listed key blocks. The kernels with the same semantics are in
``kernels/triton/index_candidates.py``; the selector that uses them is :mod:`sparse_train.selection.candidates`.

The exact token score of a pair is (``reference/index_scores.py``)

    s[i, j] = max over valid rows r of block i, index heads e, valid keys t of block j with t <= r of  u[r, e] . w[t]

With the element-wise extremes of the block's index keys over its valid keys (t < len_b),
``w_max[j] = max_t w[t]`` and ``w_min[j] = min_t w[t]``, every key of the block satisfies

    u . w[t] <= sum_s max(u_s w_max[j, s], u_s w_min[j, s]) = relu(u) . w_max[j] + min(u, 0) . w_min[j]

so the bound

    b[i, j] = max over valid rows r of block i and heads e with j * BK <= r
              of  relu(u[r, e]) . w_max[j] + min(u[r, e], 0) . w_min[j]

is >= s[i, j] in exact arithmetic (the causal and document limits only remove keys from the max, so ignoring them
inside a block keeps the bound; in floating point both sides round). It costs BQ products of width 2S per pair
instead of BQ x BK of width S. -inf where the key block starts after the block's last valid row or the block has no
valid row.

Memory per chunk of query blocks is bounded by
:data:`~sparse_train.kernels.reference.index_scores.REFERENCE_CHUNK_BYTES`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .index_scores import (
    REFERENCE_CHUNK_BYTES,
    IndexScoreArgs,
    check_index_score_args,
    listed_positions,
    sequence_lengths,
)

__all__ = ["check_candidates", "key_block_extremes", "reference_candidate_index_scores", "reference_index_score_bounds"]


def _row_positions(query_blocks: Tensor | None, rows: int, block_q: int, device) -> Tensor:
    """int64 ``[R, BQ]``: the sequence position of each row of u, block by block."""
    blocks = torch.arange(rows, device=device) if query_blocks is None else query_blocks
    return listed_positions(blocks, block_q, device)


def _query_rows(u: Tensor, start: int, count: int, block_q: int, compute: torch.dtype) -> Tensor:
    """u's rows of local query blocks ``start .. start + count - 1``: ``[B, H, C, BQ, E, S]`` in ``compute``
    (a partial last block repeats the last row; the callers mask those rows)."""
    batch, heads, rows, index_heads, dim = u.shape
    local = (start + torch.arange(count, device=u.device)).view(-1, 1) * block_q + torch.arange(
        block_q, device=u.device
    )
    picked = u.index_select(2, local.clamp(max=rows - 1).reshape(-1))
    return picked.view(batch, heads, count, block_q, index_heads, dim).to(compute)


def key_block_extremes(w: Tensor, block_k: int, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(``[B, H, NKB, 2S]``: each key block's element-wise max then min of ``w`` ``[B, H, N, S]`` over its valid keys
    (positions < ``lengths[b]``), zeros for a block without one, in w's dtype; bool ``[B, NKB]``: the block has a
    valid key)."""
    B, H, N, S = w.shape
    nkb = -(-N // block_k)
    key_ok = torch.arange(nkb * block_k, device=w.device).view(1, -1) < lengths.view(B, 1)  # [B, NKB * BK]
    keys = torch.nn.functional.pad(w, (0, 0, 0, nkb * block_k - N)).view(B, H, nkb, block_k, S)
    key_ok = key_ok.view(B, 1, nkb, block_k, 1)
    w_max = torch.where(key_ok, keys, float("-inf")).amax(dim=3)  # [B, H, NKB, S]
    w_min = torch.where(key_ok, keys, float("inf")).amin(dim=3)
    block_has_key = key_ok.view(B, nkb, block_k).any(dim=-1)  # [B, NKB]
    # a block without a valid key gets zero extremes (its bound is -inf): no inf * 0
    has = block_has_key.view(B, 1, nkb, 1)
    return torch.cat([torch.where(has, w_max, 0.0), torch.where(has, w_min, 0.0)], dim=-1), block_has_key


def reference_index_score_bounds(
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
    B, H, E, N, nkb = args.B, args.H, args.E, args.N, args.num_k_blocks
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    device = u.device
    lengths = sequence_lengths(seq_lens, B, N, device)
    extremes, block_has_key = key_block_extremes(w, block_k, lengths)  # [B, H, NKB, 2S], [B, NKB]
    extremes = extremes.to(compute)
    block_has_key = block_has_key.view(B, 1, nkb)
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


def check_candidates(candidates, args: IndexScoreArgs, device) -> None:
    """``candidates`` must be an integer ``[B, H, R, C]`` tensor on ``device`` (a ``ValueError`` names it)."""
    if (
        not isinstance(candidates, Tensor)
        or candidates.dim() != 4
        or tuple(candidates.shape[:3]) != (args.B, args.H, args.rows)
        or candidates.dtype not in (torch.int32, torch.int64)
        or candidates.device != device
    ):
        got = (
            f"{candidates.dtype} {tuple(candidates.shape)} on {candidates.device}"
            if isinstance(candidates, Tensor)
            else type(candidates).__name__
        )
        raise ValueError(
            f"candidates must be an int32 or int64 [B, H, R, C] = [{args.B}, {args.H}, {args.rows}, C] tensor on "
            f"{device}, got {got}"
        )


def reference_candidate_index_scores(
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
        candidates: int ``[B, H, R, C]``, key-block ids per output row; an id outside [0, NKB) lists no block.

    Returns:
        float32 ``[B, H, R, C]`` (float64 for float64 inputs): the score of each listed pair, equal to that pair's
        entry of the full scores (-inf where it has no valid (row, key), and for an id that lists no block).

    Raises:
        ValueError: as :func:`~sparse_train.kernels.reference.index_scores.check_index_score_args`, or for
            ``candidates`` of another shape, dtype or device.
    """
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    B, H, E, S, N, nkb = args.B, args.H, args.E, args.S, args.N, args.num_k_blocks
    check_candidates(candidates, args, u.device)
    count_c = candidates.shape[3]
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    device = u.device
    lengths = sequence_lengths(seq_lens, B, N, device)
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
        listed = candidates[:, :, start : start + count].to(torch.int64)  # [B, H, C, CC]
        listed_ok = (listed >= 0) & (listed < nkb)
        listed = torch.where(listed_ok, listed, 0)
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
        valid = valid & row_ok.view(B, 1, count, block_q, 1, 1) & listed_ok.view(B, H, count, 1, count_c, 1)
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
