"""Triton kernel of the selector's block pooling: one pass over q (or k) per step instead of a dozen.

Math, per pooled head h, block j and channel d (x ``[B, H * G, N, D]``, rows n < len = min(valid_len[b], N)):
    x'[n, d] = (1/G) sum_g x[h*G + g, n, d];  with RoPE: x'[n, d] cos(a) + s_d x'[n, p(d)] sin(a), a = pos[n] w_d
    mean[j, d] = sum over the valid rows n of block j of x'[n, d] / (their number);  max[j, d] likewise (max)
    a block without a valid row gives 0.

Notation: B batch, H pooled (KV) heads, G = GROUP heads averaged per pooled head, N length, D = HEAD_DIM,
BLK = BLOCK rows per block, ROWS rows loaded per step, R = 2 * ROT_HALF rotated channels. Rotate-half: for d < R/2
the partner is p(d) = d + R/2 with s_d = +1, for R/2 <= d < R p(d) = d - R/2 with s_d = -1, w_d = inv_freq[d mod
R/2]; interleaved (INTERLEAVED): p(2i) = 2i + 1 with s = +1, p(2i + 1) = 2i with s = -1, w = inv_freq[i].
Channels d >= R are not rotated. The angle is the float32 product of the float32 position and
frequency, as in the reference; on the GPU its cosine and sine come from the hardware approximations after a
reduction by whole turns (FAST_TRIG: the accurate library functions make the kernel several times slower than
without RoPE; both errors are far below the float32 angle's own rounding, ~4e-3 rad at position 65536), under the
interpreter from tl.cos / tl.sin.

Layers: (1) ``_block_pool_kernel``, one program per (block, batch, chunk of HEADS_PER_PROGRAM pooled heads): with
the block in one row step, the cosine and sine of its rows are computed once and serve every head of the chunk
(they depend on the position only), and each rotated pair is loaded as two half tiles, every channel once
(loading each channel again as its partner, or computing the angles per head, costs more); (2) the launcher
``block_pool_launch`` (tiling from ``plan.tuning.pool_config``); no autograd op (the selector's pooled inputs are
detached); (4) the public function ``triton_block_pool``. The reference with the same semantics is
``kernels/reference/pool.py``; tests compare the two in float64.

Known limits: head dims that are powers of two (the selector calls it where the attention kernels run: 16 to
128); any strides; float32 accumulation, so the mean differs from the reference's by rounding (the reference
reduces in another order); the max is exact without RoPE and grouping (keys: G = 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.tuning import pool_config
from ..reference.pool import ROPE_STYLES, check_rope_args
from ._jit import rope_cos_sin, rope_pairs
from ._launch import kernel_valid_len, position_strides

__all__ = ["triton_block_pool", "block_pool_launch"]


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _group_sum(x_head, rows64, row_ok, channels, channel_ok, stride_xh, stride_xn, stride_xd, GROUP: tl.constexpr):
    # [ROWS, C] float32 sum over the group's heads of the given channels (masked rows and channels read as 0)
    ptrs = x_head + rows64[:, None] * stride_xn + channels[None, :].to(tl.int64) * stride_xd
    mask = row_ok[:, None] & channel_ok[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for g in tl.static_range(1, GROUP):
        acc += tl.load(ptrs + g * stride_xh, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _store_pooled(out, channels, channel_ok, total, best, count, HEAD_DIM: tl.constexpr, WITH_MAX: tl.constexpr):
    # the block's mean (and max) of these channels; a block without a valid row stores 0
    tl.store(out + channels, tl.where(count > 0, total / tl.maximum(count, 1).to(tl.float32), 0.0), mask=channel_ok)
    if WITH_MAX:
        tl.store(out + HEAD_DIM + channels, tl.where(count > 0, best, 0.0), mask=channel_ok)


@triton.jit
def _block_pool_kernel(
    X,
    INV_FREQ,
    POS,
    VALID_LEN,
    OUT,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_xd,
    stride_pb,
    stride_pn,
    N,
    H,
    NB,
    HEADS_PER_PROGRAM,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    TAIL_P2: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_VALID_LEN: tl.constexpr,
    WITH_MAX: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    # one program: block j of batch b for HEADS_PER_PROGRAM pooled heads. With RoPE and the block in one row
    # step the angles' cosine and sine are computed once and serve every head (they depend on the row only).
    # The rotated pairs are loaded as two half tiles (pair i: channels i and i + R/2, or 2i and 2i + 1 when
    # INTERLEAVED), each channel once.
    ONE_STEP: tl.constexpr = ROWS >= BLOCK
    TAIL: tl.constexpr = HEAD_DIM - 2 * ROT_HALF  # channels past the rotated ones (all of them without RoPE)
    j = tl.program_id(0)
    b = tl.program_id(1)
    head_first = tl.program_id(2) * HEADS_PER_PROGRAM
    b64 = b.to(tl.int64)
    limit = N
    if HAS_VALID_LEN:
        limit = tl.minimum(tl.maximum(tl.load(VALID_LEN + b), 0), N)
    count = tl.minimum(limit - j * BLOCK, BLOCK)  # valid rows of this block (<= 0: none)
    if ROT_HALF > 0:
        half_ok, first_ch, second_ch, freq = rope_pairs(INV_FREQ, ROT_HALF, HALF_P2, INTERLEAVED)  # [HALF] each
        if ONE_STEP:
            block_rows = j * BLOCK + tl.arange(0, ROWS)
            block_ok = (block_rows < limit) & (tl.arange(0, ROWS) < BLOCK)
            cos_block, sin_block = rope_cos_sin(
                POS, b64, block_rows, block_ok, freq, HAS_POS, FAST_TRIG, stride_pb, stride_pn
            )
    if TAIL > 0:
        tail = 2 * ROT_HALF + tl.arange(0, TAIL_P2)  # [TAIL] channels that are not rotated
        tail_ok = tail < HEAD_DIM
    for i in range(0, tl.minimum(HEADS_PER_PROGRAM, H - head_first)):
        head = head_first + i
        x_head = X + b64 * stride_xb + (head * GROUP).to(tl.int64) * stride_xh
        out = OUT + ((b64 * H + head) * NB + j) * ((2 if WITH_MAX else 1) * HEAD_DIM)
        if ROT_HALF > 0:
            total_1 = tl.zeros([HALF_P2], tl.float32)
            total_2 = tl.zeros([HALF_P2], tl.float32)
            best_1 = tl.full([HALF_P2], float("-inf"), tl.float32)
            best_2 = tl.full([HALF_P2], float("-inf"), tl.float32)
        if TAIL > 0:
            total_t = tl.zeros([TAIL_P2], tl.float32)
            best_t = tl.full([TAIL_P2], float("-inf"), tl.float32)
        for first in tl.static_range(0, BLOCK, ROWS):
            rows = j * BLOCK + first + tl.arange(0, ROWS)  # [ROWS]
            row_ok = (rows < limit) & (first + tl.arange(0, ROWS) < BLOCK)
            rows64 = rows.to(tl.int64)
            if ROT_HALF > 0:
                if ONE_STEP:
                    cos, sin = cos_block, sin_block
                else:
                    cos, sin = rope_cos_sin(POS, b64, rows, row_ok, freq, HAS_POS, FAST_TRIG, stride_pb, stride_pn)
                x_1 = (
                    _group_sum(x_head, rows64, row_ok, first_ch, half_ok, stride_xh, stride_xn, stride_xd, GROUP)
                    / GROUP
                )  # [ROWS, HALF] the group's mean rows
                x_2 = (
                    _group_sum(x_head, rows64, row_ok, second_ch, half_ok, stride_xh, stride_xn, stride_xd, GROUP)
                    / GROUP
                )  # [ROWS, HALF]
                turned_1 = x_1 * cos + x_2 * sin
                turned_2 = x_2 * cos - x_1 * sin
                total_1 += tl.sum(tl.where(row_ok[:, None], turned_1, 0.0), axis=0)
                total_2 += tl.sum(tl.where(row_ok[:, None], turned_2, 0.0), axis=0)
                if WITH_MAX:
                    best_1 = tl.maximum(best_1, tl.max(tl.where(row_ok[:, None], turned_1, float("-inf")), axis=0))
                    best_2 = tl.maximum(best_2, tl.max(tl.where(row_ok[:, None], turned_2, float("-inf")), axis=0))
            if TAIL > 0:
                x_t = (
                    _group_sum(x_head, rows64, row_ok, tail, tail_ok, stride_xh, stride_xn, stride_xd, GROUP) / GROUP
                )  # [ROWS, TAIL]
                total_t += tl.sum(tl.where(row_ok[:, None], x_t, 0.0), axis=0)
                if WITH_MAX:
                    best_t = tl.maximum(best_t, tl.max(tl.where(row_ok[:, None], x_t, float("-inf")), axis=0))
        if ROT_HALF > 0:
            _store_pooled(out, first_ch, half_ok, total_1, best_1, count, HEAD_DIM, WITH_MAX)
            _store_pooled(out, second_ch, half_ok, total_2, best_2, count, HEAD_DIM, WITH_MAX)
        if TAIL > 0:
            _store_pooled(out, tail, tail_ok, total_t, best_t, count, HEAD_DIM, WITH_MAX)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def block_pool_launch(
    x: Tensor,
    block: int,
    group: int,
    valid_len: Tensor | None,
    inv_freq: Tensor | None,
    positions: Tensor | None,
    with_max: bool,
    *,
    rope_style: str = "rotate_half",
    rows: int | None = None,
    num_warps: int | None = None,
    heads_per_program: int | None = None,
) -> Tensor:
    """float32 ``[B, H, NB, (1 + with_max) * D]``. No validation: ``valid_len`` int ``[B]`` contiguous,
    ``inv_freq`` float ``[R/2]`` contiguous or None, ``positions`` ``[N]`` or ``[B, N]`` or None. ``rows`` /
    ``num_warps`` / ``heads_per_program``: the tile and the heads a program walks (default
    ``plan.tuning.pool_config``; the benchmarks sweep them)."""
    B, heads_total, N, D = x.shape
    H = heads_total // group
    NB = -(-N // block)
    out = torch.empty((B, H, NB, (2 if with_max else 1) * D), device=x.device, dtype=torch.float32)
    rot_half = 0 if inv_freq is None else inv_freq.shape[0]
    default_rows, default_warps, default_heads = pool_config(rot_half > 0, block, D)
    rows = min(rows or default_rows, triton.next_power_of_2(block))
    heads_per_program = max(1, min(H, heads_per_program or default_heads))
    stride_pb, stride_pn = position_strides(positions)
    dummy = out
    if out.numel():
        _block_pool_kernel[(NB, B, triton.cdiv(H, heads_per_program))](
            x,
            dummy if inv_freq is None else inv_freq,
            dummy if positions is None else positions,
            dummy if valid_len is None else valid_len,
            out,
            *x.stride(),
            stride_pb,
            stride_pn,
            N,
            H,
            NB,
            heads_per_program,
            GROUP=group,
            BLOCK=block,
            ROWS=rows,
            HEAD_DIM=D,
            ROT_HALF=rot_half,
            HALF_P2=triton.next_power_of_2(max(rot_half, 1)),
            TAIL_P2=triton.next_power_of_2(max(D - 2 * rot_half, 1)),
            HAS_POS=positions is not None,
            HAS_VALID_LEN=valid_len is not None,
            WITH_MAX=with_max,
            FAST_TRIG=x.device.type == "cuda",
            INTERLEAVED=rope_style == "interleaved",
            num_warps=num_warps or default_warps,
        )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd: pooled inputs are detached)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_block_pool(
    x: Tensor,
    block: int,
    group: int = 1,
    *,
    valid_len: Tensor | None = None,
    inv_freq: Tensor | None = None,
    positions: Tensor | None = None,
    with_max: bool = False,
    rope_style: str = "rotate_half",
) -> Tensor:
    """Block pooling of the selector in one kernel; the semantics of
    :func:`~sparse_train.kernels.reference.pool.reference_block_pool`.

    Args:
        x: ``[B, H * group, N, D]``, any strides, float16/bfloat16/float32 (CUDA, or CPU under
            ``TRITON_INTERPRET=1``); D a power of two.
        block: rows per block (>= 1; the last block may be partial). group: heads averaged per pooled head.
        valid_len: optional int ``[B]`` on x's device: rows at positions >= valid_len[b] are never read
            (values are clamped to [0, N]).
        inv_freq: optional float ``[R / 2]``, 2 * R/2 <= D: un-rotate RoPE at ``positions`` (integer or float
            ``[N]`` or ``[B, N]``; default ``0..N-1``), in the ``rope_style`` convention (``"rotate_half"`` or
            ``"interleaved"``, :func:`~sparse_train.kernels.reference.pool.unrotate`).
        with_max: append the block maxima after the means.

    Returns:
        float32 ``[B, H, ceil(N / block), D]`` (``[..., 2 * D]`` with ``with_max``).

    Raises:
        ValueError: x not 4-D, D not a power of two, group not dividing the heads, block < 1, valid_len or
            positions of the wrong shape, device or dtype, too many RoPE frequencies.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H * group, N, D], got shape {tuple(x.shape)}")
    B, heads_total, N, D = x.shape
    if D < 1 or D & (D - 1):
        raise ValueError(f"the pooling kernel needs a power-of-two head dim, got {D}")
    if not isinstance(group, int) or group < 1 or heads_total % group:
        raise ValueError(f"group={group!r} must be a positive int dividing the {heads_total} heads of x")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    valid_len = kernel_valid_len(valid_len, B, x.device)
    if inv_freq is not None and inv_freq.numel() == 0:
        inv_freq = None
    if inv_freq is not None:
        check_rope_args(inv_freq, positions, B, N, D)
        inv_freq = inv_freq.to(x.device, torch.float32).contiguous()
        if positions is not None:
            if positions.dtype == torch.bool or positions.device != x.device:
                raise ValueError(
                    f"positions must be an integer or float tensor on {x.device}, got "
                    f"{positions.dtype} on {positions.device}"
                )
            if positions.dtype == torch.float64:  # the reference turns positions into float32 first
                positions = positions.to(torch.float32)
    else:
        positions = None
    if rope_style not in ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {rope_style!r}")
    return block_pool_launch(x, block, group, valid_len, inv_freq, positions, with_max, rope_style=rope_style)
