"""PyTorch reference of the selector's distillation targets: attention mass per key block, pooled
over the rows of each query block. The Triton kernels of ``block_mass.py`` must match it.

    m[b, g, r, j] = sum_{key in block j, key valid for row r} exp(scale <Q[g, r], K[key]> - lse[g, r])
    T[b, h, i, j] = pool over rows r of block i and heads g of group h of m[b, g, r, j]  (max or sum)
    target[b, h, i, j] = T[b, h, i, j] / sum_j' T[b, h, i, j']      (0 where a row has no mass)

Notation: B batch, HQ/HKV query/KV heads, G = HQ/HKV, N length, D head dim, BQ/BK block sizes, NQB/NKB
query/key blocks, K index capacity, S sampled query blocks, R rows used per query block (all BQ, or
``rows_per_block`` evenly spaced ones). A row is live when it is a real query (q < N and q <
seq_lens[b]) with a finite lse; a key is valid for it when k <= q, k < seq_lens[b] and, with packed
documents (``document_ids [B, N]``, :mod:`sparse_train.documents`), k lies in q's document. Padding (past
seq_lens) may hold anything, NaN included: it is selected away, never multiplied by zero.

* :func:`reference_sparse_block_mass`: the *selected* blocks of a ``BlockIndex``; ``lse`` is the main
  attention's own (the kernel's second output), or recomputed over the selected set.
* :func:`reference_dense_block_mass` / :func:`dense_row_block_mass`: every causal block (dense causal
  attention), pooled / per row.

Known limits: chunked over query blocks (``chunk_mb`` of fp32 logits per chunk), so memory is bounded
but the dense target does N x N work; no gradients (``no_grad``, q/k detached): the target is a
constant of the selector's loss. Dispatch to the kernels lives in :mod:`sparse_train.selection.distill`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...index.block_index import BlockIndex
from ...validation import check_choice, check_document_ids

__all__ = [
    "ROW_POOLS",
    "dense_row_block_mass",
    "pool_rows",
    "query_row_positions",
    "reference_dense_block_mass",
    "reference_sparse_block_mass",
    "renormalise",
]

ROW_POOLS = ("max", "mean")
"""How the rows (and GQA heads) of a query block are pooled: ``"max"`` keeps each key block's largest
single-row mass, ``"mean"`` its average mass (both renormalised over the key blocks)."""


def pool_rows(row_mass: Tensor, row_ok: Tensor, row_pool: str) -> Tensor:
    """Pool per-row block masses over the rows of each query block and renormalise.

    Args:
        row_mass: float32 ``[..., R, M]`` mass of each row on each of M blocks (0 for dead rows).
        row_ok: bool ``[..., R]`` (broadcastable): the row is a real query with a finite lse.
        row_pool: ``"max"`` or ``"mean"`` (:data:`ROW_POOLS`).

    Returns:
        float32 ``[..., M]`` summing to 1 over M where any row holds mass, else all zeros.
    """
    check_choice("row_pool", row_pool, ROW_POOLS)
    live = row_ok.unsqueeze(-1)
    # selection, not multiplication: a dead row may hold NaN from padded inputs
    row_mass = torch.where(live, row_mass, 0.0)
    return renormalise(row_mass.amax(dim=-2) if row_pool == "max" else row_mass.sum(dim=-2))


def renormalise(mass: Tensor) -> Tensor:
    """``mass`` ``[..., M]`` (non-negative) divided by its sum over M; rows without mass stay zero."""
    total = mass.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, mass / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def query_row_positions(num_q_blocks: int, block_q: int, rows_per_block: int | None, device=None) -> Tensor:
    """int64 ``[NQB, R]``: the query positions that represent each query block.

    ``rows_per_block=None`` takes all BQ rows (exact mean); an int R takes R evenly spaced rows, the
    centres of R equal slices of the block (an unbiased estimate of the mean at R/BQ of the cost).
    Positions may exceed N - 1 in the last block; callers mask them.
    """
    if rows_per_block is None or rows_per_block >= block_q:
        offsets = torch.arange(block_q, device=device)
    else:
        offsets = (torch.arange(rows_per_block, device=device) * block_q + block_q // 2) // rows_per_block
    return torch.arange(num_q_blocks, device=device).view(-1, 1) * block_q + offsets.view(1, -1)


def _chunk_blocks(total: int, per_block_elements: int, chunk_mb: int) -> int:
    # ~12 bytes live per logit element: fp32 logits, fp32 probabilities, a bool mask and slack
    budget = max(1, (chunk_mb * 2**20) // 12)
    return max(1, min(total, budget // max(1, per_block_elements)))


def _gather_query_rows(q: Tensor, pos: Tensor, num_kv_heads: int) -> Tensor:
    """q ``[B, HQ, N, D]`` rows at ``pos`` ``[C, R]`` -> ``[B, HKV, C, G*R, D]`` (group-major rows)."""
    batch, num_heads, seq_len, dim = q.shape
    group = num_heads // num_kv_heads
    chunk, rows = pos.shape
    picked = q.index_select(2, pos.clamp(max=seq_len - 1).reshape(-1))
    picked = picked.view(batch, num_kv_heads, group, chunk, rows, dim).permute(0, 1, 3, 2, 4, 5)
    return picked.reshape(batch, num_kv_heads, chunk, group * rows, dim)


def _row_positions_grouped(pos: Tensor, group: int) -> Tensor:
    """``[C, R]`` -> ``[C, G*R]`` in the same (group, row) order as :func:`_gather_query_rows`."""
    chunk, rows = pos.shape
    return pos.unsqueeze(1).expand(chunk, group, rows).reshape(chunk, group * rows)


def _row_validity(pos_rows: Tensor, seq_len: int, seq_lens: Tensor | None, batch: int) -> Tensor:
    """bool ``[B, 1, C, G*R]``: the row is a real query (inside N and inside seq_lens[b])."""
    inside = (pos_rows < seq_len).unsqueeze(0).expand(batch, *pos_rows.shape)
    if seq_lens is not None:
        inside = inside & (pos_rows.unsqueeze(0) < seq_lens.view(-1, 1, 1))
    return inside.unsqueeze(1)


@torch.no_grad()
def reference_sparse_block_mass(
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
    """Attention mass on each *selected* block, pooled over rows, renormalised over the selected set.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]`` (detached inside).
        index: the selection the attention used.
        scale: logit scale of the main attention.
        lse: optional ``[B, HQ, N]`` log-sum-exp of the main attention over the same selection (the
            kernel's second output). Without it the lse is recomputed over the selected set.
        seq_lens: optional int ``[B]`` (keys and rows past it are masked; their contents may be
            anything, NaN included).
        rows_per_block: query rows per block used (``None`` = all).
        row_pool: ``"max"`` (default) or ``"mean"`` over the rows and group heads (module docstring).
        chunk_mb: memory budget of one chunk of logits.
        document_ids: optional int ``[B, N]`` (non-decreasing): keys of another document than the
            row's are masked, like the main attention's document mask.
        check_values: check the ``document_ids`` values (a host sync on CUDA).

    :func:`sparse_train.kernels.triton.block_mass.triton_block_mass` computes the same target (with ``lse``
    given and all rows) in one QK^T pass.

    Returns:
        ``target`` float32 ``[B, HKV, NQB, K]`` (zeros on empty slots, each valid row sums to 1) and
        ``row_valid`` bool ``[B, HKV, NQB]`` (the row had at least one real query with mass).
    """
    check_choice("row_pool", row_pool, ROW_POOLS)
    q, k = q.detach(), k.detach()
    batch, num_heads, seq_len, _ = q.shape
    check_document_ids(document_ids, batch, seq_len, q.device, values=check_values)
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    block_q, block_k = index.block_q, index.block_k
    nqb, capacity = index.num_q_blocks, index.capacity
    # a key block longer than the sequence is its one block of N keys: the columns past N are never gathered
    block_k = max(1, min(block_k, seq_len))
    positions = query_row_positions(nqb, block_q, rows_per_block, q.device)
    rows = positions.shape[1]
    per_block = batch * num_heads * rows * capacity * block_k
    step = _chunk_blocks(nqb, per_block, chunk_mb)
    key_offsets = torch.arange(block_k, device=q.device)
    key_limit = torch.full((batch,), seq_len, device=q.device) if seq_lens is None else seq_lens.clamp(max=seq_len)
    targets, valids = [], []
    for start in range(0, nqb, step):
        stop = min(nqb, start + step)
        pos = positions[start:stop]  # [C, R]
        chunk = stop - start
        pos_rows = _row_positions_grouped(pos, group)  # [C, G*R]
        rows_real = _row_validity(pos_rows, seq_len, seq_lens, batch)  # [B, 1, C, G*R]
        # padded query rows may hold NaN: zero them (selection, not multiplication) before the matmul
        q_rows = torch.where(rows_real.unsqueeze(-1), _gather_query_rows(q, pos, num_kv_heads), 0.0)
        blocks = index.indices[:, :, start:stop].to(torch.int64)  # [B, HKV, C, K]
        slot_ok = blocks >= 0
        key_pos = blocks.clamp(min=0).unsqueeze(-1) * block_k + key_offsets  # [B, HKV, C, K, BK]
        flat_pos = key_pos.clamp(max=seq_len - 1).reshape(batch, num_kv_heads, chunk * capacity * block_k, 1)
        keys = k.gather(2, flat_pos.expand(-1, -1, -1, k.shape[-1]))
        keys = keys.view(batch, num_kv_heads, chunk, capacity * block_k, k.shape[-1])
        key_ok = slot_ok.unsqueeze(-1) & (key_pos < key_limit.view(-1, 1, 1, 1, 1))
        key_ok = key_ok.reshape(batch, num_kv_heads, chunk, 1, capacity * block_k)
        keys = torch.where(key_ok.transpose(-1, -2), keys, 0.0)
        # fp32 logits straight from the matmul (scale folded into the small query operand); the
        # element-wise steps below run in place to keep the passes over this large buffer few
        logits = torch.matmul(q_rows.to(torch.float32) * scale, keys.to(torch.float32).transpose(-1, -2))
        key_cols = key_pos.reshape(batch, num_kv_heads, chunk, 1, capacity * block_k)
        causal = key_cols <= pos_rows.view(1, 1, chunk, -1, 1)
        if document_ids is not None:
            causal = causal & _same_document(document_ids, key_cols, pos_rows)
        logits.masked_fill_(~(key_ok & causal), float("-inf"))
        if lse is None:
            row_lse = torch.logsumexp(logits, dim=-1)
        else:
            row_lse = _gather_query_rows(lse.detach().unsqueeze(-1), pos, num_kv_heads).squeeze(-1).to(torch.float32)
        row_ok = rows_real & torch.isfinite(row_lse)
        # rows that are not real queries subtract +inf, so their probabilities become exactly 0
        shift = torch.where(row_ok, row_lse, float("inf")).unsqueeze(-1)
        probs = logits.sub_(shift).exp_()
        row_mass = probs.view(batch, num_kv_heads, chunk, group * rows, capacity, block_k).sum(
            dim=-1
        )  # [B, HKV, C, G*R, K]
        target = pool_rows(row_mass, row_ok, row_pool)
        targets.append(target)
        valids.append(row_ok.any(dim=3) & (target.sum(dim=-1) > 0))
    return torch.cat(targets, dim=2), torch.cat(valids, dim=2)


def _same_document(document_ids: Tensor, key_pos: Tensor, pos_rows: Tensor) -> Tensor:
    """bool ``[B, ..., C, G*R, keys]``: key positions ``key_pos`` (``[B or 1, ..., C or 1, 1, keys]``) in the
    document of each row ``pos_rows`` (``[C, G*R]``); positions past N compare as the last token's."""
    docs = document_ids.to(torch.int64)
    batch, seq_len = docs.shape
    key_pos = key_pos.expand(batch, *key_pos.shape[1:])
    doc_k = docs.gather(1, key_pos.clamp(0, seq_len - 1).flatten(1)).view(key_pos.shape)
    chunk, rows = pos_rows.shape
    doc_q = docs[:, pos_rows.clamp(max=seq_len - 1).reshape(-1)]
    doc_q = doc_q.view(batch, *([1] * (key_pos.dim() - 4)), chunk, rows, 1)
    return doc_k == doc_q


def _dense_row_mass_chunks(
    q,
    k,
    *,
    block_q,
    block_k,
    scale,
    seq_lens,
    rows_per_block,
    query_blocks,
    chunk_mb,
    document_ids=None,
    check_values=True,
):
    """Yield ``(row_mass [B, HKV, C, G*R, NKB], row_ok [B, 1, C, G*R])`` chunk by chunk (exact, dense)."""
    q, k = q.detach(), k.detach()
    batch, num_heads, seq_len, _ = q.shape
    check_document_ids(document_ids, batch, seq_len, q.device, values=check_values)
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    nqb = math.ceil(seq_len / block_q)
    nkb = math.ceil(seq_len / block_k)
    # a key block longer than the sequence is its one block of N keys: no padding of the rows to block_k columns
    block_k = max(1, min(block_k, seq_len))
    positions = query_row_positions(nqb, block_q, rows_per_block, q.device)
    if query_blocks is not None:
        positions = positions[query_blocks.to(device=q.device, dtype=torch.int64)]
    total_blocks, rows = positions.shape
    per_block = batch * num_heads * rows * seq_len
    step = _chunk_blocks(total_blocks, per_block, chunk_mb)
    key_pos = torch.arange(seq_len, device=q.device)
    key_ok = key_pos.view(1, -1) < (seq_len if seq_lens is None else seq_lens.view(-1, 1))  # [B or 1, N]
    # padded keys may hold NaN: zero them (selection, not multiplication) so no NaN reaches a logit
    keys = torch.where(key_ok.view(key_ok.shape[0], 1, seq_len, 1), k, 0.0)
    key_ok = key_ok.view(key_ok.shape[0], 1, 1, 1, seq_len)
    keys_t = keys.transpose(-1, -2).unsqueeze(2)  # [B, HKV, 1, D, N]
    for start in range(0, total_blocks, step):
        pos = positions[start : start + step]
        chunk = pos.shape[0]
        pos_rows = _row_positions_grouped(pos, group)
        rows_real = _row_validity(pos_rows, seq_len, seq_lens, batch)
        q_rows = torch.where(rows_real.unsqueeze(-1), _gather_query_rows(q, pos, num_kv_heads), 0.0)
        logits = torch.matmul(q_rows, keys_t).to(torch.float32) * scale  # [B, HKV, C, G*R, N]
        causal = key_pos.view(1, 1, 1, 1, -1) <= pos_rows.view(1, 1, chunk, -1, 1)
        if document_ids is not None:
            causal = causal & _same_document(document_ids, key_pos.view(1, 1, 1, 1, -1), pos_rows)
        logits = logits.masked_fill(~(causal & key_ok), float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)
        row_ok = rows_real & torch.isfinite(row_lse)
        probs = torch.exp(logits - torch.where(row_ok, row_lse, 0.0).unsqueeze(-1))
        probs = torch.where(row_ok.unsqueeze(-1), probs, 0.0)
        if nkb * block_k > seq_len:
            probs = torch.nn.functional.pad(probs, (0, nkb * block_k - seq_len))
        yield probs.view(batch, num_kv_heads, chunk, group * rows, nkb, block_k).sum(dim=-1), row_ok


@torch.no_grad()
def dense_row_block_mass(
    q: Tensor,
    k: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    query_blocks: Tensor,
    seq_lens: Tensor | None = None,
    chunk_mb: int = 256,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row exact dense attention mass on every key block, for a few query blocks.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]``; query_blocks: int64 ``[S]``; others (document_ids
        included) as :func:`reference_dense_block_mass`.

    Returns:
        ``row_mass`` float32 ``[B, HKV, S, G*BQ, NKB]`` (row r of a block sums to 1 over its causal
        blocks; rows ordered group head major) and ``row_ok`` bool ``[B, HKV, S, G*BQ]`` (real rows).
    """
    parts = list(
        _dense_row_mass_chunks(
            q,
            k,
            block_q=block_q,
            block_k=block_k,
            scale=scale,
            seq_lens=seq_lens,
            rows_per_block=None,
            query_blocks=query_blocks,
            chunk_mb=chunk_mb,
            document_ids=document_ids,
        )
    )
    return torch.cat([m for m, _ in parts], dim=2), torch.cat([ok for _, ok in parts], dim=2)


@torch.no_grad()
def reference_dense_block_mass(
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
    """Exact attention mass of dense causal attention on every key block, pooled over rows.

    Args:
        q: ``[B, HQ, N, D]``; k: ``[B, HKV, N, D]``.
        block_q, block_k: block sizes. scale: logit scale.
        seq_lens: optional int ``[B]`` (padding may hold anything, NaN included).
        rows_per_block: rows used per query block (``None`` = all).
        query_blocks: optional int64 ``[S]`` subset of query blocks (default: all NQB).
        row_pool: ``"max"`` (default) or ``"mean"`` over rows and group heads (module docstring).
        chunk_mb: memory budget of one chunk of logits.
        document_ids: optional int ``[B, N]`` (non-decreasing): each row attends its own document
            only, so its mass lies on the blocks its document overlaps.
        check_values: check the ``document_ids`` values (a host sync on CUDA).

    :func:`sparse_train.kernels.triton.block_mass.triton_dense_block_mass` computes the same target (with
    ``query_blocks`` given and all rows) through one kernel pass (per-row log masses), without the
    S x G x BQ x N logits buffer.

    Returns:
        ``target`` float32 ``[B, HKV, S, NKB]`` (each valid row sums to 1 over its causal blocks) and
        ``row_valid`` bool ``[B, HKV, S]``.
    """
    check_choice("row_pool", row_pool, ROW_POOLS)
    targets, valids = [], []
    for row_mass, row_ok in _dense_row_mass_chunks(
        q,
        k,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        seq_lens=seq_lens,
        rows_per_block=rows_per_block,
        query_blocks=query_blocks,
        chunk_mb=chunk_mb,
        document_ids=document_ids,
        check_values=check_values,
    ):
        targets.append(pool_rows(row_mass, row_ok, row_pool))
        valids.append(row_ok.any(dim=3))
    return torch.cat(targets, dim=2), torch.cat(valids, dim=2)
