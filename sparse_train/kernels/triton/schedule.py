"""Triton kernel of the backward's KV-centric work list (``plan.kv_schedule``): one launch instead of ~25 small ops.

Math, per KV row r (reuse u_r query blocks, cold slot s_r, transposed row [p_r, p_{r+1}) of ``kv_indptr``):
    c_r = ceil(u_r / CHUNK) if s_r < 0 and u_r > 0 else 0;   items of row r = the c_r chunks, numbered from
    sum_{r' < r} c_r';  chunk c covers [p_r + c CHUNK, min(p_r + (c + 1) CHUNK, p_{r+1}));  a row of c_r >= 2
    writes partials, numbered from sum_{r' < r, c_r' >= 2} c_r'; items past the last real one are padding.

Notation: R = B*HKV*NKB KV rows, I item slots (a bound from the shapes), CHUNK query blocks per item, BLOCK rows
per step of the program.

Layers: (1) ``_kv_schedule_kernel``, one program that walks the rows in steps of BLOCK, carrying the two running
counts (prefix sums within a step, the carries across steps), writes each row's items with one masked store per
chunk index up to the step's longest row, then the padding items; (2) the launcher ``kv_schedule_launch``; no
autograd (integers); (4) the public function ``triton_kv_schedule``. The reference is ``plan.kv_schedule`` (its
PyTorch path: cumulative sums, a sorted search and gathers); tests require equal arrays.

Known limits: one program, so its time grows with R (steps of 4096 rows; 8192 rows at 64K, B = 1, HKV = 8,
BK = 64); counts in int32 (the plan's item and partial counts are below 2**31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.plan import KVSchedule

__all__ = ["kv_schedule_launch", "triton_kv_schedule"]

_MAX_BLOCK = 4096


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _kv_schedule_kernel(
    REUSE,
    KV_INDPTR,
    SLOTS,
    ITEM_ROW,
    ITEM_T0,
    ITEM_T1,
    ITEM_PART,
    PART_START,
    NUM_PARTS,
    R,
    NUM_ITEMS,
    CHUNK,
    BLOCK: tl.constexpr,
):
    items_before = 0  # items of the rows of earlier steps
    parts_before = 0  # partial slots of the rows of earlier steps
    for first in range(0, R, BLOCK):
        rows = first + tl.arange(0, BLOCK)  # [BLOCK]
        ok = rows < R
        reuse = tl.load(REUSE + rows, mask=ok, other=0).to(tl.int32)
        slot = tl.load(SLOTS + rows, mask=ok, other=0)
        chunks = tl.where((slot < 0) & (reuse > 0), (reuse + CHUNK - 1) // CHUNK, 0)  # [BLOCK] items per row
        multi = chunks >= 2
        parts = tl.where(multi, chunks, 0)
        item_first = items_before + tl.cumsum(chunks, axis=0) - chunks  # [BLOCK] the row's first item
        part_first = parts_before + tl.cumsum(parts, axis=0) - parts  # [BLOCK] its first partial slot
        tl.store(NUM_PARTS + rows, tl.where(reuse > 0, parts, -1), mask=ok)
        tl.store(PART_START + rows, tl.where(multi, part_first, -1), mask=ok)
        t_first = tl.load(KV_INDPTR + rows, mask=ok, other=0)  # [BLOCK] int64
        t_end = tl.load(KV_INDPTR + rows + 1, mask=ok, other=0)
        for c in range(0, tl.max(chunks, axis=0)):
            write = ok & (c < chunks)
            item = item_first + c
            start = t_first + c * CHUNK
            write = write & (item < NUM_ITEMS)
            tl.store(ITEM_ROW + item, rows, mask=write)
            tl.store(ITEM_T0 + item, start.to(tl.int32), mask=write)
            tl.store(ITEM_T1 + item, tl.minimum(start + CHUNK, t_end).to(tl.int32), mask=write)
            tl.store(ITEM_PART + item, tl.where(multi, part_first + c, -1), mask=write)
        items_before += tl.sum(chunks, axis=0)
        parts_before += tl.sum(parts, axis=0)
    for first in range(items_before, NUM_ITEMS, BLOCK):  # padding items: the kernel returns at once on them
        item = first + tl.arange(0, BLOCK)
        pad = item < NUM_ITEMS
        tl.store(ITEM_ROW + item, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(ITEM_T0 + item, tl.zeros([BLOCK], tl.int32), mask=pad)
        tl.store(ITEM_T1 + item, tl.zeros([BLOCK], tl.int32), mask=pad)
        tl.store(ITEM_PART + item, tl.full([BLOCK], -1, tl.int32), mask=pad)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def kv_schedule_launch(
    reuse: Tensor, kv_indptr: Tensor, slots: Tensor, chunk: int, num_items: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(item_row, item_t0, item_t1, item_part ``[num_items]``, part_start, num_parts ``[R]``), int32. No
    validation: ``reuse`` int ``[R]``, ``kv_indptr`` int64 ``[R + 1]``, ``slots`` int32 ``[R]``, contiguous."""
    num_rows = reuse.numel()
    device = reuse.device
    item_arrays = torch.empty((4, num_items), device=device, dtype=torch.int32)
    row_arrays = torch.empty((2, num_rows), device=device, dtype=torch.int32)
    if num_rows or num_items:
        block = min(_MAX_BLOCK, triton.next_power_of_2(max(num_rows, num_items, 16)))
        _kv_schedule_kernel[(1,)](
            reuse,
            kv_indptr,
            slots,
            item_arrays[0],
            item_arrays[1],
            item_arrays[2],
            item_arrays[3],
            row_arrays[0],
            row_arrays[1],
            num_rows,
            num_items,
            chunk,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return (*item_arrays.unbind(0), *row_arrays.unbind(0))


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_kv_schedule(reuse: Tensor, kv_indptr: Tensor, slots: Tensor, chunk: int, *, num_items: int, num_parts: int):
    """The KV-centric work list in one kernel; the semantics of :func:`sparse_train.plan.plan.kv_schedule` with the
    array lengths given (no host read).

    Args:
        reuse: int ``[B, HKV, NKB]`` or ``[R]``: query blocks selecting each KV block.
        kv_indptr: int64 ``[R + 1]``: row pointers of the transposed CSR.
        slots: int ``[R]``: cold slot of each block (>= 0: cold, not KV-centric), -1 otherwise.
        chunk: query blocks per work item (>= 1).
        num_items, num_parts: the item slots and partial slots to provide (``plan.kv_schedule_capacity``).

    Returns:
        ``plan.KVSchedule``.

    Raises:
        ValueError: arrays of different lengths or on different devices, chunk < 1, negative bounds.
    """
    reuse = reuse.reshape(-1)
    slots = slots.reshape(-1)
    num_rows = reuse.numel()
    if kv_indptr.shape != (num_rows + 1,) or slots.shape != (num_rows,):
        raise ValueError(
            f"kv_indptr must be [R + 1] and slots [R] for R = {num_rows} rows, got "
            f"{tuple(kv_indptr.shape)} and {tuple(slots.shape)}"
        )
    if kv_indptr.device != reuse.device or slots.device != reuse.device:
        raise ValueError(
            f"reuse, kv_indptr and slots must share a device, got {reuse.device}, {kv_indptr.device}, {slots.device}"
        )
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if num_items < 0 or num_parts < 0:
        raise ValueError(f"num_items and num_parts must be >= 0, got {num_items} and {num_parts}")
    item_row, item_t0, item_t1, item_part, part_start, parts = kv_schedule_launch(
        reuse.contiguous(), kv_indptr.to(torch.int64).contiguous(), slots.to(torch.int32).contiguous(), chunk, num_items
    )
    return KVSchedule(item_row, item_t0, item_t1, item_part, part_start, parts, num_parts)
