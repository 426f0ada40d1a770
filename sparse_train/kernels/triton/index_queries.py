"""Triton kernel of the token indexer's index queries: RoPE undone, padded rows zeroed and the GQA group's heads
projected, in one pass over q.

Math (the reference is kernels/reference/index_queries.py), per batch b, KV head h, row n:

    q'[b, h G + g, n] = q with RoPE undone (pairs and angles as kernels/triton/unrotate.py), 0 for n >= valid_len[b]
    u[b, h, n, :]     = sum over g < G of  q'[b, h G + g, n, :] @ weight[h, g D : (g + 1) D, :]

q' is computed in float32 and rounded to the input dtype before the product (the rounding the un-rotated copy of
the two-step path takes), the product accumulates in float32 and u is stored in the input dtype. The un-rotated q
is never written: the two-step path writes it ([B, HQ, N, D]) and reads it again through a transposing copy, this
kernel reads q once and writes only u ([B, HKV, N, X], X = E * S).

Notation: B batch, HKV KV heads, G query heads per KV head, N length, D head dim, R = 2 * ROT_HALF rotated channels
(0 without RoPE), X the index width, ROWS rows per program.

Layers: (1) ``_index_queries_kernel``: one program per (row tile, batch, KV head); the tile's cosines and sines are
computed once and serve the G heads; per head the rotated pairs are loaded as two half tiles and the channels past
R as a third, each turned tile multiplied by the matching rows of the weight (``tl.dot``, operands padded to 16);
(2) the launcher ``index_queries_launch``; (3) the launcher as the ``torch.library`` custom op
``sparse_train::index_queries`` (a fake impl, no autograd: the selection's index queries take no gradient, the
indexer's gradients read the un-rotated rows through the PyTorch path), which torch.compile, export and dispatch
modes call, eager calls on plain tensors the launcher (``_launch.direct_call``); (4) the public function
:func:`triton_index_queries`.

Known limits: float16 / bfloat16 / float32 (float32 products in IEEE precision); bfloat16 on CUDA only (the
interpreter's bfloat16 arithmetic is wrong); any strides of q; D <= 256 and X <= 256 (:func:`program_tile`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.pool import ROPE_STYLES, check_rope_args
from ._jit import dot, rope_cos_sin, rope_pairs
from ._launch import direct_call, kernel_valid_len, position_strides

__all__ = ["KERNEL_DTYPES", "index_queries_launch", "program_tile", "triton_index_queries"]


def program_tile(head_dim: int) -> tuple[int, int]:
    """(rows, warps) per program: the tile's cosines and sines, one head's two float32 half tiles, the weight's rows
    and the [ROWS, X] accumulator stay in registers on sm_90a up to D = 128, X = 64 (the compile test); D = 256 takes
    16 rows and spills a few registers."""
    return (64, 4) if head_dim <= 128 else (16, 4)


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes the kernel takes."""
MIN_DOT = 16
"""Smallest operand side ``tl.dot`` takes: narrower tiles are padded (with zeros) to it."""


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _index_queries_kernel(
    Q,
    WEIGHT,
    INV_FREQ,
    POS,
    VALID_LEN,
    OUT,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_pb,
    stride_pn,
    N,
    HKV,
    X,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    TAIL_P2: tl.constexpr,
    X_P2: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_VALID_LEN: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IEEE: tl.constexpr,
):
    TAIL: tl.constexpr = HEAD_DIM - 2 * ROT_HALF  # channels past the rotated ones
    b64 = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    h64 = h.to(tl.int64)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    limit = N
    if HAS_VALID_LEN:
        limit = tl.minimum(tl.maximum(tl.load(VALID_LEN + b64), 0), N)
    row_in = rows < N  # rows stored
    row_ok = rows < limit  # rows read (the others contribute 0)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, X_P2)  # [X] index width
    col_ok = cols < X
    dtype = OUT.dtype.element_ty
    if ROT_HALF > 0:  # the tile's angles, shared by the G heads
        half_ok, first_ch, second_ch, freq = rope_pairs(INV_FREQ, ROT_HALF, HALF_P2, INTERLEAVED)  # [HALF]
        cos, sin = rope_cos_sin(POS, b64, rows, row_ok, freq, HAS_POS, FAST_TRIG, stride_pb, stride_pn)  # [ROWS, HALF]
        pair_load = row_ok[:, None] & half_ok[None, :]  # [ROWS, HALF]
        w_pair = half_ok[:, None] & col_ok[None, :]  # [HALF, X]
    if TAIL > 0:
        tail = 2 * ROT_HALF + tl.arange(0, TAIL_P2)  # [TAIL] channels that are not rotated
        tail_ok = tail < HEAD_DIM
    acc = tl.zeros([ROWS, X_P2], dtype=tl.float32)
    for g in range(GROUP):
        head64 = h64 * GROUP + g
        q_rows = Q + b64 * stride_qb + head64 * stride_qh + rows64[:, None] * stride_qn  # [ROWS, 1]
        # rows of the weight: [HKV, G * D, X] contiguous, head g's channels at g * D
        w_rows = WEIGHT + (h64 * (GROUP * HEAD_DIM) + g * HEAD_DIM) * X  # scalar
        if ROT_HALF > 0:
            x_1 = tl.load(q_rows + first_ch[None, :].to(tl.int64) * stride_qd, mask=pair_load, other=0.0)
            x_2 = tl.load(q_rows + second_ch[None, :].to(tl.int64) * stride_qd, mask=pair_load, other=0.0)
            x_1 = x_1.to(tl.float32)
            x_2 = x_2.to(tl.float32)
            turned_1 = (x_1 * cos + x_2 * sin).to(dtype)  # [ROWS, HALF]
            turned_2 = (x_2 * cos - x_1 * sin).to(dtype)
            w_1 = tl.load(w_rows + first_ch[:, None] * X + cols[None, :], mask=w_pair, other=0.0)  # [HALF, X]
            w_2 = tl.load(w_rows + second_ch[:, None] * X + cols[None, :], mask=w_pair, other=0.0)
            acc += dot(turned_1, w_1, IEEE)
            acc += dot(turned_2, w_2, IEEE)
        if TAIL > 0:
            x_t = tl.load(
                q_rows + tail[None, :].to(tl.int64) * stride_qd, mask=row_ok[:, None] & tail_ok[None, :], other=0.0
            ).to(dtype)  # [ROWS, TAIL]
            w_t = tl.load(
                w_rows + tail[:, None] * X + cols[None, :], mask=tail_ok[:, None] & col_ok[None, :], other=0.0
            )  # [TAIL, X]
            acc += dot(x_t, w_t, IEEE)
    out_rows = OUT + ((b64 * HKV + h64) * N + rows64[:, None]) * X  # [ROWS, 1] contiguous output
    tl.store(out_rows + cols[None, :], acc.to(dtype), mask=row_in[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def index_queries_launch(
    q: Tensor,
    weight: Tensor,
    inv_freq: Tensor | None,
    positions: Tensor | None,
    valid_len: Tensor | None,
    interleaved: bool,
) -> Tensor:
    """u ``[B, HKV, N, X]`` contiguous in q's dtype. No validation: ``weight`` ``[HKV, G * D, X]`` contiguous in q's
    dtype, ``inv_freq`` float ``[R/2]`` contiguous with 1 <= R/2 <= D/2 or None, ``positions`` ``[N]`` or ``[B, N]``
    or None, ``valid_len`` int32 ``[B]`` contiguous or None."""
    B, HQ, N, D = q.shape
    HKV, _, X = weight.shape
    out = torch.empty((B, HKV, N, X), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    rot_half = 0 if inv_freq is None else inv_freq.shape[0]
    stride_pb, stride_pn = position_strides(positions)
    rows, warps = program_tile(D)
    _index_queries_kernel[(triton.cdiv(N, rows), B, HKV)](
        q,
        weight,
        out if inv_freq is None else inv_freq,
        out if positions is None else positions,
        out if valid_len is None else valid_len,
        out,
        *q.stride(),
        stride_pb,
        stride_pn,
        N,
        HKV,
        X,
        GROUP=HQ // HKV,
        ROWS=rows,
        HEAD_DIM=D,
        ROT_HALF=rot_half,
        HALF_P2=max(MIN_DOT, triton.next_power_of_2(max(rot_half, 1))),
        TAIL_P2=max(MIN_DOT, triton.next_power_of_2(max(D - 2 * rot_half, 1))),
        X_P2=max(MIN_DOT, triton.next_power_of_2(X)),
        HAS_POS=positions is not None,
        HAS_VALID_LEN=valid_len is not None,
        FAST_TRIG=q.device.type == "cuda",
        INTERLEAVED=interleaved,
        IEEE=q.dtype == torch.float32,
        num_warps=warps,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 3: custom op (no autograd: see the module docstring)
# ----------------------------------------------------------------------------------------------
# The launcher as a torch.library custom op, which torch.compile, export and dispatch modes run as a graph node;
# eager calls on plain tensors call the launcher directly (``_launch.direct_call``).
@torch.library.custom_op("sparse_train::index_queries", mutates_args=())
def _index_queries_op(
    q: Tensor,
    weight: Tensor,
    inv_freq: Tensor | None,
    positions: Tensor | None,
    valid_len: Tensor | None,
    interleaved: bool,
) -> Tensor:
    return index_queries_launch(q, weight, inv_freq, positions, valid_len, interleaved)


@_index_queries_op.register_fake
def _(q, weight, inv_freq, positions, valid_len, interleaved):
    B, _, N, _ = q.shape
    HKV, _, X = weight.shape
    return q.new_empty((B, HKV, N, X))


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd: see the module docstring)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_index_queries(
    q: Tensor,
    weight: Tensor,
    inv_freq: Tensor | None = None,
    positions: Tensor | None = None,
    style: str = "rotate_half",
    *,
    valid_len: Tensor | None = None,
) -> Tensor:
    """The token indexer's index queries in one pass:
    :func:`~sparse_train.kernels.reference.index_queries.reference_index_queries`'s result.

    Args:
        q: ``[B, HKV * G, N, D]``, any strides, float16 / bfloat16 / float32 (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), D <= 256.
        weight: ``[HKV, G * D, X]``, X <= 256 (cast to q's dtype; its gradient is not computed).
        inv_freq: float ``[R / 2]``, 1 <= R / 2 <= D / 2: RoPE turned pair i by ``positions[n] * inv_freq[i]``;
            None: q is indexed as given.
        positions: the positions RoPE used, integer or float ``[N]`` or ``[B, N]``; default ``0..N-1``.
        style: ``"rotate_half"`` (pairs ``(i, i + R/2)``) or ``"interleaved"`` (pairs ``(2i, 2i + 1)``).
        valid_len: optional int ``[B]`` on q's device (clamped to [0, N]): rows at or past it are read as 0.

    Returns:
        ``[B, HKV, N, X]`` contiguous, in q's dtype.

    Raises:
        ValueError: q not 4-D or of another dtype; weight not ``[HKV, G * D, X]`` with HKV dividing q's heads, or on
            another device; D or X above 256; a style not in ``ROPE_STYLES``; inv_freq empty or rotating more than D
            channels; positions / valid_len of the wrong shape or device.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, HQ, N, D], got shape {tuple(q.shape)}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    B, HQ, N, D = q.shape
    if (
        not isinstance(weight, Tensor)
        or weight.dim() != 3
        or weight.shape[0] < 1
        or HQ % weight.shape[0] != 0
        or weight.shape[1] != (HQ // weight.shape[0]) * D
        or weight.device != q.device
    ):
        raise ValueError(
            f"weight must be [HKV, G * D, X] with HKV * G = {HQ} heads and D = {D}, on {q.device}; got "
            f"{tuple(getattr(weight, 'shape', ()))} on {getattr(weight, 'device', None)}"
        )
    if D > 256 or weight.shape[2] > 256:
        raise ValueError(f"the kernel takes D <= 256 and X <= 256, got D = {D}, X = {weight.shape[2]}")
    if style not in ROPE_STYLES:
        raise ValueError(f"RoPE style must be one of {ROPE_STYLES}, got {style!r}")
    if inv_freq is not None:
        if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or inv_freq.numel() == 0:
            raise ValueError(
                f"inv_freq must be a non-empty 1-D tensor or None, got {getattr(inv_freq, 'shape', inv_freq)!r}"
            )
        check_rope_args(inv_freq, positions, B, N, D)
        inv_freq = inv_freq.to(q.device).contiguous()
        if positions is not None:
            positions = positions.to(q.device)
    else:
        positions = None  # nothing to turn
    valid_len = kernel_valid_len(valid_len, B, q.device)
    inputs = (q, weight.to(q.dtype).contiguous(), inv_freq, positions, valid_len, style == "interleaved")
    if not direct_call(q, weight, inv_freq, positions, valid_len):
        return torch.ops.sparse_train.index_queries(*inputs)
    return index_queries_launch(*inputs)
