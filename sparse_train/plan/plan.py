"""The block plan: the derived views of a block index that the kernels walk.

The index (:mod:`sparse_train.index.block_index`) says *what* is attended; the plan says how the backward walks
it, and nothing here changes a result beyond floating-point order:

* :class:`BlockPlan` / :func:`build_plan`: per KV block its reuse count (how many query blocks
  selected it), the transposed KV-major CSR (for each KV block, the query blocks that selected it) and
  the hot/cold split of the hybrid backward (``reuse >= r0``: KV-centric kernel; else fp32 atomics
  from the dQ pass). Built once per step (cached by ``BlockIndex.plan``), shared by forward and backward;
  :func:`check_plan` checks that a plan belongs to the index it is used with.
* The backward's schedules: :func:`cold_slots` (compact atomic-workspace slot of each cold block) and
  :func:`kv_schedule` (KV-centric work items, long rows cut into chunks of query blocks),
  sized by :func:`cold_capacity` and :func:`kv_schedule_capacity`.

The tiles of each kernel are in :mod:`sparse_train.plan.tuning`, the device probes in
:mod:`sparse_train.plan.device`, the launch schedule of one call in :mod:`sparse_train.plan.launch`.

Every function is a pure function of its inputs (sorting and prefix sums, no atomics), so plans and
schedules are identical run to run. Nothing on the attention path reads device values back to the host:
every array has a length fixed by the shapes (index capacity, N, block sizes, options), padded with
entries the kernels skip, so a step is capturable in a CUDA graph and traceable by
``torch.compile(fullgraph=True)``; only the statistics properties of :class:`BlockPlan` sync, on demand.

Notation: B batch, HKV KV heads, G = HQ/HKV, D head dim, BQ/BK block sizes, NQB/NKB query/key blocks,
K index capacity, r0 reuse threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels import triton_kernels
from ..validation import PlanSource, check_r0, compiling, index_versions, plan_source
from .device import triton_runs_on

__all__ = [
    "DEFAULT_R0",
    "BlockPlan",
    "KVSchedule",
    "build_plan",
    "check_plan",
    "cold_capacity",
    "cold_slots",
    "kv_schedule",
    "kv_schedule_capacity",
    "resolve_r0",
]

DEFAULT_R0 = 1
"""Default reuse threshold of the hybrid backward: KV blocks selected by at least this many query
blocks take the KV-centric dK/dV kernel, the others accumulate with fp32 atomics from the dQ pass.
1 = every selected block KV-centric, no atomics (the fastest routing measured; see
``docs/benchmarks/kernel_tuning.md``); the atomic path stays available per call and in the config."""

# ---------------------------------------------------------------------------------------------- plan
_STAT_NAMES = ("num_hot", "num_cold", "nnz", "max_count", "max_reuse")


@dataclass(frozen=True)
class BlockPlan:
    """Derived views of a :class:`~sparse_train.BlockIndex`, built once per step and shared by forward
    and backward. All views are computed by sorting (no atomics), so they are identical run to run.

    Every tensor has a shape fixed by the index's shape (never by its values), and building a plan
    reads nothing back to the host, so it runs inside ``torch.compile(fullgraph=True)`` and CUDA-graph
    capture. The scalar statistics (:attr:`num_hot`, :attr:`nnz`, ...) live on the device in
    :attr:`stats`; reading one of those properties is a host sync (benchmarks, tests, ``repr``), and
    nothing on the attention path reads them."""

    reuse: Tensor
    """int32 ``[B, HKV, NKB]``: how many query blocks selected each KV block."""
    kv_indptr: Tensor
    """int64 ``[B*HKV*NKB + 1]``: row pointers of the transposed (KV-major) CSR; row
    ``r = (b*HKV + h)*NKB + j`` lists the query blocks that selected KV block j."""
    kv_qblocks: Tensor
    """int32 ``[B*HKV*NQB*K]`` (K the index capacity: one entry per index slot): query-block ids of the
    transposed CSR, ascending within each row, in ``[0, kv_indptr[-1])``; the entries past
    ``kv_indptr[-1]`` (= :attr:`nnz`) are -1 padding that no kernel reads."""
    kv_pairs: Tensor
    """int32 ``[B*HKV*NQB*K]``, beside :attr:`kv_qblocks`: where each transposed entry sits in the index, as
    the flat position ``((b*HKV + h)*NQB + query block)*K + t`` of ``indices`` (t its place in the query
    block's row); -1 in the padding. The stored-dS backward (``kernel_options.stored_ds``) files each
    (query block, key block) pair's dS under this position, where the dQ pass, walking the index rows,
    finds it."""
    hot: Tensor
    """bool ``[B, HKV, NKB]``: ``reuse >= r0``; hot blocks get the KV-centric dK/dV kernel, cold ones
    are accumulated with atomics from the query-centric pass."""
    r0: int
    """The reuse threshold this plan was built with."""
    stats: Tensor
    """int64 ``[5]`` on the device: ``num_hot, num_cold, nnz, max_count, max_reuse`` (read them through
    the properties of those names)."""
    source: PlanSource | None = field(default=None, compare=False)
    """The index this plan was built from (its tensors, held weakly, their version counters and the
    geometry). ``sparse_attention`` refuses a plan whose source is not the index passed: the backward
    would read another selection's arrays (out of bounds when shapes differ)."""
    _host_stats: list = field(default_factory=list, compare=False, repr=False)

    def _stat(self, name: str) -> int:
        if not self._host_stats:
            self._host_stats.extend(int(x) for x in self.stats.tolist())  # the one host read, on demand
        return self._host_stats[_STAT_NAMES.index(name)]

    @property
    def num_hot(self) -> int:
        """Number of KV blocks (over all batches and heads) with ``reuse >= r0`` and reuse > 0 (host sync)."""
        return self._stat("num_hot")

    @property
    def num_cold(self) -> int:
        """Number of selected KV blocks with ``0 < reuse < r0`` (host sync)."""
        return self._stat("num_cold")

    @property
    def nnz(self) -> int:
        """Total number of selected (query block, key block) pairs (host sync)."""
        return self._stat("nnz")

    @property
    def max_count(self) -> int:
        """Longest query-block row, in blocks (host sync)."""
        return self._stat("max_count")

    @property
    def max_reuse(self) -> int:
        """Largest reuse count of any KV block (host sync)."""
        return self._stat("max_reuse")

    def __repr__(self) -> str:
        return (
            f"BlockPlan(r0={self.r0}, hot={self.num_hot}, cold={self.num_cold}, nnz={self.nnz}, "
            f"max_count={self.max_count}, max_reuse={self.max_reuse}, device={self.reuse.device})"
        )


def resolve_r0(r0) -> int:
    """``r0`` checked (an int >= 0), None meaning :data:`DEFAULT_R0`."""
    r0 = check_r0(r0)
    return DEFAULT_R0 if r0 is None else r0


def build_plan(index, r0: int | None = None, query_blocks: Tensor | None = None) -> BlockPlan:
    """The :class:`BlockPlan` of ``index`` for reuse threshold ``r0`` (default :data:`DEFAULT_R0`).

    No host sync and no data-dependent shape: the transposed CSR is one sort of a key per index slot
    (``(kv_row * NQB + query block)`` for a valid slot, a sentinel that sorts last for a -1 slot), so
    ``kv_qblocks`` has one entry per slot and the valid pairs come first, in KV-major order with query
    blocks ascending. ``BlockIndex.plan`` caches the result; call that.

    ``query_blocks`` (int64 ``[NQL]``, checked by the caller: ``arguments.check_query_blocks``):
    the plan of the index rows of these query blocks only (context parallelism: one rank's query
    blocks), with LOCAL query-block ids (position in ``query_blocks``) in ``kv_qblocks``, ``reuse`` counting
    the listed blocks only and ``max_count`` over their rows. Such a plan is never cached and has no
    ``source`` (``check_plan`` refuses it as a ``kernel_options`` plan)."""
    r0 = resolve_r0(r0)
    if query_blocks is None:
        source = plan_source(index)
        indices, counts = index.indices, index.counts
    else:
        source = None
        indices = index.indices.index_select(2, query_blocks)
        counts = index.counts.index_select(2, query_blocks)
    b, h, nqb, cap = indices.shape
    nkb = index.num_k_blocks
    rows = b * h * nkb
    device = indices.device
    sentinel = rows * nqb
    # int32 keys sort faster; the sentinel (the largest key) decides whether they fit
    key_dtype = torch.int32 if sentinel < 2**31 else torch.int64
    idx = indices.to(key_dtype)
    bh = torch.arange(b * h, device=device, dtype=key_dtype).view(b, h, 1, 1)
    qi = torch.arange(nqb, device=device, dtype=key_dtype).view(1, 1, nqb, 1)
    # Each (kv_row, query block) pair occurs at most once, so sorting this key gives the KV-major
    # order with query blocks ascending, deterministically and without atomics.
    key = torch.where(idx >= 0, (bh * nkb + idx) * nqb + qi, sentinel).reshape(-1)
    key, position = torch.sort(key)  # position: each entry's flat slot in `indices`
    bounds = torch.arange(rows + 1, device=device, dtype=key_dtype) * nqb
    kv_indptr = torch.searchsorted(key, bounds).to(torch.int64)
    reuse = (kv_indptr[1:] - kv_indptr[:-1]).view(b, h, nkb)
    hot = (reuse >= r0) & (reuse > 0)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    stats = torch.stack(
        [
            hot.sum(),
            ((reuse > 0) & ~hot).sum(),
            kv_indptr[-1],
            counts.to(torch.int64).max() if counts.numel() else zero,
            reuse.max() if reuse.numel() else zero,
        ]
    )
    return BlockPlan(
        reuse=reuse.to(torch.int32),
        kv_indptr=kv_indptr,
        kv_qblocks=torch.where(key < sentinel, key % nqb, -1).to(torch.int32),
        kv_pairs=torch.where(key < sentinel, position, -1).to(torch.int32),
        hot=hot,
        r0=r0,
        stats=stats,
        source=source,
    )


def check_plan(plan, index, r0=None) -> None:
    """``plan`` was built by ``index.plan(r0)`` from the index's current contents. A plan of another
    index would make the backward read past its arrays."""
    if not isinstance(plan, BlockPlan):
        raise ValueError(f"plan must be a sparse_train.BlockPlan (from index.plan(r0)), got {type(plan).__name__}")
    if r0 is not None and r0 != plan.r0:
        raise ValueError(f"plan was built with r0={plan.r0} but r0={r0} was passed; pass one of them")
    source = plan.source
    if source is None:
        raise ValueError("plan has no source index; build plans with index.plan(r0)")
    geometry = (index.seq_len, index.block_q, index.block_k)
    if source.shape != tuple(index.indices.shape) or source.geometry != geometry:
        raise ValueError(
            f"plan was built for an index of shape {source.shape} and (seq_len, block_q, block_k)="
            f"{source.geometry}, but this index has shape {tuple(index.indices.shape)} and {geometry}; "
            "build it with index.plan(r0)"
        )
    if plan.reuse.device != index.device:
        raise ValueError(f"plan is on {plan.reuse.device} but the block index is on {index.device}")
    if compiling():
        return
    if source.indices() is not index.indices or source.counts() is not index.counts:
        raise ValueError("plan was built from a different BlockIndex than the one passed; build it with index.plan(r0)")
    if source.versions != index_versions(index):
        raise ValueError(
            "the index tensors were modified in place after this plan was built; rebuild it with index.plan(r0)"
        )


# ---------------------------------------------------------------------------------------------- backward schedule
def cold_slots(hot: Tensor, reuse: Tensor, every_block_hot: bool) -> Tensor:
    """int32 ``[B*HKV*NKB]``: compact atomic-workspace slot of every cold block (0 < reuse, not hot),
    -1 otherwise. ``every_block_hot`` (deterministic mode, the fused backward, r0 <= 1: no selected block
    is cold) gives all -1 in one op instead of five."""
    if every_block_hot:
        return torch.full((reuse.numel(),), -1, dtype=torch.int32, device=reuse.device)
    cold = ((reuse > 0) & ~hot).reshape(-1)
    slot = torch.cumsum(cold.to(torch.int32), 0, dtype=torch.int32) - 1
    return torch.where(cold, slot, -1).to(torch.int32)


def cold_capacity(num_kv_rows: int, r0: int, deterministic: bool) -> int:
    """Atomic-workspace blocks the backward allocates: every KV block may be cold when ``r0 >= 2``
    (``0 < reuse < r0``), none when ``r0 <= 1`` (every selected block is hot) or in deterministic mode.
    A bound from the shape (``num_kv_rows`` = B*HKV*NKB), so the workspace never waits on a count."""
    return 0 if deterministic or r0 <= 1 else num_kv_rows


def kv_schedule_capacity(num_kv_rows: int, num_q_blocks: int, num_slots: int, chunk: int) -> tuple[int, int]:
    """Upper bounds ``(items, parts)`` of :func:`kv_schedule` from shapes alone: ``num_kv_rows`` =
    B*HKV*NKB transposed rows, each of reuse <= ``num_q_blocks``, with at most ``num_slots`` (the
    index's B*HKV*NQB*K) pairs in all.

    A row of reuse r >= 1 takes ``ceil(r / chunk) = 1 + (r - 1) // chunk`` items, so all rows take at
    most ``rows + slots // chunk``; a chunked row (r > chunk) takes at most ``2 r / (chunk + 1)``
    partial slots (the worst ratio is at r = chunk + 1), so all of them at most
    ``2 * slots // (chunk + 1)``, and none when no row can exceed one chunk."""
    per_row = -(-num_q_blocks // chunk)
    items = min(num_kv_rows * per_row, num_kv_rows + num_slots // chunk)
    if num_q_blocks <= chunk:
        return items, 0
    chunked_rows = min(num_kv_rows, num_slots // (chunk + 1))
    return items, min(items, chunked_rows * per_row, 2 * num_slots // (chunk + 1))


class KVSchedule(NamedTuple):
    """Work items of the KV-centric dK/dV kernel (see :func:`kv_schedule`); arrays of fixed length,
    the items past the real ones marked by ``item_row = -1`` (the kernel returns at once)."""

    item_row: Tensor
    """int32 ``[I]``: KV row ``(b*HKV + h)*NKB + j`` of each work item, -1 for a padding item."""
    item_t0: Tensor
    """int32 ``[I]``: first position (in ``kv_qblocks``) of the item's chunk."""
    item_t1: Tensor
    """int32 ``[I]``: one past its last position."""
    item_part: Tensor
    """int32 ``[I]``: fp32 partial slot of the item, -1 when the item covers its whole row."""
    part_start: Tensor
    """int32 ``[R]``: first partial slot of each KV row (-1 when the row is not chunked)."""
    num_parts: Tensor
    """int32 ``[R]``: -1 unselected, 0 written directly (one chunk, or cold), else partials to sum."""
    total_parts: int
    """Number of fp32 partial slots to allocate (an upper bound from the shapes)."""


def kv_schedule(
    reuse: Tensor,
    kv_indptr: Tensor,
    slots: Tensor,
    chunk: int,
    *,
    num_items: int | None = None,
    num_parts: int | None = None,
) -> KVSchedule:
    """Work items of the KV-centric kernel: every KV block with reuse > 0 and no cold slot, its
    transposed row cut into chunks of ``chunk`` query blocks (``BackwardConfig.kv_chunk``), in row order.

    ``num_items`` / ``num_parts``: the lengths of the item arrays and the partial slots to provide
    (:func:`kv_schedule_capacity`); items past the real ones are padding (``item_row = -1``). Without
    them the schedule is sized exactly, which reads the two totals back to the host (tests, tools);
    the attention path always passes the bounds, so it never syncs.

    Sorting-free and atomic-free, so the schedule and the order in which the finish kernel sums
    partials are identical run to run. With the bounds given, CUDA arrays take one Triton kernel
    (``kernels/triton/schedule.py``, the same arrays); this PyTorch path is its reference."""
    if num_items is not None and num_parts is not None and triton_runs_on(reuse):
        return triton_kernels().schedule.triton_kv_schedule(
            reuse, kv_indptr, slots, chunk, num_items=num_items, num_parts=num_parts
        )
    reuse = reuse.reshape(-1).to(torch.int64)
    num_rows = reuse.numel()
    device = reuse.device
    kv_centric = (slots.reshape(-1) < 0) & (reuse > 0)
    num_chunks = torch.where(kv_centric, (reuse + chunk - 1) // chunk, 0)
    multi = num_chunks >= 2
    chunks_of_multi = torch.where(multi, num_chunks, 0)
    if num_items is None or num_parts is None:
        totals = torch.stack([num_chunks.sum(), chunks_of_multi.sum()]).tolist()  # host sync (exact sizes)
        num_items = int(totals[0]) if num_items is None else num_items
        num_parts = int(totals[1]) if num_parts is None else num_parts
    part_start = torch.cumsum(chunks_of_multi, 0) - chunks_of_multi
    row_parts = torch.where(reuse > 0, chunks_of_multi, -1).to(torch.int32)
    row_part_start = torch.where(multi, part_start, -1).to(torch.int32)
    items = torch.arange(num_items, device=device)
    if num_rows == 0:
        none = torch.full_like(items, -1, dtype=torch.int32)
        zeros = torch.zeros_like(none)
        return KVSchedule(none, zeros, zeros, none, row_part_start, row_parts, num_parts)
    item_end = torch.cumsum(num_chunks, 0)  # one past each row's last item
    real = items < item_end[-1]
    # the row of item i is the first row whose items end after i (padding items: clamped, then masked)
    rows = torch.searchsorted(item_end, items, right=True).clamp(max=num_rows - 1)
    c = items - (item_end - num_chunks)[rows]
    start = kv_indptr[:-1][rows] + c * chunk
    end = torch.minimum(start + chunk, kv_indptr[1:][rows])
    item_part = torch.where(real & multi[rows], part_start[rows] + c, -1)
    return KVSchedule(
        torch.where(real, rows, -1).to(torch.int32),
        torch.where(real, start, 0).to(torch.int32),
        torch.where(real, end, 0).to(torch.int32),
        item_part.to(torch.int32),
        row_part_start,
        row_parts,
        num_parts,
    )
