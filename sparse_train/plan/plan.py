"""Launch planning: everything that turns a block index into a kernel launch schedule.

The index (:mod:`sparse_train.index.block_index`) says *what* is attended; this module decides *how* the kernels
walk it, and nothing here changes a result beyond floating-point order:

* :class:`BlockPlan` / :func:`build_plan`: per KV block its reuse count (how many query blocks
  selected it), the transposed KV-major CSR (for each KV block, the query blocks that selected it) and
  the hot/cold split of the hybrid backward (``reuse >= r0``: KV-centric kernel; else fp32 atomics
  from the dQ pass). Built once per step (cached by ``BlockIndex.plan``), shared by forward and backward.
* The backward's schedules: :func:`cold_slots` (compact atomic-workspace slot of each cold block) and
  :func:`kv_schedule` (KV-centric work items, long rows cut into chunks of ``KV_CHUNK`` query blocks),
  sized by :func:`cold_capacity` and :func:`kv_schedule_capacity`.
* The forward's split count :func:`choose_num_splits` (split-KV only when the grid cannot fill the
  device, whose SM count :func:`device_sm_count` reads).
* Tile configurations: :func:`forward_config`, :func:`backward_config`, :func:`block_mass_config`
  (query heads stacked per program, warps, pipeline stages), tuned on an H200 at 64K
  (``docs/benchmarks/kernel_tuning.md``).
* The ``kernel_options`` mapping of :func:`sparse_train.sparse_attention`:
  :func:`normalize_kernel_options` is the one function that validates it (:data:`KERNEL_OPTIONS`).

Every function is a pure function of its inputs (sorting and prefix sums, no atomics), so plans and
schedules are identical run to run. Nothing on the attention path reads device values back to the host:
every array has a length fixed by the shapes (index capacity, N, block sizes, options), padded with
entries the kernels skip, so a step is capturable in a CUDA graph and traceable by
``torch.compile(fullgraph=True)``; only the statistics properties of :class:`BlockPlan` sync, on demand.

Notation: B batch, HKV KV heads, G = HQ/HKV, D head dim, BQ/BK block sizes, NQB/NKB query/key blocks,
K index capacity, r0 reuse threshold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping, NamedTuple

import torch
from torch import Tensor

from ..validation import PlanSource, check_bool, check_int, check_keys, check_r0, plan_source

__all__ = [
    "DEFAULT_R0",
    "AttentionSchedule",
    "KERNEL_OPTIONS",
    "KV_CHUNK",
    "BackwardConfig",
    "BlockPlan",
    "ForwardConfig",
    "KVSchedule",
    "KernelOptions",
    "attention_schedule",
    "backward_config",
    "block_mass_config",
    "build_plan",
    "check_fused_dq_allowed",
    "check_no_plan_with_query_blocks",
    "choose_num_splits",
    "cold_capacity",
    "cold_slots",
    "device_sm_count",
    "forward_config",
    "forward_num_splits",
    "kv_schedule",
    "kv_schedule_capacity",
    "normalize_kernel_options",
    "resolve_r0",
]

DEFAULT_R0 = 1
"""Default reuse threshold of the hybrid backward: KV blocks selected by at least this many query
blocks take the KV-centric dK/dV kernel, the others accumulate with fp32 atomics from the dQ pass.
1 = every selected block KV-centric, no atomics (the fastest routing measured; see
``docs/benchmarks/kernel_tuning.md``); the atomic path stays available per call and in the config."""

KV_CHUNK = 64
"""Query blocks per KV-centric work item: a KV block selected by more query blocks (a sink, a popular
block) is cut into chunks whose fp32 partials are summed in chunk order, so no program is the long pole."""


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

    ``query_blocks`` (int64 ``[NQL]``, checked by the caller: ``kernels.reference.check_query_blocks``):
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
    stats = torch.stack([
        hot.sum(),
        ((reuse > 0) & ~hot).sum(),
        kv_indptr[-1],
        counts.to(torch.int64).max() if counts.numel() else zero,
        reuse.max() if reuse.numel() else zero,
    ])
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


def kv_schedule(reuse: Tensor, kv_indptr: Tensor, slots: Tensor, chunk: int | None = None, *,
                num_items: int | None = None, num_parts: int | None = None) -> KVSchedule:
    """Work items of the KV-centric kernel: every KV block with reuse > 0 and no cold slot, its
    transposed row cut into chunks of ``chunk`` (default :data:`KV_CHUNK`) query blocks, in row order.

    ``num_items`` / ``num_parts``: the lengths of the item arrays and the partial slots to provide
    (:func:`kv_schedule_capacity`); items past the real ones are padding (``item_row = -1``). Without
    them the schedule is sized exactly, which reads the two totals back to the host (tests, tools);
    the attention path always passes the bounds, so it never syncs.

    Sorting-free and atomic-free, so the schedule and the order in which the finish kernel sums
    partials are identical run to run. With the bounds given, CUDA arrays take one Triton kernel
    (``kernels/triton/schedule.py``, the same arrays); this PyTorch path is its reference."""
    chunk = KV_CHUNK if chunk is None else chunk
    if num_items is not None and num_parts is not None and triton_runs_on(reuse):
        from ..kernels.triton.schedule import triton_kv_schedule

        return triton_kv_schedule(reuse, kv_indptr, slots, chunk, num_items=num_items, num_parts=num_parts)
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
    return KVSchedule(torch.where(real, rows, -1).to(torch.int32), torch.where(real, start, 0).to(torch.int32),
                      torch.where(real, end, 0).to(torch.int32), item_part.to(torch.int32), row_part_start,
                      row_parts, num_parts)


# ---------------------------------------------------------------------------------------------- split count
_HOST_CORES = os.cpu_count() or 1  # read once: torch.compile cannot trace os.cpu_count


def triton_runs_on(tensor: Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``'s device outside the interpreter: a CUDA tensor, with
    Triton importable. The selector's top-k, canonical-merge and draw kernels ask this; the attention and
    pooling kernels ask ``functional.choose_backend``, which also checks dtype, head dim and block sizes."""
    if tensor.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # missing or broken on this machine: the PyTorch paths
        return False
    return True


