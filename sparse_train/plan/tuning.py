"""Tile tables: the launch configuration of every kernel (query heads stacked per program, warps, pipeline
stages, TMA loads, the Gluon kernels' tiles) and the forward's split count, as functions of the shapes, the
device (:mod:`sparse_train.plan.device`) and the :class:`~sparse_train.options.KernelOptions` that override
them. The choices come from measurements on an H200 (``docs/benchmarks/kernel_tuning.md``); none changes a
result beyond floating-point order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ..options import KernelOptions, check_kernel_option_shapes, normalize_kernel_options
from .device import copy_engine_loads, device_sm_count, gluon_kernels

__all__ = [
    "KV_CHUNK",
    "BackwardConfig",
    "ForwardConfig",
    "backward_config",
    "block_mass_config",
    "choose_num_splits",
    "forward_config",
    "forward_num_splits",
    "pool_config",
    "row_log_mass_chunk",
]

KV_CHUNK = 64
"""Query blocks per KV-centric work item: a KV block selected by more query blocks (a sink, a popular
block) is cut into chunks whose fp32 partials are summed in chunk order, so no program is the long pole."""

GLUON_TILE_ROWS = 64
"""Query rows per step of the Gluon KV-centric kernel: at D = 128 its two [BK, D] accumulators and two
[BK, 64] score tiles fit in 255 registers (H200, 64K: 32 rows 2-10% slower, 128 rows spill and run 1.4-1.9x
slower; docs/benchmarks/gluon_kv_h200.json)."""
GLUON_RING = 2
"""q/dO slices the Gluon KV-centric kernel keeps in flight (3: equal at D = 64, spills at D = 128)."""
GLUON_KEY_ROWS = 64
"""Key rows one Gluon KV-centric program takes: a 128-key block runs as two 64-row programs (4 warps each), so
two programs share an SM and one's softmax runs while the other's products do, as with 64-key blocks; one
128-row program of 8 warps filled the SM alone and kept the tensor pipe busy 55% of the time, two 64-row programs
64% (H200, 64K, D = 128, Nsight Compute); whole backward at P128 11.29 -> 10.53 ms (D = 128), 7.47 -> 6.77 ms
(D = 64), bitwise equal (docs/benchmarks/gluon_key_rows_h200.json)."""
GLUON_FWD_ROWS = 64
"""Query rows a Gluon forward program aims at (heads x BQ; one head for BQ >= 64): at head dim 64 over 64-key
blocks two such programs share an SM (H200, 64K: 1.99 ms against 2.13 with 128 rows, 2.58 with 256, and 2.24
for the Triton forward; docs/benchmarks/gluon_forward_h200.json)."""
GLUON_FWD_RING = 2
"""K/V tiles the Gluon forward keeps in flight."""
GLUON_DQ_RING = 2
"""K/V tiles the Gluon dQ kernel keeps in flight (ring slots in shared memory; 3: equal or slower on the H200,
and over 128 x 128 key tiles at D = 128 more shared memory than a program has)."""
GLUON_DQ_ROWS = 64
"""Query rows a Gluon dQ program aims at (heads x BQ; one head for BQ = 128). 64 rows (4 warps) let two programs
share an SM, one computing its softmax while the other's products run: on the H200 at 64K, P64, the whole
backward took 10.01 against 10.46 ms with 128 rows at D = 128, 6.01 against 6.64 at D = 64
(docs/benchmarks/gluon_dq_p64_heads_h200.json). The Triton dQ kernel keeps
its 128 rows (with one head at BQ = 64 it took 17.5 ms)."""


def choose_num_splits(num_programs: int, max_count: int, num_sms: int) -> int:
    """Split rule of the forward: split a row only when the grid is too small to fill the device
    (fewer than 2 waves of programs) and rows are long enough (>= 8 blocks per split) to amortise the
    partial write-back and the merge kernel. Returns a power of two in {1, 2, 4, 8}."""
    splits = 1
    while splits < 8 and num_programs * splits < 2 * num_sms and max_count >= 16 * splits:
        splits *= 2
    return splits


def forward_num_splits(
    query_blocks: int, batch: int, kv_heads: int, group: int, heads_per_program: int, max_count: int, device
) -> int:
    """:func:`choose_num_splits` for a forward grid of ``query_blocks`` live query blocks per (batch,
    KV head), each split over ``group // heads_per_program`` head subsets."""
    programs = query_blocks * (group // heads_per_program) * batch * kv_heads
    return choose_num_splits(programs, max_count, device_sm_count(device))


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


def forward_config(
    group: int,
    block_q: int,
    block_k: int,
    head_dim: int,
    kernel_options: Mapping | KernelOptions | None = None,
    device=None,
) -> ForwardConfig:
    """Forward tile: heads * BQ = 256 rows at head dim >= 128 (K/V loaded once for 4 heads at BQ = 64), 128
    rows below (at D = 64 the K/V loads are half as large and the smaller tile gives twice the programs:
    2 heads 11% faster than 4 on the H200); 8 warps once a [rows, max(D, BK)] tile reaches 128 x 64
    elements, 4 below, 3 stages (2 for 256-row tiles over 128-key blocks: shared memory); but 4 warps and 2
    stages below head dim 128 over 128-key blocks; K/V through TMA descriptors where ``device`` takes them
    (:func:`copy_engine_loads`; None: assumed). Measured: docs/benchmarks/kernel_tuning.md,
    docs/kernel_tuning.md. ``kernel_options`` override each field."""
    options = normalize_kernel_options(kernel_options)
    check_kernel_option_shapes(options, group, block_q)
    heads = options.fwd_heads_per_program or _heads_per_program(group, block_q, rows=256 if head_dim >= 128 else 128)
    rows = heads * block_q
    if head_dim < 128 and block_k >= 128:
        # measured (64K, D = 64, 128-blocks): 4 warps / 2 stages 2.41 ms, 4 / 3 2.57, 8 / 3 3.05 (255 registers,
        # no spill at 4 warps)
        warps, stages = 4, 2
    else:
        warps = 8 if rows * max(head_dim, block_k) >= 128 * 64 else 4
        stages = 2 if (rows >= 256 and block_k >= 128) else 3
    # TMA K/V loads: 4.17 -> 3.67 ms (P128, D = 128), 3.65 -> 3.45 (P64), 2.47 -> 2.32 (P128, D = 64), equal
    # at P64, D = 64 (H200, 64K: docs/benchmarks/tma_loads_h200.json)
    tma = _flag(options.fwd_tma, device is None or copy_engine_loads(device))
    gluon = _flag(options.fwd_gluon, head_dim == 64 and block_k == 64 and device is not None and gluon_kernels(device))
    gluon_heads = options.fwd_heads_per_program or _heads_per_program(group, block_q, rows=GLUON_FWD_ROWS)
    return ForwardConfig(
        heads, options.fwd_num_warps or warps, options.fwd_num_stages or stages, tma, gluon, gluon_heads, GLUON_FWD_RING
    )


def backward_config(
    group: int,
    block_q: int,
    block_k: int,
    head_dim: int,
    has_cold: bool,
    kernel_options: Mapping | KernelOptions | None = None,
    device=None,
    query_map: bool = False,
) -> BackwardConfig:
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
    check_kernel_option_shapes(options, group, block_q)
    dq_heads = options.dq_heads_per_program or _heads_per_program(group, block_q, rows=128)
    kv_heads = options.kv_heads_per_program or 1
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
    kv_tma = _flag(
        options.kv_tma,
        tma and kv_heads == 1 and not query_map and (block_k * head_dim < 128 * 128 or bool(options.stored_ds)),
    )
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
    return BackwardConfig(
        dq_heads,
        options.dq_num_warps or dq_warps,
        options.dq_num_stages or dq_stages,
        kv_heads,
        options.kv_num_warps or kv_warps,
        options.kv_num_stages or kv_stages,
        options.kv_chunk or KV_CHUNK,
        kv_tile_rows,
        int(bool(options.fused_dq)),
        dq_tma,
        kv_tma,
        int(bool(options.stored_ds)),
        kv_gluon,
        GLUON_TILE_ROWS,
        GLUON_RING,
        dq_gluon,
        GLUON_DQ_RING,
        dq_gluon_heads,
        GLUON_KEY_ROWS,
    )


def block_mass_config(group: int, block_q: int) -> ForwardConfig:
    """Block-mass tile: the forward's row tile (heads * BQ = 256 rows), 8 warps from 128 rows, 3 stages."""
    heads = _heads_per_program(group, block_q, rows=256)
    return ForwardConfig(heads, 8 if heads * block_q >= 128 else 4, 3)


def pool_config(rope: bool, block: int, head_dim: int) -> tuple[int, int, int]:
    """(rows per step, warps, pooled heads per program) of the selector's pooling kernel (``kernels/triton/pool.py``)
    for blocks of ``block`` rows, measured on the H200 at 64K and 16K
    (``docs/benchmarks/selector_pool_sweep_h200.json``).

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
