"""The block index: which key blocks each query block attends to, in one canonical form.

A selection is made per (batch, KV head, query block); the query heads of a GQA group share it, so a
kernel loads each selected K/V block once per group. Every consumer (Triton kernels, the PyTorch
reference, the selector, the benchmarks) reads the same structure, and exactly one function,
:func:`canonicalize`, establishes its invariants:

* ``indices``: int32 ``[B, HKV, NQB, K]``; each row strictly ascending and unique, padded with -1 at
  the end; every valid entry lies in ``[0, NKB)`` and is causally reachable from its query block
  (the block's first key is not after the query block's last query).
* ``counts``: int32 ``[B, HKV, NQB]``, the number of valid entries of each row.
* ``K`` (the capacity) is rounded up to a power-of-two tier so tensor shapes, and therefore compiled
  kernels and CUDA graphs, stay stable from step to step while the selection changes.

Candidates form a *set*: the union of the dynamic (learned top-k) blocks, the local window and the
sink blocks. A duplicate would count a key twice in the softmax denominator, so duplicates are
removed before attention. Notation: B batch, HKV key/value heads, N sequence length, BQ/BK query/key
block sizes, NQB = ceil(N / BQ), NKB = ceil(N / BK).

Packed documents (``document_ids`` ``[B, N]``, non-decreasing per row, see
:mod:`sparse_train.documents`): a key block is kept only if it shares at least one document with the
query block, so the window is per document too, and the sinks are the first blocks of each
document the query block holds instead of the first blocks of the row (:func:`canonicalize`).
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..documents import block_document_ranges
from ..kernels import triton_kernels
from ..plan.device import triton_runs_on
from ..plan.plan import BlockPlan, build_plan, resolve_r0
from ..validation import (
    check_capacity,
    check_choice,
    check_document_ids,
    check_geometry,
    check_int,
    check_integer_tensor,
    check_qkv,
    check_seq_lens,
    check_window_sinks,
    source_is_current,
)

__all__ = [
    "INDEX_CHECKS",
    "BlockIndex",
    "canonicalize",
    "check_block_index",
    "check_index_matches",
    "check_inputs",
    "capacity_tier",
    "causal_last_block",
    "document_sink_candidates",
    "shares_document",
]

_REPR_GRID_BLOCKS = 16  # repr draws the block grid (to_string) up to this many query blocks ...
_REPR_GRID_PAIRS = 2  # ... and (batch, KV head) pairs

INDEX_CHECKS = ("none", "cheap", "full")
"""Validation levels of :func:`canonicalize` / :meth:`BlockIndex.from_canonical`: ``"none"`` trusts the
caller, ``"cheap"`` rejects out-of-range and non-causal candidates, ``"full"`` also re-verifies every
canonical invariant of the result."""


def capacity_tier(count: int, num_k_blocks: int) -> int:
    """Smallest power of two >= ``count`` (at least 1), capped at ``num_k_blocks``.

    Rows never hold more than NKB distinct blocks, so the cap loses nothing; the power-of-two tiers
    keep the capacity (a tensor dimension) constant while the per-row counts wander.
    """
    tier = 1 << max(0, int(count) - 1).bit_length() if count > 1 else 1
    return max(1, min(tier, max(1, num_k_blocks)))


def causal_last_block(num_q_blocks: int, seq_len: int, block_q: int, block_k: int, device=None) -> Tensor:
    """For each query block i, the last causally reachable key block: ``(min((i+1)*BQ, N) - 1) // BK``.

    Returns int64 ``[NQB]``.
    """
    last_query = torch.clamp((torch.arange(num_q_blocks, device=device) + 1) * block_q, max=seq_len) - 1
    return last_query // block_k


def _fmt_row(row: tuple[int, ...]) -> str:
    return f"(batch={row[0]}, kv_head={row[1]}, query_block={row[2]})"


def _first_offender(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in bad.nonzero()[0].tolist())


def _check_selection_tensor(selected: Tensor, num_q_blocks: int, name: str) -> None:
    check_integer_tensor(name, selected)
    if selected.dim() != 4:
        raise ValueError(f"{name} must have shape [B, HKV, NQB, k] (4 dims), got {tuple(selected.shape)}")
    if selected.shape[2] != num_q_blocks:
        raise ValueError(
            f"{name} has {selected.shape[2]} query blocks in dim 2, but seq_len and block_q give NQB = {num_q_blocks}"
        )


def canonicalize(
    selected: Tensor,
    *,
    seq_len: int,
    block_q: int,
    block_k: int,
    window: int = 0,
    sinks: int = 0,
    capacity: int | None = None,
    check: str = "cheap",
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Turn candidate key blocks into canonical ``(indices, counts)``; the only place that does (for CUDA
    candidates without documents and with a given capacity the merge runs as one Triton kernel,
    ``kernels/triton/canonical.py``, with the same result; validation stays here).

    Args:
        selected: integer ``[B, HKV, NQB, k]`` candidate key-block ids (``k`` may be 0). ``-1`` marks
            an unused slot; duplicates are allowed and removed.
        seq_len: N. block_q / block_k: BQ / BK.
        window: number of local key blocks ending at the block that holds the query block's last
            query (clipped at 0). sinks: key blocks ``0 .. sinks-1`` (clipped to what is causal).
        capacity: K of the result, an int >= 1; ``None`` picks :func:`capacity_tier` of the longest
            row. A capacity above NKB is clamped to NKB (no row can hold more distinct blocks; the
            automatic tier has the same cap). A given capacity smaller than the longest row raises
            rather than dropping candidates, except with ``check="none"``, where the caller
            guarantees it and no host sync is made: a longer row is then cut to its ``capacity``
            lowest blocks (its count too), so no consumer reads past the row. A given capacity at
            least the number of candidates per row (``k`` + window + sink columns) needs no check.

            Host syncs: ``capacity=None`` reads the longest row (the tier is a data-dependent shape);
            ``check="cheap"`` / ``"full"`` read the validation flags (and the longest row when the
            capacity might be too small). With a given capacity and ``check="none"`` nothing is read
            back: the module's selection path.
        check: ``"cheap"`` (default) rejects out-of-range and non-causal candidates; ``"full"`` also
            re-verifies the produced invariants; ``"none"`` trusts the caller (candidates outside
            ``[0, NKB)`` or beyond the causal limit are then dropped silently).
        document_ids: optional integer ``[B, N]`` on ``selected``'s device, non-decreasing along N,
            values >= 0 (packed documents; checked like :func:`~sparse_train.validation.check_document_ids`,
            values only when ``check != "none"``). With it:

            * every candidate (dynamic, window, sink) is kept only if its key block shares at least
              one document with the query block; for causal blocks this is exactly "some query of
              the block may see some key of the block" (j <= i and the same document). The window is
              therefore per document: window blocks of other documents are dropped.
            * sinks are per document: the first ``sinks`` key blocks of the document holding the
              query block's first query (not the row's block 0), and the first ``sinks`` key blocks
              of every document that starts inside the query block (these lie among the query
              block's own key blocks); each clipped to the blocks of that document and to what is
              causal (:func:`document_sink_candidates`).

    ``window`` and ``sinks`` above NKB mean the same as NKB (both are clipped to what is causal).

    Returns:
        ``indices`` int32 ``[B, HKV, NQB, K]`` and ``counts`` int32 ``[B, HKV, NQB]``, on the device of
        ``selected``.

    Raises:
        ValueError: wrong dtype/shape, window/sinks not ints >= 0, capacity not an int >= 1, a
            candidate ``< -1``, ``>= NKB`` or not causally reachable (naming the first offending row and
            value), capacity too small; ``document_ids`` of the wrong shape, dtype or device, negative
            or decreasing (naming the first offending position).
    """
    seq_len, block_q, block_k = check_geometry(seq_len, block_q, block_k)
    _check_mode(check)
    num_q_blocks = math.ceil(seq_len / block_q)
    num_k_blocks = math.ceil(seq_len / block_k)
    _check_selection_tensor(selected, num_q_blocks, "selected")
    window, sinks = check_window_sinks(window, sinks)
    capacity = check_capacity(capacity, num_k_blocks)
    # Beyond NKB both select every causal block: clamp so a huge value cannot size a huge tensor.
    window, sinks = min(window, num_k_blocks), min(sinks, num_k_blocks)

    device = selected.device
    batch, kv_heads = selected.shape[0], selected.shape[1]
    check_document_ids(document_ids, batch, seq_len, device, values=check != "none")
    cand = selected.to(torch.int64)
    last = causal_last_block(num_q_blocks, seq_len, block_q, block_k, device).view(1, 1, -1, 1)

    if check != "none" and cand.numel() > 0:
        below = cand < -1
        beyond = cand >= num_k_blocks
        noncausal = (cand > last) & ~beyond
        bad = below | beyond | noncausal
        if bool(bad.any()):
            where = _first_offender(bad)
            value = int(cand[where])
            row = where[:3]
            if value < -1:
                why = "is negative (only -1 may mark an empty slot)"
            elif value >= num_k_blocks:
                why = f"is out of range [0, NKB={num_k_blocks})"
            else:
                why = (
                    f"is not causally reachable (the last reachable key block of this query block "
                    f"is {int(last.view(-1)[row[2]])})"
                )
            raise ValueError(f"candidate key block {value} at {_fmt_row(row)} slot {where[3]} {why}")

    candidate_width = max(1, selected.shape[-1] + window + sinks)
    if (
        document_ids is None
        and capacity is not None
        and (check == "none" or capacity >= candidate_width)
        and triton_runs_on(selected)
    ):
        indices, counts = triton_kernels().canonical.triton_canonical_merge(
            selected, seq_len=seq_len, block_q=block_q, block_k=block_k, window=window, sinks=sinks, capacity=capacity
        )
        if check == "full":
            _verify_canonical(indices, counts, seq_len, block_q, block_k)
        return indices, counts

    sentinel = num_k_blocks  # sorts after every valid block id
    pieces = [torch.where((cand >= 0) & (cand <= last), cand, sentinel)]
    if window > 0:
        offsets = torch.arange(-window + 1, 1, device=device).view(1, 1, 1, -1)
        win = (last + offsets).expand(batch, kv_heads, num_q_blocks, window)
        pieces.append(torch.where(win >= 0, win, sentinel))
    if sinks > 0 and document_ids is None:
        sink = torch.arange(sinks, device=device).view(1, 1, 1, -1)
        sink = sink.expand(batch, kv_heads, num_q_blocks, sinks)
        pieces.append(torch.where(sink <= last, sink, sentinel))
    elif sinks > 0:
        sink = document_sink_candidates(document_ids, sinks, seq_len=seq_len, block_q=block_q, block_k=block_k)
        sink = sink.unsqueeze(1).expand(batch, kv_heads, -1, -1)
        pieces.append(torch.where(sink >= 0, sink, sentinel))
    merged = torch.cat(pieces, dim=-1)
    if merged.shape[-1] == 0:
        merged = torch.full((batch, kv_heads, num_q_blocks, 1), sentinel, device=device, dtype=torch.int64)
    if document_ids is not None:
        same = shares_document(document_ids, merged.clamp(max=num_k_blocks - 1), block_q=block_q, block_k=block_k)
        merged = torch.where(same, merged, sentinel)

    merged, _ = torch.sort(merged, dim=-1)
    duplicate = torch.zeros_like(merged, dtype=torch.bool)
    duplicate[..., 1:] = merged[..., 1:] == merged[..., :-1]
    merged = torch.where(duplicate, sentinel, merged)
    merged, _ = torch.sort(merged, dim=-1)
    valid = merged < sentinel
    counts = valid.sum(dim=-1)

    # A capacity at least the candidate width can never be exceeded (nothing to check, no host read);
    # a trusted caller that fixes the capacity (check="none") skips the host sync of the max too.
    if capacity is None or (check != "none" and capacity < merged.shape[-1]):
        longest = int(counts.max()) if counts.numel() else 0
        if capacity is None:
            capacity = capacity_tier(longest, num_k_blocks)
        elif capacity < longest:
            raise ValueError(
                f"capacity={capacity} is smaller than the longest row ({longest} blocks); refusing to drop candidates"
            )
    if merged.shape[-1] >= capacity:
        merged = merged[..., :capacity]
        counts = counts.clamp(max=capacity)
    else:
        pad = torch.full((*merged.shape[:-1], capacity - merged.shape[-1]), sentinel, device=device, dtype=torch.int64)
        merged = torch.cat([merged, pad], dim=-1)
    indices = torch.where(merged < sentinel, merged, -1).to(torch.int32)
    counts = counts.to(torch.int32)
    if check == "full":
        _verify_canonical(indices, counts, seq_len, block_q, block_k)
    return indices.contiguous(), counts.contiguous()