def copy_engine_loads(device) -> bool:
    """Whether the attention kernels can load tiles through TMA tensor descriptors on ``device``: a CUDA
    device of compute capability 9 (Hopper) or newer, or the CPU, where the Triton interpreter of the tests
    emulates them. ``kernels._launch.tma_descriptor`` adds the per-tensor layout rules."""
    device = torch.device(device)
    if device.type == "cuda":
        # get_device_properties, not get_device_capability: torch.compile folds it into a constant while it
        # traces the schedule of a compiled attention call
        return torch.cuda.get_device_properties(device).major >= 9
    return device.type == "cpu"


GLUON_TILE_ROWS = 64
"""Query rows per step of the Gluon KV-centric kernel: at D = 128 its two [BK, D] accumulators and two
[BK, 64] score tiles fit in 255 registers (H200, 64K: 32 rows 2-10% slower, 128 rows spill and run 1.4-1.9x
slower; docs/benchmarks/speed_round2/h200_probe_gluon_kv_session14.json)."""
GLUON_RING = 2
"""q/dO slices the Gluon KV-centric kernel keeps in flight (3: equal at D = 64, spills at D = 128)."""
GLUON_KEY_ROWS = 64
"""Key rows one Gluon KV-centric program takes: a 128-key block runs as two 64-row programs (4 warps each), so
two programs share an SM and one's softmax runs while the other's products do, as with 64-key blocks; one
128-row program of 8 warps filled the SM alone and kept the tensor pipe busy 55% of the time, two 64-row programs
64% (H200, 64K, D = 128, Nsight Compute); whole backward at P128 11.29 -> 10.53 ms (D = 128), 7.47 -> 6.77 ms
(D = 64), bitwise equal (docs/benchmarks/speed_round2/h200_probe_gluon_key_rows_session19.json)."""
GLUON_FWD_ROWS = 64
"""Query rows a Gluon forward program aims at (heads x BQ; one head for BQ >= 64): at head dim 64 over 64-key
blocks two such programs share an SM (H200, 64K: 1.99 ms against 2.13 with 128 rows, 2.58 with 256, and 2.24
for the Triton forward; docs/benchmarks/speed_round2/h200_probe_gluon_forward_session15.json)."""
GLUON_FWD_RING = 2
"""K/V tiles the Gluon forward keeps in flight."""
GLUON_DQ_RING = 2
"""K/V tiles the Gluon dQ kernel keeps in flight (ring slots in shared memory; 3: equal or slower on the H200,
and over 128 x 128 key tiles at D = 128 more shared memory than a program has)."""
GLUON_DQ_ROWS = 64
"""Query rows a Gluon dQ program aims at (heads x BQ; one head for BQ = 128). 64 rows (4 warps) let two programs
share an SM, one computing its softmax while the other's products run: on the H200 at 64K, P64, the whole
backward took 10.01 against 10.46 ms with 128 rows at D = 128, 6.01 against 6.64 at D = 64
(docs/benchmarks/speed_round2/h200_probe_gluon_backward_session15_p64_heads.json). The Triton dQ kernel keeps
its 128 rows (with one head at BQ = 64 it took 17.5 ms)."""


