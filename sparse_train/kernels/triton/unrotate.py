"""Triton kernel of the RoPE un-rotation the token indexer reads: one pass over q (or k), every row kept.

Math (the reference is :func:`~sparse_train.kernels.reference.pool.unrotate`), per batch b, head h, row n and
rotated pair (d, p(d)) of the first R = 2 * ROT_HALF channels, with the angle a = pos[n] * w_d:

    out[n, d]    = x[n, d] cos(a) + x[n, p(d)] sin(a)
    out[n, p(d)] = x[n, p(d)] cos(a) - x[n, d] sin(a)
    out[n, c]    = x[n, c]                       for the channels c >= R (not rotated)
    out[n, :]    = 0                             for the rows n >= valid_len[b] (never read: NaN padding stays out)

Pairs: ``(i, i + R/2)`` (rotate-half) or ``(2i, 2i + 1)`` (``INTERLEAVED``), w = inv_freq[i]. Computed in
float32 (the angle's cosine and sine from :func:`~sparse_train.kernels.triton._jit.rope_cos_sin`), stored in the
output's dtype (the input's for float16 / bfloat16, float32 otherwise: the rounding the reference's result
takes when cast to it).

Notation: B batch, H heads, N length, D head dim, ROWS rows per program.

Layers: (1) ``_unrotate_kernel``: one program per (row tile, batch, chunk of HEADS_PER_PROGRAM heads); the
cosine and sine of the tile's rows are computed once and serve every head of the chunk; each rotated pair is
loaded as two half tiles (every channel once); (2) the launcher ``unrotate_launch``; (3) the launcher as the
``torch.library`` custom op ``sparse_train::unrotate`` (a fake impl, no autograd: the indexer's inputs are detached),
which torch.compile, export and dispatch modes call, eager calls on plain tensors the launcher
(``_launch.direct_call``); (4) the public function :func:`triton_unrotate`.

Known limits: any strides in, a contiguous output; the tiles are sized for D <= 256 (larger head dims run, with
register spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.pool import ROPE_STYLES, check_rope_args
from ._jit import rope_cos_sin, rope_pairs
from ._launch import direct_call, kernel_valid_len, position_strides

__all__ = ["triton_unrotate", "unrotate_launch"]

ROWS = 32
"""Rows per program: a [ROWS, D / 2] pair of float32 half tiles per head stays in registers up to D = 256."""
HEADS_PER_PROGRAM = 4
"""Heads sharing one tile's cosines and sines (a GQA group of the indexer's queries)."""


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _unrotate_kernel(
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
    ROWS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    TAIL_P2: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_VALID_LEN: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    TAIL: tl.constexpr = HEAD_DIM - 2 * ROT_HALF  # channels past the rotated ones
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    head_first = tl.program_id(2) * HEADS_PER_PROGRAM
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    limit = N
    if HAS_VALID_LEN:
        limit = tl.minimum(tl.maximum(tl.load(VALID_LEN + b), 0), N)
    row_in = rows < N  # rows stored
    row_ok = rows < limit  # rows read (the others store 0)
    rows64 = rows.to(tl.int64)
    half_ok, first_ch, second_ch, freq = rope_pairs(INV_FREQ, ROT_HALF, HALF_P2, INTERLEAVED)  # [HALF] each
    cos, sin = rope_cos_sin(POS, b64, rows, row_ok, freq, HAS_POS, FAST_TRIG, stride_pb, stride_pn)  # [ROWS, HALF]
    tail = 2 * ROT_HALF + tl.arange(0, TAIL_P2)  # [TAIL] channels that are not rotated
    tail_ok = tail < HEAD_DIM
    pair_load = row_ok[:, None] & half_ok[None, :]  # [ROWS, HALF]
    pair_store = row_in[:, None] & half_ok[None, :]
    tail_load = row_ok[:, None] & tail_ok[None, :]  # [ROWS, TAIL]
    tail_store = row_in[:, None] & tail_ok[None, :]
    for i in range(0, tl.minimum(HEADS_PER_PROGRAM, H - head_first)):
        head64 = (head_first + i).to(tl.int64)
        x_rows = X + b64 * stride_xb + head64 * stride_xh + rows64[:, None] * stride_xn  # [ROWS, 1]
        out_rows = OUT + ((b64 * H + head64) * N + rows64[:, None]) * HEAD_DIM  # [ROWS, 1] contiguous output
        x_1 = tl.load(x_rows + first_ch[None, :].to(tl.int64) * stride_xd, mask=pair_load, other=0.0).to(tl.float32)
        x_2 = tl.load(x_rows + second_ch[None, :].to(tl.int64) * stride_xd, mask=pair_load, other=0.0).to(tl.float32)
        turned_1 = x_1 * cos + x_2 * sin  # [ROWS, HALF]
        turned_2 = x_2 * cos - x_1 * sin
        tl.store(out_rows + first_ch[None, :], turned_1.to(OUT.dtype.element_ty), mask=pair_store)
        tl.store(out_rows + second_ch[None, :], turned_2.to(OUT.dtype.element_ty), mask=pair_store)
        if TAIL > 0:
            x_t = tl.load(x_rows + tail[None, :].to(tl.int64) * stride_xd, mask=tail_load, other=0.0)  # [ROWS, TAIL]
            tl.store(out_rows + tail[None, :], x_t.to(OUT.dtype.element_ty), mask=tail_store)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def unrotate_launch(
    x: Tensor,
    inv_freq: Tensor,
    positions: Tensor | None,
    valid_len: Tensor | None,
    out_dtype: torch.dtype,
    interleaved: bool,
) -> Tensor:
    """``out_dtype [B, H, N, D]`` contiguous. No validation: ``inv_freq`` float ``[R/2]`` contiguous with
    1 <= R/2 <= D/2, ``positions`` ``[N]`` or ``[B, N]`` or None, ``valid_len`` int32 ``[B]`` contiguous or None."""
    B, H, N, D = x.shape
    out = torch.empty((B, H, N, D), device=x.device, dtype=out_dtype)
    if out.numel() == 0:
        return out
    rot_half = inv_freq.shape[0]
    stride_pb, stride_pn = position_strides(positions)
    _unrotate_kernel[(triton.cdiv(N, ROWS), B, triton.cdiv(H, HEADS_PER_PROGRAM))](
        x,
        inv_freq,
        out if positions is None else positions,
        out if valid_len is None else valid_len,
        out,
        *x.stride(),
        stride_pb,
        stride_pn,
        N,
        H,
        ROWS=ROWS,
        HEADS_PER_PROGRAM=HEADS_PER_PROGRAM,
        HEAD_DIM=D,
        ROT_HALF=rot_half,
        HALF_P2=triton.next_power_of_2(rot_half),
        TAIL_P2=triton.next_power_of_2(max(D - 2 * rot_half, 1)),
        HAS_POS=positions is not None,
        HAS_VALID_LEN=valid_len is not None,
        FAST_TRIG=x.device.type == "cuda",
        INTERLEAVED=interleaved,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 3: custom op (no autograd: the indexer's inputs are detached)
# ----------------------------------------------------------------------------------------------
# The launcher as a torch.library custom op, which torch.compile, export and dispatch modes run as a graph node;
# eager calls on plain tensors call the launcher directly (``_launch.direct_call``).
@torch.library.custom_op("sparse_train::unrotate", mutates_args=())
def _unrotate_op(
    x: Tensor,
    inv_freq: Tensor,
    positions: Tensor | None,
    valid_len: Tensor | None,
    out_dtype: torch.dtype,
    interleaved: bool,
) -> Tensor:
    return unrotate_launch(x, inv_freq, positions, valid_len, out_dtype, interleaved)


@_unrotate_op.register_fake
def _(x, inv_freq, positions, valid_len, out_dtype, interleaved):
    return x.new_empty(x.shape, dtype=out_dtype)  # [B, H, N, D] contiguous


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd: the indexer's inputs are detached)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_unrotate(
    x: Tensor,
    inv_freq: Tensor,
    positions: Tensor | None = None,
    style: str = "rotate_half",
    *,
    valid_len: Tensor | None = None,
) -> Tensor:
    """Undo RoPE in one pass: :func:`~sparse_train.kernels.reference.pool.unrotate`'s result, with the rows at or
    past ``valid_len[b]`` zero (never read), in x's dtype for float16 / bfloat16 inputs, float32 otherwise.

    Args:
        x: ``[B, H, N, D]``, any strides, float16 / bfloat16 / float32 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        inv_freq: float ``[R / 2]``, 1 <= R / 2 <= D / 2: RoPE turns pair i by ``positions[n] * inv_freq[i]``.
        positions: the positions RoPE used, integer or float ``[N]`` or ``[B, N]``; default ``0..N-1``.
        style: ``"rotate_half"`` (pairs ``(i, i + R/2)``) or ``"interleaved"`` (pairs ``(2i, 2i + 1)``).
        valid_len: optional int ``[B]`` on x's device (clamped to [0, N]).

    Returns:
        ``[B, H, N, D]``, contiguous.

    Raises:
        ValueError: x not 4-D or of another dtype, no frequencies, a style not in ``ROPE_STYLES``,
            positions / valid_len / inv_freq of the wrong shape or device (``check_rope_args``).
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, N, D], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    B, _, N, D = x.shape
    if style not in ROPE_STYLES:
        raise ValueError(f"RoPE style must be one of {ROPE_STYLES}, got {style!r}")
    if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise ValueError(f"inv_freq must be a non-empty 1-D tensor, got {getattr(inv_freq, 'shape', inv_freq)!r}")
    check_rope_args(inv_freq, positions, B, N, D)
    valid_len = kernel_valid_len(valid_len, B, x.device)
    if positions is not None:
        positions = positions.to(x.device)
    out_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    inputs = (x, inv_freq.to(x.device).contiguous(), positions, valid_len, out_dtype, style == "interleaved")
    if not direct_call(x, inv_freq, positions, valid_len):
        return torch.ops.sparse_train.unrotate(*inputs)
    return unrotate_launch(*inputs)