def shares_document(document_ids: Tensor, key_blocks: Tensor, *, block_q: int, block_k: int) -> Tensor:
    """bool ``[B, H, NQB, M]``: key block ``key_blocks[b, h, i, m]`` shares at least one document with
    query block i of row b (their ranges of first/last document id intersect).

    Args:
        document_ids: integer ``[B, N]``, non-decreasing along N.
        key_blocks: integer ``[B, H, NQB, M]`` key-block ids in ``[0, NKB)``.

    For a causally reachable pair of blocks this is exactly "some query of the block may see some key
    of the other": either the key block lies before the query block and its last document is the
    query block's first, or the two overlap in positions and share a token."""
    q_docs = block_document_ranges(document_ids, block_q).to(torch.int64)  # [B, NQB, 2]
    k_docs = block_document_ranges(document_ids, block_k).to(torch.int64)  # [B, NKB, 2]
    batch, heads, nqb, width = key_blocks.shape
    flat = key_blocks.to(torch.int64).reshape(batch, heads * nqb * width)
    k_first = k_docs[..., 0].gather(1, flat).view(batch, heads, nqb, width)
    k_last = k_docs[..., 1].gather(1, flat).view(batch, heads, nqb, width)
    q_first = q_docs[..., 0].view(batch, 1, nqb, 1)
    q_last = q_docs[..., 1].view(batch, 1, nqb, 1)
    return (k_first <= q_last) & (k_last >= q_first)


