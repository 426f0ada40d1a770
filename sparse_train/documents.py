"""Packed documents: many documents in one row of a batch, each token attending only its own document.

Representation: ``document_ids``, an integer tensor ``[B, N]`` (int32 or int64, any strides, on q's
device), non-decreasing along N in every row, values >= 0; token t of row b belongs to document
``document_ids[b, t]``. Key j is visible to query i iff

    j <= i  and  j < seq_lens[b] (when given)  and  document_ids[b, j] == document_ids[b, i]

A query row always sees itself, so the document mask never empties a row (rows past ``seq_lens``
follow the usual padding rules). Ids need not be consecutive: only equality matters (0, 0, 3, 3, 7 is
three documents). Dropout counters stay global positions, so the keep bits do not depend on how a row
is packed.

Conversions from the other usual forms:

* FlashAttention varlen ``cu_seqlens`` (:func:`document_ids_from_cu_seqlens`, inverse
  :func:`cu_seqlens_from_document_ids`);
* the ``position_ids`` of transformers' ``DataCollatorWithFlattening`` (each document restarts at 0):
  :func:`document_ids_from_position_ids`.

:func:`document_positions` gives each token's offset in its document (RoPE positions of packed rows);
:func:`block_document_ranges` gives the first and last document of every block of tokens, which is
what block-level decisions (skipping a cross-document block, skipping the token check inside a block
of one document) need. The argument check is :func:`sparse_train.validation.check_document_ids`
(re-exported here).

Conversions read values on the host (one sync each); they are meant for the data pipeline, once per
batch, not per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validation import check_document_ids, check_int, check_integer_tensor

__all__ = [
    "block_document_ranges",
    "check_document_ids",
    "cu_seqlens_from_document_ids",
    "document_ids_from_cu_seqlens",
    "document_ids_from_position_ids",
    "document_positions",
    "random_document_lengths",
]


def _check_cu_seqlens(cu_seqlens, seq_len: int) -> Tensor:
    cu = check_integer_tensor("cu_seqlens", cu_seqlens)
    if cu.dim() not in (1, 2) or cu.shape[-1] < 1:
        raise ValueError(f"cu_seqlens must be [D+1] or [B, D+1] with D+1 >= 1, got shape {tuple(cu.shape)}")
    rows = cu.view(1, -1) if cu.dim() == 1 else cu
    if rows.numel() == 0:
        return rows.to(torch.int64)
    rows = rows.to(torch.int64)
    first_bad = rows[:, 0] != 0
    if bool(first_bad.any()):
        b = int(first_bad.nonzero()[0, 0])
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens row {b} starting at {int(rows[b, 0])}")
    step_bad = rows[:, 1:] < rows[:, :-1]
    if bool(step_bad.any()):
        b, t = (int(x) for x in step_bad.nonzero()[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got row {b}: cu_seqlens[{t + 1}] = {int(rows[b, t + 1])} < "
            f"cu_seqlens[{t}] = {int(rows[b, t])}"
        )
    last_bad = rows[:, -1] > seq_len
    if bool(last_bad.any()):
        b = int(last_bad.nonzero()[0, 0])
        raise ValueError(f"cu_seqlens must end at most at seq_len={seq_len}, got {int(rows[b, -1])} in row {b}")
    return rows


def document_ids_from_cu_seqlens(cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """Document ids of packed rows from FlashAttention-varlen style cumulative lengths.

    Args:
        cu_seqlens: integer ``[D+1]`` (one packed row, batch 1) or ``[B, D+1]`` (one row of boundaries
            per batch row): 0, then the end of each document, non-decreasing (a repeated value is an
            empty document, so rows with fewer documents can be padded by repeating their last
            value), last value <= ``seq_len``.
        seq_len: N, the length of the packed rows.

    Returns:
        int32 ``[B, N]`` (``B = 1`` for 1-D input), on cu_seqlens' device: token t gets the index d of
        the document ``cu_seqlens[d] <= t < cu_seqlens[d + 1]``. Tokens at or past ``cu_seqlens[-1]``
        (a tail not covered by any document, e.g. padding) form one more document, id D.

    Raises:
        ValueError: not an integer tensor of 1 or 2 dims; a row not starting at 0, decreasing, or
            ending past ``seq_len``; ``seq_len`` not an int >= 1.
    """
    seq_len = check_int("seq_len", seq_len, minimum=1)
    rows = _check_cu_seqlens(cu_seqlens, seq_len)
    positions = torch.arange(seq_len, device=rows.device, dtype=torch.int64).expand(rows.shape[0], seq_len)
    # the id of token t is the number of document ends <= t
    ends = rows[:, 1:].contiguous()
    ids = torch.searchsorted(ends, positions.contiguous(), right=True)
    return ids.to(torch.int32)


def cu_seqlens_from_document_ids(document_ids: Tensor) -> Tensor | list[Tensor]:
    """Cumulative document lengths of packed rows (the inverse of :func:`document_ids_from_cu_seqlens`).

    Args:
        document_ids: integer ``[N]`` (one row) or ``[B, N]``, non-decreasing, >= 0.

    Returns:
        For ``[N]``: int32 ``[D+1]`` (0, the end of each run of equal ids, ..., N), D the number of
        documents. For ``[B, N]``: a list of B such tensors (rows may hold different numbers of
        documents). Ids are renumbered: converting back gives 0, 1, ... in document order.

    Raises:
        ValueError: as :func:`check_document_ids`.
    """
    ids = check_integer_tensor("document_ids", document_ids)
    if ids.dim() not in (1, 2):
        raise ValueError(f"document_ids must be [N] or [B, N], got shape {tuple(ids.shape)}")
    rows = ids.view(1, -1) if ids.dim() == 1 else ids
    check_document_ids(rows, rows.shape[0], rows.shape[1], rows.device)
    out = []
    for row in rows:
        n = row.numel()
        starts = (row[1:] != row[:-1]).nonzero().view(-1) + 1
        bounds = [
            torch.zeros(1, dtype=torch.int64, device=row.device),
            starts,
            torch.full((1,), n, dtype=torch.int64, device=row.device),
        ]
        out.append(torch.cat(bounds).to(torch.int32))
    return out[0] if ids.dim() == 1 else out


def document_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """Document ids from the position ids of packed rows in which every document restarts its positions
    (transformers' ``DataCollatorWithFlattening``).

    Args:
        position_ids: integer ``[B, N]`` (or ``[N]`` for one row). A new document starts at t = 0 and
            wherever ``position_ids[t] != position_ids[t - 1] + 1``.

    Returns:
        int32 ``[B, N]`` (``[1, N]`` for 1-D input): 0 for the first document of each row, +1 at
        every start.

    Raises:
        ValueError: not an integer tensor of 1 or 2 dims.
    """
    pos = check_integer_tensor("position_ids", position_ids)
    if pos.dim() not in (1, 2) or pos.shape[-1] < 1:
        raise ValueError(f"position_ids must be [N] or [B, N] with N >= 1, got shape {tuple(pos.shape)}")
    rows = (pos.view(1, -1) if pos.dim() == 1 else pos).to(torch.int64)
    starts = torch.ones_like(rows, dtype=torch.int32)
    starts[:, 1:] = (rows[:, 1:] != rows[:, :-1] + 1).to(torch.int32)
    return (starts.cumsum(dim=1, dtype=torch.int32) - 1).to(torch.int32)


def document_positions(document_ids: Tensor) -> Tensor:
    """int64 ``[B, N]``: each token's offset from the first token of its document, i.e. the RoPE
    positions of packed rows whose positions restart at 0 for every document (``document_ids``
    integer ``[B, N]``, non-decreasing along N)."""
    pos = torch.arange(document_ids.shape[1], device=document_ids.device).view(1, -1)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return pos - torch.where(starts, pos, 0).cummax(dim=1).values


def random_document_lengths(total: int, low: int, high: int, seed: int) -> list[int]:
    """Document lengths drawn uniformly from ``[low, high]`` (a private generator seeded with ``seed``) until
    they cover ``total`` tokens, the last one cut to fit: the packed rows of the benchmarks and the tests.

    Raises:
        ValueError: ``total < 0`` or not ``1 <= low <= high``.
    """
    check_int("total", total, minimum=0)
    check_int("low", low, minimum=1)
    check_int("high", high, minimum=low)
    generator = torch.Generator().manual_seed(seed)
    lengths, covered = [], 0
    while covered < total:
        length = min(int(torch.randint(low, high + 1, (1,), generator=generator)), total - covered)
        lengths.append(length)
        covered += length
    return lengths


def block_document_ranges(document_ids: Tensor, block: int) -> Tensor:
    """First and last document id of every block of ``block`` tokens.

    Args:
        document_ids: integer ``[B, N]``, non-decreasing along N (not re-checked here: call
            :func:`check_document_ids` where the ids enter).
        block: tokens per block (BQ or BK), an int >= 1.

    Returns:
        ``[B, NB, 2]`` in document_ids' dtype, NB = ceil(N / block): ``[..., 0]`` the id of the block's
        first token, ``[..., 1]`` of its last real token (the last block may be partial). Since ids are
        non-decreasing these are the block's minimum and maximum: a query block and an earlier key
        block share no document iff ``last(key block) < first(query block)``, and every token pair of
        the two blocks is in one document iff all four ids are equal.

    Raises:
        ValueError: not a 2-D integer tensor, or ``block`` not an int >= 1.
    """
    ids = check_integer_tensor("document_ids", document_ids, dim=2)
    block = check_int("block", block, minimum=1)
    n = ids.shape[1]
    starts = torch.arange(0, n, block, device=ids.device)
    ends = torch.clamp(starts + block, max=n) - 1
    return torch.stack([ids[:, starts], ids[:, ends]], dim=-1)