def gluon_kernels(device) -> bool:
    """Whether the hand-scheduled Gluon kernels can run on ``device``: a Hopper GPU (compute capability
    9; its warpgroup MMAs and TMA) and a triton that has Gluon."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_properties(device).major != 9:
        return False
    from ..kernels.gluon.backward import HAS_GLUON
    return HAS_GLUON


def device_sm_count(device) -> int:
    """Parallel processors of ``device``: the streaming multiprocessors of a CUDA device; the CPU
    cores elsewhere (the Triton interpreter runs programs on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _HOST_CORES


def choose_num_splits(num_programs: int, max_count: int, num_sms: int) -> int:
    """Split rule of the forward: split a row only when the grid is too small to fill the device
    (fewer than 2 waves of programs) and rows are long enough (>= 8 blocks per split) to amortise the
    partial write-back and the merge kernel. Returns a power of two in {1, 2, 4, 8}."""
    splits = 1
    while splits < 8 and num_programs * splits < 2 * num_sms and max_count >= 16 * splits:
        splits *= 2
    return splits


def forward_num_splits(query_blocks: int, batch: int, kv_heads: int, group: int, heads_per_program: int,
                       max_count: int, device) -> int:
    """:func:`choose_num_splits` for a forward grid of ``query_blocks`` live query blocks per (batch,
    KV head), each split over ``group // heads_per_program`` head subsets."""
    programs = query_blocks * (group // heads_per_program) * batch * kv_heads
    return choose_num_splits(programs, max_count, device_sm_count(device))


# ---------------------------------------------------------------------------------------------- kernel options
_WARPS = (1, 2, 4, 8, 16)
_MAX_STAGES = 8
_MAX_SPLITS = 64
_MIN_DOT_ROWS = 16  # smallest row count of a tensor-core tile product (tl.dot)


@dataclass(frozen=True)
class KernelOptions:
    """Normalised ``kernel_options`` (see :func:`normalize_kernel_options`); None = default."""

    plan: BlockPlan | None = None
    """A plan from ``index.plan(r0)`` of this very index, reused across layers (default: that call)."""
    r0: int | None = None
    """Reuse threshold of the hybrid backward (default :data:`DEFAULT_R0`); equals ``plan.r0`` if both."""
    num_splits: int | None = None
    """Split-KV count of the forward, 1..64 (default :func:`choose_num_splits`)."""
    fwd_heads_per_program: int | None = None
    """Query heads of a GQA group stacked along the rows of one forward program (a power of two
    dividing G; the tile has heads_per_program * BQ rows)."""
    fwd_num_warps: int | None = None
    fwd_num_stages: int | None = None
    dq_heads_per_program: int | None = None
    dq_num_warps: int | None = None
    dq_num_stages: int | None = None
    kv_heads_per_program: int | None = None
    kv_num_warps: int | None = None
    kv_num_stages: int | None = None
    kv_chunk: int | None = None
    """Query blocks per KV-centric work item (default :data:`KV_CHUNK`)."""
    kv_tile_rows: int | None = None
    """Query rows the KV-centric kernel takes per step (a power of two >= 16 dividing
    kv_heads_per_program * BQ; default the whole tile): thinner slices keep fewer scores live."""
    fwd_tma: bool | None = None
    """Forward: load the K/V tiles through TMA tensor descriptors (Hopper and newer; pointer loads where
    a tensor's strides or alignment do not allow a descriptor). Default on (H200, 64K: 5-12% faster at
    three of four shapes, equal at the fourth)."""
    dq_tma: bool | None = None
    """dQ kernel: load the K/V tiles through TMA tensor descriptors (as ``fwd_tma``). Default on (H200, 64K:
    4-12% faster)."""
    kv_tma: bool | None = None
    """KV-centric kernel: load the q/dO row slices through TMA tensor descriptors (one head per step and
    no query-block map only; pointer loads otherwise). Default on except over 128 x 128 key tiles, where
    it measured slower."""
    fused_dq: bool | None = None
    """One backward pass: the KV-centric kernel also adds each tile's dQ share into a float32 buffer with
    atomics, and the dQ kernel does not run (5 tile products per block pair instead of 7). Every block is
    then KV-centric. The atomics sum in no fixed order, so dQ is not bitwise reproducible: refused with
    ``deterministic``. Default off: measured slower on the H200 (the atomics cost more than the saved
    recomputation; :mod:`sparse_train.kernels.triton.backward`)."""
    stored_ds: bool | None = None
    """The KV-centric kernel stores every tile's dS (in q's dtype, the operand the dQ product takes) in a
    buffer of ``B*HQ*NQB*K*BQ*BK`` elements (K the index capacity), and the dQ kernel reads it instead of
    recomputing S and dP: 5 tile products per block pair instead of 7, no atomics (deterministic). Every
    block is then KV-centric (``r0`` does not apply). Excludes ``fused_dq``. Default off: on the H200 at 64K
    the backward is 2-8% faster (0.98-1.08x by shape), for about 8 GB more peak memory at B = 1, HQ = 32
    (docs/benchmarks/speed_round2/README.md, thirteenth session)."""
    kv_gluon: bool | None = None
    """The KV-centric dK/dV kernel hand-scheduled in Gluon (:mod:`sparse_train.kernels.gluon.backward`:
    q/dO slices prefetched by TMA, asynchronous warpgroup MMAs) instead of the Triton one, where it applies
    (Hopper, no dropout, sequence lengths or query-block map, N a multiple of the blocks, neither
    ``fused_dq`` nor ``stored_ds``; the Triton kernel runs elsewhere). Same products in the same order: the
    gradients equal the Triton kernel's. Default on where :func:`gluon_kernels` holds (H200, 64K: the
    backward 9-15% faster; docs/benchmarks/speed_round2/README.md, fourteenth session)."""
    fwd_gluon: bool | None = None
    """The forward hand-scheduled in Gluon (:mod:`sparse_train.kernels.gluon.forward`: the q tile in shared
    memory, K/V tiles prefetched by TMA into a ring, asynchronous warpgroup MMAs) instead of the Triton one, where
    it applies (Hopper, no dropout, sequence lengths, query-block map or split rows, N a multiple of
    the blocks); same products in the same order, so the outputs equal the Triton forward's bit for bit. Default
    on where :func:`gluon_kernels` holds and the head dim and key blocks are 64, the one shape where it measured
    faster (H200, 64K: 11%; 3-17% slower at D = 128 and over 128-key blocks)."""
    dq_gluon: bool | None = None
    """The dQ kernel hand-scheduled in Gluon (:mod:`sparse_train.kernels.gluon.backward`: K/V tiles
    prefetched by TMA into a ring, asynchronous warpgroup MMAs) instead of the Triton one, where it applies
    (as ``kv_gluon``, and no cold block: the atomic dK/dV products of cold blocks stay in the Triton kernel).
    Same products in the same order: dQ equals the Triton kernel's bit for bit. Default on where
    :func:`gluon_kernels` holds (H200, 64K, whole backward with the Gluon KV-centric kernel: 2.6-5% faster;
    docs/benchmarks/speed_round2/README.md, fifteenth session)."""


KERNEL_OPTIONS = tuple(f.name for f in fields(KernelOptions))
"""Keys of ``sparse_attention(..., kernel_options=)`` (the fields of :class:`KernelOptions`); every
value may be None (= the default)."""


def _check_power_of_two(label: str, value) -> int:
    value = check_int(label, value, minimum=1)
    if value & (value - 1):
        raise ValueError(f"{label} must be a power of two, got {value}")
    return value


def normalize_kernel_options(kernel_options: Mapping | KernelOptions | None) -> KernelOptions:
    """The one validation of ``kernel_options``: None, a :class:`KernelOptions`, or a dict whose keys
    are among :data:`KERNEL_OPTIONS` (an unknown key raises ``ValueError`` naming it and the allowed
    keys) and whose values are None or of the key's type and range (``ValueError`` otherwise).

    Shape-dependent rules (heads per program must divide the GQA group; a plan must belong to the
    index) are checked where the shapes are known: :func:`forward_config`, :func:`backward_config`,
    ``validation.check_plan``."""
    if kernel_options is None:
        return KernelOptions()
    if isinstance(kernel_options, KernelOptions):
        return kernel_options
    check_keys("kernel_options", kernel_options, KERNEL_OPTIONS)
    values = {}
    for name, value in kernel_options.items():
        label = f"kernel_options.{name}"
        if value is None:
            continue
        if name == "plan":
            if not isinstance(value, BlockPlan):
                raise ValueError(
                    f"{label} must be a sparse_train.BlockPlan (from index.plan(r0)), got {type(value).__name__}"
                )
        elif name == "r0":
            value = check_int(label, value, minimum=0)
        elif name == "num_splits":
            value = check_int(label, value, minimum=1, maximum=_MAX_SPLITS)
        elif name.endswith("heads_per_program"):
            value = _check_power_of_two(label, value)
        elif name.endswith("num_warps"):
            value = _check_power_of_two(label, value)
            if value not in _WARPS:
                raise ValueError(f"{label} must be one of {_WARPS}, got {value}")
        elif name.endswith("num_stages"):
            value = check_int(label, value, minimum=1, maximum=_MAX_STAGES)
        elif name == "kv_chunk":
            value = check_int(label, value, minimum=1)
        elif name == "kv_tile_rows":
            value = _check_power_of_two(label, value)
            if value < _MIN_DOT_ROWS:
                raise ValueError(f"{label} must be >= {_MIN_DOT_ROWS} (tensor-core tile), got {value}")
        elif name in ("fused_dq", "stored_ds", "fwd_tma", "dq_tma", "kv_tma", "kv_gluon", "dq_gluon",
                      "fwd_gluon"):
            value = check_bool(label, value)
        values[name] = value
    if values.get("fused_dq") and values.get("stored_ds"):
        raise ValueError("kernel_options.fused_dq and kernel_options.stored_ds are two ways of producing dQ "
                         "from the KV-centric kernel; set at most one of them")
    return KernelOptions(**values)


# ---------------------------------------------------------------------------------------------- tile configs
class ForwardConfig(NamedTuple):
    """Launch configuration of the forward (and block-mass) kernel."""

    heads_per_program: int
    num_warps: int
    num_stages: int
    tma_loads: int = 0
    """1: the per-iteration K/V tiles come through TMA descriptors where the tensors allow one (an int so
    that the config travels as the custom op's int list)."""
    gluon: int = 0
    """1: the Gluon forward runs where it applies (``KernelOptions.fwd_gluon``)."""
    gluon_heads_per_program: int = 1
    """Query heads per Gluon forward program (:data:`GLUON_FWD_ROWS`)."""
    gluon_stages: int = 2
    """Depth of the Gluon forward's K/V ring in shared memory (:data:`GLUON_FWD_RING`)."""


class BackwardConfig(NamedTuple):
    """Launch configuration of the backward: the dQ kernel, the KV-centric kernel, its chunk size."""

    dq_heads_per_program: int
    dq_num_warps: int
    dq_num_stages: int
    kv_heads_per_program: int
    kv_num_warps: int
    kv_num_stages: int
    kv_chunk: int
    kv_tile_rows: int
    fused_dq: int = 0
    """1: dQ comes from the KV-centric kernel (``KernelOptions.fused_dq``); an int so that the config travels
    as the custom op's int list."""
    dq_tma: int = 0
    """1: the dQ kernel loads its K/V tiles through TMA descriptors (``KernelOptions.dq_tma``)."""
    kv_tma: int = 0
    """1: the KV-centric kernel loads its q/dO slices through TMA descriptors (``KernelOptions.kv_tma``)."""
    stored_ds: int = 0
    """1: the KV-centric kernel stores dS and the dQ kernel reads it (``KernelOptions.stored_ds``)."""
    kv_gluon: int = 0
    """1: the KV-centric dK/dV run the Gluon kernel where it applies (``KernelOptions.kv_gluon``)."""
    gluon_tile_rows: int = 64
    """Query rows per step of the Gluon kernel (:data:`GLUON_TILE_ROWS`)."""
    gluon_stages: int = 2
    """Depth of the Gluon kernel's q/dO ring in shared memory (:data:`GLUON_RING`)."""
    dq_gluon: int = 0
    """1: dQ runs the Gluon kernel where it applies (``KernelOptions.dq_gluon``)."""
    dq_gluon_stages: int = 2
    """Depth of the Gluon dQ kernel's K/V ring in shared memory (:data:`GLUON_DQ_RING`)."""
    dq_gluon_heads_per_program: int = 1
    """Query heads per Gluon dQ program (:data:`GLUON_DQ_ROWS`); ``dq_heads_per_program`` stays the Triton
    kernel's, which runs where the Gluon one does not apply."""
    gluon_key_rows: int = GLUON_KEY_ROWS
    """Key rows per Gluon KV-centric program (:data:`GLUON_KEY_ROWS`; at most BK)."""


def _heads_per_program(group: int, block_q: int, rows: int) -> int:
    """Query heads stacked into one program's row tile, aiming at ``rows`` = heads * BQ rows (one
    head for BQ = 128); the largest power of two <= that which divides the group."""
    heads = max(1, rows // block_q) if block_q < 128 else 1
    while heads > 1 and group % heads:
        heads //= 2
    return min(heads, group)


def _flag(option: bool | None, default: bool) -> int:
    """A boolean kernel option as the int a launch config carries: the option where set, else ``default``."""
    return int(default if option is None else option)


def _divides_group(label: str, heads: int, group: int) -> int:
    if group % heads:
        raise ValueError(f"{label}={heads} must divide the GQA group size {group} (query heads per KV head)")
    return heads


def forward_config(group: int, block_q: int, block_k: int, head_dim: int,
                   kernel_options: Mapping | KernelOptions | None = None, device=None) -> ForwardConfig:
    """Forward tile: heads * BQ = 256 rows at head dim >= 128 (K/V loaded once for 4 heads at BQ = 64), 128
    rows below (at D = 64 the K/V loads are half as large and the smaller tile gives twice the programs:
    2 heads 11% faster than 4 on the H200); 8 warps once a [rows, max(D, BK)] tile reaches 128 x 64
    elements, 4 below, 3 stages (2 for 256-row tiles over 128-key blocks: shared memory); but 4 warps and 2
    stages below head dim 128 over 128-key blocks; K/V through TMA descriptors where ``device`` takes them
    (:func:`copy_engine_loads`; None: assumed). Measured: docs/benchmarks/kernel_tuning.md,
    docs/benchmarks/speed_round2/. ``kernel_options`` override each field."""
    options = normalize_kernel_options(kernel_options)
    heads = options.fwd_heads_per_program or _heads_per_program(group, block_q, rows=256 if head_dim >= 128 else 128)
    _divides_group("kernel_options.fwd_heads_per_program", heads, group)
    rows = heads * block_q
    if head_dim < 128 and block_k >= 128:
        # measured (64K, D = 64, 128-blocks): 4 warps / 2 stages 2.41 ms, 4 / 3 2.57, 8 / 3 3.05 (255 registers,
        # no spill at 4 warps)
        warps, stages = 4, 2
    else:
        warps = 8 if rows * max(head_dim, block_k) >= 128 * 64 else 4
        stages = 2 if (rows >= 256 and block_k >= 128) else 3
    # TMA K/V loads: 4.17 -> 3.67 ms (P128, D = 128), 3.65 -> 3.45 (P64), 2.47 -> 2.32 (P128, D = 64), equal
    # at P64, D = 64 (H200, 64K: docs/benchmarks/speed_round2/h200_probe_tma_session12.json)
    tma = _flag(options.fwd_tma, device is None or copy_engine_loads(device))
    gluon = _flag(options.fwd_gluon, head_dim == 64 and block_k == 64 and device is not None
                  and gluon_kernels(device))
    gluon_heads = options.fwd_heads_per_program or _heads_per_program(group, block_q, rows=GLUON_FWD_ROWS)
    return ForwardConfig(heads, options.fwd_num_warps or warps, options.fwd_num_stages or stages, tma, gluon,
                         gluon_heads, GLUON_FWD_RING)


def backward_config(group: int, block_q: int, block_k: int, head_dim: int, has_cold: bool,
                    kernel_options: Mapping | KernelOptions | None = None, device=None,
                    query_map: bool = False) -> BackwardConfig:
    """Backward tiles: dQ with heads * BQ = 128 rows, 8 warps when [rows, max(D, BK)] exceeds 64 x 128, 3
    stages (2 with 4 warps; with 128 x 128 key tiles 2, or 1 when the atomic dK/dV products also run:
    shared memory); KV-centric one head per iteration (stacking more spills registers: the [BK, D]
    dK/dV accumulators already live in registers), taking its query tile in row slices: 128 x 128 key
    tiles 8 warps, 2 stages, 64-row slices; 64 x 128 key tiles 4 warps, 3 stages, 32-row slices (128 x 64:
    2 stages);
    smaller 4 warps, 3 stages, the whole tile (measured on the H200: docs/benchmarks/kernel_tuning.md).
    TMA loads where ``device`` takes them (:func:`copy_engine_loads`; None: assumed): the dQ kernel's K/V
    tiles; the KV-centric kernel's q/dO slices with one head per step, without a query-block map
    (``query_map``) and except over 128 x 128 key tiles without ``stored_ds`` (3 stages then at D = 64 over
    128-key blocks, 2 with pointer loads). The Gluon KV-centric kernel (``kv_gluon``) where
    :func:`gluon_kernels` holds for ``device`` (None: not assumed), with its own tiles (:data:`GLUON_TILE_ROWS`,
    :data:`GLUON_RING`, :data:`GLUON_KEY_ROWS`), and likewise the Gluon dQ kernel (``dq_gluon``; :data:`GLUON_DQ_ROWS`,
    :data:`GLUON_DQ_RING`); the Triton kernels' fields stay as above for the calls they cover.
    ``kernel_options`` override each field (``dq_heads_per_program`` both dQ kernels' heads)."""
    options = normalize_kernel_options(kernel_options)
    dq_heads = options.dq_heads_per_program or _heads_per_program(group, block_q, rows=128)
    _divides_group("kernel_options.dq_heads_per_program", dq_heads, group)
    kv_heads = options.kv_heads_per_program or 1
    _divides_group("kernel_options.kv_heads_per_program", kv_heads, group)
    # the [rows, D] dQ accumulator and the [rows, BK] scores and dP live at once: 8 warps once either reaches
    # 128 x 128 (at D = 64 with 128-key blocks 4 warps spilled 150 slots on the H200)
    dq_warps = 8 if dq_heads * block_q * max(head_dim, block_k) > 64 * 128 else 4
    if block_k * head_dim >= 128 * 128:
        dq_stages = 1 if has_cold else 2
    else:
        dq_stages = 3 if dq_warps == 8 else 2
    # TMA q/dO loads in the KV-centric kernel (H200, 64K): 7.1 -> 6.5 ms (P64, D = 128), 3.9 -> 3.7 (P64,
    # D = 64), 5.5 -> 4.5 (P128, D = 64, with 3 stages); slower over 128 x 128 key tiles (7.6 -> 8.3)
    # with stored dS (whose slices then leave by TMA stores too) also over 128 x 128 key tiles: 10.9 -> 10.3 ms
    tma = device is None or copy_engine_loads(device)
    kv_tma = _flag(options.kv_tma, tma and kv_heads == 1 and not query_map
                   and (block_k * head_dim < 128 * 128 or bool(options.stored_ds)))
    # TMA K/V loads in the dQ kernel (H200, 64K): 5.49 -> 4.85 ms (P64, D = 128), 5.47 -> 4.98 (P128, D = 128),
    # 2.92 -> 2.80 (P64, D = 64), 3.36 -> 3.10 (P128, D = 64)
    dq_tma = _flag(options.dq_tma, tma)
    # the row slice bounds the scores (S^T and dP^T, [BK, rows] fp32) live beside the accumulators
    if block_k * head_dim >= 128 * 128:
        kv_warps, kv_stages, kv_slice = 8, 2, 64
    elif block_k * head_dim >= 64 * 128:
        # 128-key blocks at D = 64: with pointer loads 2 stages (5.5 ms against 6.1 with 3 on the H200, fewer
        # spills); with TMA loads 3 (4.5 ms against 5.5 with 2)
        kv_warps, kv_stages, kv_slice = 4, 3 if block_k < 128 or kv_tma else 2, 32
    else:
        kv_warps, kv_stages, kv_slice = 4, 3, None
    # the Gluon KV-centric kernel where it applies (H200, 64K, whole backward: P64 11.5 -> 10.1 ms, P128
    # 13.7 -> 11.7 at D = 128; 6.8 -> 6.2 and 8.3 -> 7.5 at D = 64)
    kv_gluon = _flag(options.kv_gluon, device is not None and gluon_kernels(device))
    dq_gluon = _flag(options.dq_gluon, device is not None and gluon_kernels(device))
    dq_gluon_heads = options.dq_heads_per_program or _heads_per_program(group, block_q, rows=GLUON_DQ_ROWS)
    kv_rows = kv_heads * block_q
    kv_tile_rows = options.kv_tile_rows or min(kv_rows, kv_slice or kv_rows)
    if kv_tile_rows > kv_rows:
        raise ValueError(f"kernel_options.kv_tile_rows={kv_tile_rows} exceeds the KV-centric tile of "
                         f"kv_heads_per_program * block_q = {kv_rows} rows")
    return BackwardConfig(
        dq_heads, options.dq_num_warps or dq_warps, options.dq_num_stages or dq_stages,
        kv_heads, options.kv_num_warps or kv_warps, options.kv_num_stages or kv_stages,
        options.kv_chunk or KV_CHUNK, kv_tile_rows, int(bool(options.fused_dq)), dq_tma, kv_tma,
        int(bool(options.stored_ds)), kv_gluon, GLUON_TILE_ROWS, GLUON_RING, dq_gluon, GLUON_DQ_RING,
        dq_gluon_heads, GLUON_KEY_ROWS,
    )


def check_fused_dq_allowed(kernel_options, deterministic: bool) -> None:
    """``kernel_options.fused_dq`` sums dQ with atomics, which ``deterministic`` (or
    ``torch.use_deterministic_algorithms``) forbids: ValueError for the pair, on both backends."""
    if normalize_kernel_options(kernel_options).fused_dq and deterministic:
        raise ValueError("kernel_options.fused_dq sums dQ with atomics in no fixed order, so it cannot give the "
                         "bitwise-reproducible gradients deterministic=True asks for; drop one of the two")


def check_no_plan_with_query_blocks(kernel_options) -> None:
    """``kernel_options.plan`` is a plan of the whole index; a call with ``query_blocks`` builds the plan of
    its own rows (:func:`build_plan`), so the two together are refused (ValueError), on both backends."""
    if normalize_kernel_options(kernel_options).plan is not None:
        raise ValueError("kernel_options.plan cannot be combined with query_blocks: a plan covers every query "
                         "block of its index, and a call with query_blocks builds the plan of its own rows")


class AttentionSchedule(NamedTuple):
    """Everything the Triton attention needs besides the tensors (see :func:`attention_schedule`)."""

    plan: BlockPlan
    slots: Tensor
    """:func:`cold_slots` of the plan (all -1 in deterministic mode)."""
    cold_capacity: int
    """Blocks of the atomic workspace (:func:`cold_capacity`; 0: no block can be cold)."""
    num_splits: int
    forward: ForwardConfig
    backward: BackwardConfig


def attention_schedule(index, group: int, head_dim: int, device, kernel_options=None,
                       deterministic: bool = False, query_blocks: Tensor | None = None) -> AttentionSchedule:
    """The launch schedule of one attention call over ``index``: its plan (``kernel_options.plan``, or
    ``index.plan(r0)``), the cold slots (none in deterministic mode: every block KV-centric), the
    atomic workspace size and the split count (``kernel_options.num_splits`` or
    :func:`forward_num_splits` from the index capacity, the longest row the shape allows) and the tiles
    of every kernel. ``group`` = HQ / HKV, ``device`` the one the kernels run on.

    Every number here follows from shapes and options, never from the selection's values, so building
    the schedule reads nothing back to the host (CUDA-graph capture, ``torch.compile(fullgraph=True)``).

    ``query_blocks`` (checked int64 ``[NQL]``): the schedule of a call that computes only these query
    blocks (context parallelism): the plan of their index rows (:func:`build_plan` with
    ``query_blocks``, built per call; ``kernel_options.plan`` is refused) and the split count of NQL
    query blocks.

    Raises:
        ValueError: ``kernel_options.plan`` together with ``query_blocks``."""
    options = normalize_kernel_options(kernel_options)
    if query_blocks is not None:
        check_no_plan_with_query_blocks(options)
        plan = build_plan(index, options.r0, query_blocks=query_blocks)
    else:
        plan = options.plan if options.plan is not None else index.plan(options.r0)
    check_fused_dq_allowed(options, deterministic)
    # the fused and the stored-dS backward take every block KV-centric (its kernel produces dQ's inputs); no
    # block is cold
    every_block_kv_centric = deterministic or bool(options.fused_dq) or bool(options.stored_ds)
    slots = cold_slots(plan.hot, plan.reuse, every_block_kv_centric or plan.r0 <= 1)
    cold = cold_capacity(plan.reuse.numel(), plan.r0, every_block_kv_centric)
    forward = forward_config(group, index.block_q, index.block_k, head_dim, options, device)
    backward = backward_config(group, index.block_q, index.block_k, head_dim, cold > 0, options, device,
                               query_map=query_blocks is not None)
    num_splits = options.num_splits or forward_num_splits(
        index.num_q_blocks if query_blocks is None else query_blocks.numel(), index.batch, index.num_kv_heads,
        group, forward.heads_per_program, index.capacity, device)
    return AttentionSchedule(plan, slots, cold, num_splits, forward, backward)


def block_mass_config(group: int, block_q: int) -> ForwardConfig:
    """Block-mass tile: the forward's row tile (heads * BQ = 256 rows), 8 warps from 128 rows, 3 stages."""
    heads = _heads_per_program(group, block_q, rows=256)
    return ForwardConfig(heads, 8 if heads * block_q >= 128 else 4, 3)



def pool_config(rope: bool, block: int, head_dim: int) -> tuple[int, int, int]:
    """(rows per step, warps, pooled heads per program) of the selector's pooling kernel (``kernels/triton/pool.py``)
    for blocks of ``block`` rows, measured on the H200 at 64K and 16K
    (``docs/benchmarks/speed_round2/h200_pool_sweep_session11.json``).

    Without RoPE the kernel streams q and k: 64-row steps on 2 warps, one head per program (2.5-3 TB/s).
    With RoPE a program takes the whole block in one step, so the angles' cosine and sine are computed once
    per row, on one warp per 32 rows; when a [rows, D/2] tile is small (64-row blocks at D = 64) they also
    serve 4 heads per program (0.179 against 0.193 ms at 64K), larger tiles run best one head per program."""
    rows = 1 << max(0, block - 1).bit_length()  # the block's rows padded to a power of two
    if not rope:
        return min(64, rows), 2, 1
    rows = min(rows, 128)
    heads = 4 if rows * max(head_dim // 2, 1) <= 2048 else 1
    return rows, max(1, rows // 32), heads


def row_log_mass_chunk(num_k_blocks: int, programs_per_chunk: int, device) -> int:
    """Key blocks per program of the sampled dense target's kernel. A few sampled query blocks give few
    (query tile, KV head) tiles while a late block's row walks up to NKB key blocks: one program per
    row left most of the GPU idle (at 64K, 8 sampled blocks: 64 programs of up to 1024 key blocks each).
    So the row is cut into chunks until there are about 16 programs per SM, but no chunk shorter than
    8 blocks (each program loads its query tile once)."""
    wanted_chunks = max(1, (16 * device_sm_count(device)) // max(1, programs_per_chunk))
    return max(min(8, num_k_blocks), -(-num_k_blocks // wanted_chunks))