def document_sink_candidates(document_ids: Tensor, sinks: int, *, seq_len: int, block_q: int, block_k: int) -> Tensor:
    """Per-document sink blocks of every query block: int64 ``[B, NQB, S]``, -1 in unused slots.

    For query block i of row b: the first ``sinks`` key blocks of the document holding the block's
    first query, and the first ``sinks`` key blocks of every document that starts inside the block;
    each list clipped to the key blocks holding tokens of that document and to the causally reachable
    blocks. A document starting inside the block starts in one of the block's own key blocks, so those
    sinks are found among the ``(BQ - 1) // BK + 2`` key blocks the query block overlaps: the width S
    is ``min(sinks, NKB)`` plus that number (fixed by the geometry, no host sync).

    Args:
        document_ids: integer ``[B, N]``, non-decreasing along N. sinks: an int >= 1.
    """
    device = document_ids.device
    batch = document_ids.shape[0]
    ids = document_ids.to(torch.int64)
    num_q_blocks = math.ceil(seq_len / block_q)
    num_k_blocks = math.ceil(seq_len / block_k)
    sinks = min(sinks, num_k_blocks)  # more sinks than key blocks are every block
    pos = torch.arange(seq_len, device=device)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    # the first position of the document each token belongs to
    doc_start = torch.where(starts, pos.view(1, -1), 0).cummax(dim=1).values  # [B, N]
    k_first_doc = block_document_ranges(document_ids, block_k)[..., 0].to(torch.int64)  # [B, NKB]
    q_start = torch.arange(num_q_blocks, device=device) * block_q  # [NQB]
    q_end = torch.clamp(q_start + block_q, max=seq_len)
    last = ((q_end - 1) // block_k).view(1, -1, 1)

    # the document of the block's first query: its first `sinks` key blocks
    first_doc = ids[:, q_start]  # [B, NQB]
    first_block = (doc_start[:, q_start] // block_k).unsqueeze(-1)  # [B, NQB, 1]
    own = first_block + torch.arange(sinks, device=device).view(1, 1, -1)
    own_ok = (own <= last) & (
        k_first_doc.gather(1, own.clamp(max=num_k_blocks - 1).flatten(1)).view_as(own) <= first_doc.unsqueeze(-1)
    )
    own = torch.where(own_ok, own, -1)

    # documents starting inside the block: key block j among the block's own key blocks is a sink of
    # one of them iff the latest document start at or before the block's last position inside j,
    # s, lies inside the query block and j is among the first `sinks` blocks from s's block (the
    # document of s holds that position of block j, so j holds tokens of it)
    span = (block_q - 1) // block_k + 2
    j = (q_start // block_k).view(1, -1, 1) + torch.arange(span, device=device).view(1, 1, -1)  # [1, NQB, span]
    in_span = j <= last
    probe = torch.minimum((j + 1) * block_k, q_end.view(1, -1, 1)) - 1
    probe = torch.where(in_span, probe, 0).expand(batch, -1, -1)
    latest = doc_start.gather(1, probe.flatten(1)).view_as(probe)  # [B, NQB, span]
    inner = in_span & (latest > q_start.view(1, -1, 1)) & (j - latest // block_k < sinks)
    inner = torch.where(inner, j.expand(batch, -1, -1), -1)
    return torch.cat([own, inner], dim=-1)


def _check_mode(check) -> None:
    check_choice("check", check, INDEX_CHECKS)


def _verify_canonical(indices: Tensor, counts: Tensor, seq_len: int, block_q: int, block_k: int) -> None:
    """Exhaustive check of every canonical invariant; raises ValueError naming the first bad row."""
    num_q_blocks = math.ceil(seq_len / block_q)
    num_k_blocks = math.ceil(seq_len / block_k)
    for name, t in (("indices", indices), ("counts", counts)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if indices.dtype != torch.int32 or counts.dtype != torch.int32:
        raise ValueError(f"indices and counts must be int32, got {indices.dtype} and {counts.dtype}")
    if indices.dim() != 4 or indices.shape[2] != num_q_blocks:
        raise ValueError(f"indices must be [B, HKV, NQB={num_q_blocks}, K], got {tuple(indices.shape)}")
    if counts.shape != indices.shape[:3]:
        raise ValueError(f"counts must be {tuple(indices.shape[:3])}, got {tuple(counts.shape)}")
    if indices.device != counts.device:
        raise ValueError(f"indices on {indices.device} but counts on {counts.device}")
    cap = indices.shape[-1]
    idx = indices.to(torch.int64)
    slot = torch.arange(cap, device=idx.device)
    should_be_valid = slot.view(1, 1, 1, -1) < counts.unsqueeze(-1).to(torch.int64)
    last = causal_last_block(num_q_blocks, seq_len, block_q, block_k, idx.device).view(1, 1, -1, 1)
    checks = [
        ("counts outside [0, K]", ((counts < 0) | (counts > cap)).unsqueeze(-1)),
        ("padding is not -1 after the valid entries", ~should_be_valid & (idx != -1)),
        ("a valid entry is outside [0, NKB)", should_be_valid & ((idx < 0) | (idx >= num_k_blocks))),
        ("a valid entry is not causally reachable", should_be_valid & (idx > last)),
        (
            "row is not strictly ascending",
            should_be_valid[..., 1:] & (idx[..., 1:] <= idx[..., :-1]),
        ),
    ]
    for message, bad in checks:
        if bool(bad.any()):
            where = _first_offender(bad)
            raise ValueError(f"invalid block index at {_fmt_row(where[:3])}: {message}")


def _valid_pairs(q_start: Tensor, q_end: Tensor, k_start: Tensor, k_end: Tensor) -> Tensor:
    """Number of (q, k) pairs with k <= q, q in [q_start, q_end), k in [k_start, k_end). int64, any shape."""
    width = k_end - k_start

    def prefix(x: Tensor) -> Tensor:  # sum over q <= x of clamp(q - k_start + 1, 0, width)
        t = x - k_start + 1
        inside = t * (t + 1) // 2
        beyond = width * (width + 1) // 2 + (t - width) * width
        return torch.where(t <= 0, torch.zeros_like(t), torch.where(t <= width, inside, beyond))

    return prefix(q_end - 1) - prefix(q_start - 1)


@dataclass(frozen=True, repr=False)
class BlockIndex:
    """Canonical block-sparse selection. Build it with :meth:`from_selection`, :meth:`from_dense`,
    :meth:`from_csr` or :meth:`full`; every path goes through :func:`canonicalize`.

    Fields:
        indices: int32 ``[B, HKV, NQB, K]``, rows strictly ascending, -1 padded at the end.
        counts: int32 ``[B, HKV, NQB]``.
        seq_len: N, the (padded) sequence length the index was built for.
        block_q / block_k: BQ / BK.

    Construction checks the metadata (dtypes, shapes, device, geometry; no data read); the canonical
    invariants of the values are checked by the constructors (or :meth:`validate`).
    """

    indices: Tensor
    counts: Tensor
    seq_len: int
    block_q: int
    block_k: int
    _cache: dict = field(default_factory=dict, compare=False)
    _external: bool = field(default=False, compare=False)
    """The tensors belong to the caller (:meth:`from_canonical`), who may rewrite them in place at any
    time: nothing derived from their values is cached."""

    def __post_init__(self) -> None:
        seq_len, block_q, block_k = check_geometry(self.seq_len, self.block_q, self.block_k)
        # frozen: store the normalised ints (e.g. numpy ints become Python ints)
        object.__setattr__(self, "seq_len", seq_len)
        object.__setattr__(self, "block_q", block_q)
        object.__setattr__(self, "block_k", block_k)
        check_block_index(self)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_selection(
        cls,
        selected: Tensor,
        *,
        seq_len: int,
        block_q: int = 64,
        block_k: int = 64,
        window: int = 0,
        sinks: int = 0,
        capacity: int | None = None,
        check: str = "cheap",
        document_ids: Tensor | None = None,
    ) -> BlockIndex:
        """Union of ``selected`` (int ``[B, HKV, NQB, k]``, may hold -1 and duplicates), the window and
        the sinks, made canonical; with ``document_ids`` (int ``[B, N]``) restricted to blocks that
        share a document with the query block, window and sinks per document. See
        :func:`canonicalize` for arguments and errors."""
        indices, counts = canonicalize(
            selected,
            seq_len=seq_len,
            block_q=block_q,
            block_k=block_k,
            window=window,
            sinks=sinks,
            capacity=capacity,
            check=check,
            document_ids=document_ids,
        )
        return cls(indices, counts, seq_len, block_q, block_k)

    @classmethod
    def from_dense(
        cls, mask: Tensor, *, seq_len: int, block_q: int = 64, block_k: int = 64, capacity: int | None = None
    ) -> BlockIndex:
        """From a bool block mask ``[B, HKV, NQB, NKB]``. A True entry above the causal limit raises."""
        seq_len, block_q, block_k = check_geometry(seq_len, block_q, block_k)
        num_q_blocks = math.ceil(seq_len / block_q)
        num_k_blocks = math.ceil(seq_len / block_k)
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
        if mask.dim() != 4 or mask.shape[2] != num_q_blocks or mask.shape[3] != num_k_blocks:
            raise ValueError(
                f"mask must have shape [B, HKV, NQB={num_q_blocks}, NKB={num_k_blocks}], got {tuple(mask.shape)}"
            )
        ids = torch.arange(num_k_blocks, device=mask.device, dtype=torch.int64)
        selected = torch.where(mask, ids, -1)
        return cls.from_selection(selected, seq_len=seq_len, block_q=block_q, block_k=block_k, capacity=capacity)

    @classmethod
    def full(
        cls,
        batch: int,
        num_kv_heads: int,
        seq_len: int,
        block_q: int = 64,
        block_k: int = 64,
        device=None,
        document_ids: Tensor | None = None,
        check: str = "cheap",
    ) -> BlockIndex:
        """Every causally reachable block for every query block (dense causal attention); with
        ``document_ids`` (int ``[B, N]``) every causal block that shares a document with the query
        block (dense attention with the document mask). The capacity is NKB. ``check="none"`` skips
        the value check of ``document_ids`` (the only host read here)."""
        seq_len, block_q, block_k = check_geometry(seq_len, block_q, block_k)
        batch = check_int("batch", batch, minimum=0)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        num_q_blocks = math.ceil(seq_len / block_q)
        # the last query block reaches key block NKB - 1, so a window of NKB covers every causal block
        window = math.ceil(seq_len / block_k)
        empty = torch.empty(batch, num_kv_heads, num_q_blocks, 0, dtype=torch.int32, device=device)
        # capacity NKB (the last query block's row; a shape, not a host read of the longest row)
        return cls.from_selection(
            empty,
            seq_len=seq_len,
            block_q=block_q,
            block_k=block_k,
            window=window,
            capacity=window,
            check=check,
            document_ids=document_ids,
        )

    @classmethod
    def from_csr(
        cls,
        indptr: Tensor,
        col_indices: Tensor,
        *,
        batch: int,
        num_kv_heads: int,
        seq_len: int,
        block_q: int = 64,
        block_k: int = 64,
        window: int = 0,
        sinks: int = 0,
        capacity: int | None = None,
        document_ids: Tensor | None = None,
    ) -> BlockIndex:
        """From a ragged CSR over rows ``r = (b*HKV + h)*NQB + i``: row r's candidates are
        ``col_indices[indptr[r]:indptr[r+1]]`` (any order, duplicates allowed). Both are integer
        tensors (a float would be truncated, so it raises). ``document_ids`` as in
        :meth:`from_selection`."""
        seq_len, block_q, block_k = check_geometry(seq_len, block_q, block_k)
        batch = check_int("batch", batch, minimum=0)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        check_integer_tensor("indptr", indptr)
        check_integer_tensor("col_indices", col_indices)
        num_q_blocks = math.ceil(seq_len / block_q)
        rows = batch * num_kv_heads * num_q_blocks
        if indptr.dim() != 1 or indptr.numel() != rows + 1:
            raise ValueError(f"indptr must be 1-D with B*HKV*NQB+1 = {rows + 1} entries, got {tuple(indptr.shape)}")
        if col_indices.dim() != 1:
            raise ValueError(f"col_indices must be 1-D, got {tuple(col_indices.shape)}")
        if indptr.device != col_indices.device:
            raise ValueError(f"indptr on {indptr.device} but col_indices on {col_indices.device}")
        indptr = indptr.to(torch.int64)
        lengths = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or bool((lengths < 0).any()) or int(indptr[-1]) != col_indices.numel():
            raise ValueError(
                f"indptr must start at 0, be non-decreasing and end at len(col_indices) ({col_indices.numel()})"
            )
        width = int(lengths.max()) if rows else 0
        row_of = torch.repeat_interleave(torch.arange(rows, device=indptr.device), lengths)
        slot = torch.arange(col_indices.numel(), device=indptr.device) - indptr[:-1][row_of]
        padded = torch.full((rows, width), -1, dtype=torch.int64, device=indptr.device)
        padded[row_of, slot] = col_indices.to(torch.int64)
        return cls.from_selection(
            padded.view(batch, num_kv_heads, num_q_blocks, width),
            seq_len=seq_len,
            block_q=block_q,
            block_k=block_k,
            window=window,
            sinks=sinks,
            capacity=capacity,
            document_ids=document_ids,
        )

    @classmethod
    def from_canonical(
        cls, indices: Tensor, counts: Tensor, *, seq_len: int, block_q: int, block_k: int, check: str = "full"
    ) -> BlockIndex:
        """Wrap tensors that are already canonical (e.g. a CUDA-graph-owned buffer). ``check="full"``
        verifies every invariant; ``"none"`` trusts the caller, who then owns the safety of the reads.

        The tensors stay the caller's: they are not copied, and the index caches nothing derived from
        them (:meth:`plan` rebuilds on every call), because the caller may rewrite them in place at
        any time, including through a CUDA-graph replay that no version counter sees. A plan built
        from this index is refused by ``sparse_attention`` after an eager in-place write (version
        counters); after a graph replay the caller must rebuild it."""
        seq_len, block_q, block_k = check_geometry(seq_len, block_q, block_k)
        _check_mode(check)
        if check != "none":
            _verify_canonical(indices, counts, seq_len, block_q, block_k)
        return cls(indices, counts, seq_len, block_q, block_k, _external=True)

    # ---------------------------------------------------------------- geometry
    @property
    def batch(self) -> int:
        return self.indices.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.indices.shape[1]

    @property
    def num_q_blocks(self) -> int:
        return self.indices.shape[2]

    @property
    def num_k_blocks(self) -> int:
        return math.ceil(self.seq_len / self.block_k)

    @property
    def capacity(self) -> int:
        return self.indices.shape[3]

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def to(self, device) -> BlockIndex:
        indices, counts = self.indices.to(device), self.counts.to(device)
        # same device: the same (possibly caller-owned) tensors
        external = self._external and indices is self.indices
        return BlockIndex(indices, counts, self.seq_len, self.block_q, self.block_k, _external=external)

    def validate(self) -> None:
        """Exhaustive re-check of every canonical invariant (ValueError naming the first bad row)."""
        _verify_canonical(self.indices, self.counts, self.seq_len, self.block_q, self.block_k)

    def check_compatible(self, q: Tensor, k: Tensor, v: Tensor, seq_lens: Tensor | None = None) -> None:
        """Raise ValueError unless q ``[B, HQ, N, D]``, k/v ``[B, HKV, N, D]`` and ``seq_lens`` (int
        ``[B]``, values in ``[0, N]``: one host sync) match this index and each other."""
        check_inputs(q, k, v, self, seq_lens)

    # ---------------------------------------------------------------- views
    def to_dense(self) -> Tensor:
        """bool ``[B, HKV, NQB, NKB]``: True where a query block selected a key block."""
        nkb = self.num_k_blocks
        idx = self.indices.to(torch.int64)
        target = torch.where(idx >= 0, idx, nkb)
        dense = torch.zeros((*idx.shape[:3], nkb + 1), dtype=torch.bool, device=idx.device)
        dense.scatter_(-1, target, True)
        return dense[..., :nkb]

    def to_csr(self) -> tuple[Tensor, Tensor]:
        """Ragged CSR over rows ``(b*HKV + h)*NQB + i``: (indptr int64 ``[rows+1]``, cols int32 ``[nnz]``)."""
        counts = self.counts.reshape(-1).to(torch.int64)
        indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
        indptr[1:] = torch.cumsum(counts, 0)
        cols = self.indices.reshape(-1, self.capacity)
        cols = cols[cols >= 0]
        return indptr, cols.to(torch.int32)

    def _selected_pairs(self) -> Tensor:
        """int64 ``[B, HKV]``: causally valid (q, k) element pairs inside the selected blocks."""
        n, bq, bk = self.seq_len, self.block_q, self.block_k
        idx = self.indices.to(torch.int64)
        qi = torch.arange(self.num_q_blocks, device=idx.device).view(1, 1, -1, 1)
        q_start, q_end = qi * bq, torch.clamp((qi + 1) * bq, max=n)
        k_start, k_end = idx * bk, torch.clamp((idx + 1) * bk, max=n)
        pairs = _valid_pairs(q_start, q_end, k_start, k_end)
        return torch.where(idx >= 0, pairs, 0).sum(dim=(-1, -2))

    def density(self) -> float:
        """Fraction of the causal area that is selected: causally valid (q, k) pairs inside selected
        blocks over ``N (N + 1) / 2``, averaged over batch and KV heads. 1.0 means dense causal."""
        causal = self.seq_len * (self.seq_len + 1) // 2
        return float(self._selected_pairs().to(torch.float64).mean()) / causal

    def is_full(self) -> bool:
        """True when every query block selects every causally reachable key block."""
        last = causal_last_block(self.num_q_blocks, self.seq_len, self.block_q, self.block_k, self.device)
        return bool((self.counts.to(torch.int64) == (last + 1).view(1, 1, -1)).all())

    def plan(self, r0: int | None = None) -> BlockPlan:
        """Derived views for the backward, cached per ``r0``. The cache is used only while the index
        tensors are the unmodified ones it was built from (version counters): an in-place write to
        ``indices`` / ``counts`` makes the next call rebuild. Indices wrapping caller-owned buffers
        (:meth:`from_canonical`) never cache, nor does anything while torch.compile traces. Builds
        read nothing back to the host (:func:`~sparse_train.plan.plan.build_plan`)."""
        r0 = resolve_r0(r0)
        # While torch.compile traces nothing is cached: a compiled step builds its plan once anyway,
        # and a plan stored on an index the module keeps would have to be rebuilt as a Python object
        # after the graph (dynamo cannot).
        caching = not self._external and not torch.compiler.is_compiling()
        cached = self._cache.get(("plan", r0)) if caching else None
        if cached is not None and source_is_current(cached.source, self):
            return cached
        plan = build_plan(self, r0)
        if caching:
            self._cache[("plan", r0)] = plan
        return plan

    # ---------------------------------------------------------------- inspection
    def __getitem__(self, key) -> BlockIndex:
        """The index restricted to some batches and/or KV heads: ``index[b]``, ``index[b, h]``,
        ``index[:, h]``, ``index[1:3]``, ... (ints and slices, negative ints allowed). The result is
        still a 4-D ``BlockIndex`` (an int keeps its dimension, with size 1) over the same sequence,
        block sizes and capacity; its tensors are views of this index's, like tensor slicing."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > 2:
            raise IndexError(f"BlockIndex takes [batch] or [batch, kv_head], got {len(key)} indices")
        picks = []
        for name, item, size in zip(("batch", "kv_head"), key, (self.batch, self.num_kv_heads)):
            if isinstance(item, slice):
                picks.append(item)
                continue
            if isinstance(item, bool) or not isinstance(item, numbers.Integral):
                raise TypeError(f"BlockIndex {name} index must be an int or a slice, got {type(item).__name__}")
            position = operator.index(item)
            if not -size <= position < size:
                raise IndexError(f"{name} index {position} is out of range for {size} {name} entries")
            position %= size
            picks.append(slice(position, position + 1))
        picks += [slice(None)] * (2 - len(picks))
        return BlockIndex(
            self.indices[picks[0], picks[1]],
            self.counts[picks[0], picks[1]],
            self.seq_len,
            self.block_q,
            self.block_k,
            _external=self._external,
        )

    def to_string(self, max_blocks: int = 32, max_pairs: int = 4) -> str:
        """The selection as a block grid per (batch, KV head): one line per query block, one character
        per key block: ``'█'`` selected, ``'.'`` causally reachable but not selected, nothing past the
        causal limit. At most ``max_blocks`` query and key blocks and ``max_pairs`` (batch, KV head)
        pairs are drawn; a last line says what was left out. One device-to-host copy of the selection."""
        max_blocks = check_int("max_blocks", max_blocks, minimum=1)
        max_pairs = check_int("max_pairs", max_pairs, minimum=1)
        nqb, nkb = self.num_q_blocks, self.num_k_blocks
        shown_q, shown_k = min(nqb, max_blocks), min(nkb, max_blocks)
        pairs = [(b, h) for b in range(self.batch) for h in range(self.num_kv_heads)]
        drawn_batches = min(self.batch, -(-max_pairs // max(1, self.num_kv_heads)))
        selected = self[:drawn_batches].to_dense()[..., :shown_q, :shown_k].cpu()
        last = causal_last_block(nqb, self.seq_len, self.block_q, self.block_k).tolist()
        lines = []
        for b, h in pairs[:max_pairs]:
            lines.append(f"batch {b}, kv_head {h}:")
            grid = selected[b, h].tolist()
            for i in range(shown_q):
                cells = ("█" if grid[i][j] else "." for j in range(min(shown_k, last[i] + 1)))
                lines.append("  " + "".join(cells))
        if not pairs:
            lines.append("(no batches)")
        if shown_q < nqb or shown_k < nkb:
            lines.append(f"(first {shown_q} of {nqb} query blocks and {shown_k} of {nkb} key blocks shown)")
        if len(pairs) > max_pairs:
            lines.append(f"({len(pairs) - max_pairs} more (batch, kv_head) pairs not shown)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        counts = self.counts.to(torch.float64)
        mean = float(counts.mean()) if counts.numel() else 0.0
        longest = int(self.counts.max()) if self.counts.numel() else 0
        summary = (
            f"BlockIndex(B={self.batch}, HKV={self.num_kv_heads}, N={self.seq_len}, "
            f"BQ={self.block_q}, BK={self.block_k}, NQB={self.num_q_blocks}, NKB={self.num_k_blocks}, "
            f"K={self.capacity}, blocks/row mean={mean:.1f} max={longest}, "
            f"density={self.density():.2%}, device={self.device})"
        )
        small = self.num_q_blocks <= _REPR_GRID_BLOCKS and self.batch * self.num_kv_heads <= _REPR_GRID_PAIRS
        return summary + "\n" + self.to_string(_REPR_GRID_BLOCKS, _REPR_GRID_PAIRS) if small else summary


# ---------------------------------------------------------------------------------------------- checks
def check_block_index(index) -> None:
    """Metadata of a BlockIndex (no data read): int32 ``indices [B, HKV, NQB, K>=1]`` and ``counts
    [B, HKV, NQB]`` on one device, NQB = ceil(seq_len / block_q). The canonical invariants of the
    values are `BlockIndex.validate`'s job (exhaustive, a host sync)."""
    if not isinstance(index, BlockIndex):
        raise ValueError(f"index must be a sparse_train.BlockIndex, got {type(index).__name__}")
    seq_len, block_q, _ = check_geometry(index.seq_len, index.block_q, index.block_k)
    indices, counts = index.indices, index.counts
    for name, t in (("indices", indices), ("counts", counts)):
        if not isinstance(t, Tensor) or t.dtype != torch.int32:
            raise ValueError(
                f"index.{name} must be an int32 tensor (build the index with BlockIndex.from_*), got "
                f"{getattr(t, 'dtype', type(t).__name__)}"
            )
    num_q_blocks = -(-seq_len // block_q)
    if indices.dim() != 4 or indices.shape[2] != num_q_blocks or indices.shape[3] < 1:
        raise ValueError(
            f"index.indices must have shape [B, HKV, NQB={num_q_blocks}, K>=1] for seq_len={seq_len}, "
            f"block_q={block_q}, got {tuple(indices.shape)}"
        )
    if counts.shape != indices.shape[:3]:
        raise ValueError(f"index.counts must have shape {tuple(indices.shape[:3])}, got {tuple(counts.shape)}")
    if counts.device != indices.device:
        raise ValueError(f"index.indices is on {indices.device} but index.counts on {counts.device}")


def check_inputs(q, k, v, index, seq_lens=None, *, seq_lens_values: bool = True, document_ids=None) -> int:
    """The compatibility rule of an attention input: ``index`` a well-formed BlockIndex, q/k/v valid
    (`check_qkv`) and built for it (`check_index_matches`), ``seq_lens`` and ``document_ids`` valid for
    them (`check_seq_lens`, `check_document_ids`; ``seq_lens_values=False`` skips the value checks of
    both, the host syncs). Returns the head dim D."""
    check_block_index(index)
    _, _, _, _, head_dim = check_qkv(q, k, v, device=index.device)
    check_index_matches(index, q, k)
    check_seq_lens(seq_lens, q.shape[0], q.shape[2], q.device, values=seq_lens_values)
    check_document_ids(document_ids, q.shape[0], q.shape[2], q.device, values=seq_lens_values)
    return head_dim


def check_index_matches(index, q: Tensor, k: Tensor) -> None:
    """The index was built for q/k's batch, KV heads, length and device."""
    bq, _, nq, _ = q.shape
    hkv = k.shape[1]
    if q.device != index.device:
        raise ValueError(f"q is on {q.device} but the block index is on {index.device}")
    if bq != index.batch or hkv != index.num_kv_heads:
        raise ValueError(
            f"block index is for batch={index.batch}, kv_heads={index.num_kv_heads} but k has "
            f"batch={bq}, kv_heads={hkv}"
        )
    if nq != index.seq_len:
        raise ValueError(f"block index is for seq_len={index.seq_len} but q/k/v have N={nq}")
