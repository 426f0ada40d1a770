"""Triton kernel of the selector's block logits: the projected product, temperature and distance bias in one pass.

Math, per (batch b, KV head h, row r of query block i = r, or query_blocks[r], key block j):
    logits[b, h, r, j] = temp[h] * sum_s qs[b, h, r, s] ks[b, h, j, s]  +  bias[h, bucket(i, j)]
    bucket(i, j) = bit length of max(last_i - j, 0), at most C - 1   (0 on and past the causal edge, 1 for one
    block back, 2 for 2-3 blocks back, ...);  last_i = (min((i + 1) BQ, N) - 1) // BK

Notation: B batch, H KV heads, R query-block rows, NKB key blocks, S = selector_dim, N length, BQ / BK block
sizes, C = NUM_BUCKETS (``kernels.reference.scores.DISTANCE_BUCKETS``), BR x BN the output tile of a program.

Layers: (1) ``_block_logits_kernel``, one program per [BR, BN] tile of one (b, h) matrix: an IEEE float32 dot
over S (as the reference's float32 matmul), then the temperature and the bias looked up from the bucket the
program computes from (i, j), written once; ``_block_logits_sums_kernel``, the backward's per-tile sums
sum(grad * raw) (temperature) and sum of grad per bucket (bias), the raw product recomputed; (2) the launchers
``block_logits_launch`` and ``block_logits_sums_launch`` (tile partials summed in a fixed order: deterministic);
(3) the autograd op ``_FusedBlockLogits`` (forward the first kernel; backward two matmuls for qs and ks and the
sums kernel); (4) the public function ``triton_block_logits``. The reference is
``selection.scorer.reference_block_logits`` (a float32 matmul, a product with the temperature, the bucket table
from ``block_distance_buckets`` and a lookup: about ten kernels and three float32 [B, H, R, NKB] passes forward,
about eighty small kernels for the bias's gradient backward).

Known limits: float32 only (the scorer's dtype); C = DISTANCE_BUCKETS; the float32 sums are ordered differently
from cuBLAS's, so logits differ from the reference's by rounding (the top-k of near-ties may differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference.scores import DISTANCE_BUCKETS

__all__ = ["block_logits_launch", "block_logits_sums_launch", "triton_block_logits"]

_TILE = 64  # BR = BN: rows and key blocks per program


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile(H, R, NKB, BR: tl.constexpr, BN: tl.constexpr):
    # this program's (b, h) matrix and its [BR] rows and [BN] key blocks, with their bounds
    batch_head = tl.program_id(2)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    return (batch_head, (batch_head // H).to(tl.int64), (batch_head % H).to(tl.int64), rows, cols, rows < R, cols < NKB)


@triton.jit
def _raw_tile(
    QS,
    KS,
    b64,
    h64,
    rows,
    cols,
    row_ok,
    col_ok,
    S,
    stride_qb,
    stride_qh,
    stride_qr,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_kj,
    stride_ks,
    S_P2: tl.constexpr,
):
    # [BR, BN] float32 qs ks^T of one tile (IEEE products, as the reference's float32 matmul)
    offs_s = tl.arange(0, S_P2)
    s_ok = offs_s < S
    qs = tl.load(
        QS + b64 * stride_qb + h64 * stride_qh + rows.to(tl.int64)[:, None] * stride_qr + offs_s[None, :] * stride_qs,
        mask=row_ok[:, None] & s_ok[None, :],
        other=0.0,
    )  # [BR, S]
    ks = tl.load(
        KS + b64 * stride_kb + h64 * stride_kh + cols.to(tl.int64)[:, None] * stride_kj + offs_s[None, :] * stride_ks,
        mask=col_ok[:, None] & s_ok[None, :],
        other=0.0,
    )  # [BN, S]
    return tl.dot(qs, tl.trans(ks), input_precision="ieee")


@triton.jit
def _distance_buckets(
    QUERY_BLOCKS,
    rows,
    row_ok,
    cols,
    N,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
):
    # [BR, BN] int32 bucket(i, j) of the tile's rows (query blocks) and key blocks
    if HAS_QUERY_BLOCKS:
        blocks = tl.load(QUERY_BLOCKS + rows, mask=row_ok, other=0)  # [BR] global query blocks
    else:
        blocks = rows
    last = (tl.minimum((blocks + 1) * BLOCK_Q, N) - 1) // BLOCK_K  # [BR] last causal key block
    behind = tl.maximum(last[:, None] - cols[None, :], 0)  # [BR, BN]
    bucket = tl.zeros(behind.shape, tl.int32)
    for e in tl.static_range(NUM_BUCKETS - 1):
        bucket += (behind >= (1 << e)).to(tl.int32)
    return bucket


@triton.jit
def _block_logits_kernel(
    QS,
    KS,
    TEMPERATURE,
    BIAS,
    QUERY_BLOCKS,
    OUT,
    stride_qb,
    stride_qh,
    stride_qr,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_kj,
    stride_ks,
    H,
    R,
    NKB,
    S,
    N,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
):
    _, b64, h64, rows, cols, row_ok, col_ok = _tile(H, R, NKB, BR, BN)
    raw = _raw_tile(
        QS,
        KS,
        b64,
        h64,
        rows,
        cols,
        row_ok,
        col_ok,
        S,
        stride_qb,
        stride_qh,
        stride_qr,
        stride_qs,
        stride_kb,
        stride_kh,
        stride_kj,
        stride_ks,
        S_P2,
    )  # [BR, BN]
    logits = raw * tl.load(TEMPERATURE + h64)
    if HAS_BIAS:
        bucket = _distance_buckets(QUERY_BLOCKS, rows, row_ok, cols, N, BLOCK_Q, BLOCK_K, NUM_BUCKETS, HAS_QUERY_BLOCKS)
        logits = logits + tl.load(BIAS + h64 * NUM_BUCKETS + bucket)  # 16 values: the lookups hit the cache
    out = OUT + ((b64 * H + h64) * R + rows.to(tl.int64))[:, None] * NKB + cols[None, :]
    tl.store(out, logits, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _block_logits_sums_kernel(
    GRAD,
    QS,
    KS,
    QUERY_BLOCKS,
    TEMPERATURE_PART,
    BIAS_PART,
    stride_gb,
    stride_gh,
    stride_gr,
    stride_gj,
    stride_qb,
    stride_qh,
    stride_qr,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_kj,
    stride_ks,
    H,
    R,
    NKB,
    S,
    N,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    BUCKETS_P2: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    S_P2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
):
    # per tile: sum(grad * raw) (the temperature's gradient) and the sum of grad over each bucket (the bias's),
    # written to this tile's slot [b*H + h, tile] of the partials; PyTorch sums the tiles in a fixed order
    batch_head, b64, h64, rows, cols, row_ok, col_ok = _tile(H, R, NKB, BR, BN)
    grad = tl.load(
        GRAD + b64 * stride_gb + h64 * stride_gh + rows.to(tl.int64)[:, None] * stride_gr + cols[None, :] * stride_gj,
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    )  # [BR, BN]
    raw = _raw_tile(
        QS,
        KS,
        b64,
        h64,
        rows,
        cols,
        row_ok,
        col_ok,
        S,
        stride_qb,
        stride_qh,
        stride_qr,
        stride_qs,
        stride_kb,
        stride_kh,
        stride_kj,
        stride_ks,
        S_P2,
    )  # [BR, BN]
    tile = (
        batch_head.to(tl.int64) * (tl.num_programs(0) * tl.num_programs(1))
        + tl.program_id(0) * tl.num_programs(1)
        + tl.program_id(1)
    )
    tl.store(TEMPERATURE_PART + tile, tl.sum(tl.sum(grad * raw, axis=1), axis=0))
    if HAS_BIAS:
        bucket = _distance_buckets(QUERY_BLOCKS, rows, row_ok, cols, N, BLOCK_Q, BLOCK_K, NUM_BUCKETS, HAS_QUERY_BLOCKS)
        offs_c = tl.arange(0, BUCKETS_P2)
        sums = tl.zeros([BUCKETS_P2], tl.float32)
        for c in tl.static_range(NUM_BUCKETS):
            total = tl.sum(tl.sum(tl.where(bucket == c, grad, 0.0), axis=1), axis=0)
            sums = tl.where(offs_c == c, total, sums)
        tl.store(BIAS_PART + tile * NUM_BUCKETS + offs_c, sums, mask=offs_c < NUM_BUCKETS)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def _bucket_geometry(geometry) -> tuple[int, int, int]:
    """(N, BQ, BK) of the buckets; without a geometry (no bias) the kernels compute no bucket and read none."""
    return (0, 1, 1) if geometry is None else (geometry.seq_len, geometry.block_q, geometry.block_k)


def block_logits_launch(
    qs: Tensor, ks: Tensor, temperature: Tensor, bias: Tensor | None, geometry, query_blocks: Tensor | None
) -> Tensor:
    """float32 ``[B, H, R, NKB]``, contiguous. No validation: float32 ``qs [B, H, R, S]``, ``ks [B, H, NKB, S]``
    (any strides), ``temperature [H]`` and ``bias [H, C]`` contiguous, ``query_blocks`` int32 ``[R]`` or None."""
    B, H, R, S = qs.shape
    NKB = ks.shape[2]
    out = torch.empty((B, H, R, NKB), device=qs.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    seq_len, block_q, block_k = _bucket_geometry(geometry)
    _block_logits_kernel[(triton.cdiv(R, _TILE), triton.cdiv(NKB, _TILE), B * H)](
        qs,
        ks,
        temperature,
        temperature if bias is None else bias,
        out if query_blocks is None else query_blocks,
        out,
        *qs.stride(),
        *ks.stride(),
        H,
        R,
        NKB,
        S,
        seq_len,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        NUM_BUCKETS=DISTANCE_BUCKETS,
        BR=_TILE,
        BN=_TILE,
        S_P2=max(16, triton.next_power_of_2(S)),
        HAS_BIAS=bias is not None,
        HAS_QUERY_BLOCKS=query_blocks is not None,
        num_warps=4,
    )
    return out


def block_logits_sums_launch(
    grad: Tensor, qs: Tensor, ks: Tensor, with_bias: bool, geometry, query_blocks: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """(float32 ``[H]`` sum over b, r, j of grad * qs ks^T; float32 ``[H, C]`` sum of grad over each bucket, or
    None without a bias): the temperature's and the bias's gradients, from per-tile partials summed in a fixed
    order. No validation (as :func:`block_logits_launch`; ``grad [B, H, R, NKB]`` float32, any strides)."""
    B, H, R, S = qs.shape
    NKB = ks.shape[2]
    grid = (triton.cdiv(R, _TILE), triton.cdiv(NKB, _TILE), B * H)
    temperature_part = torch.empty((B, H, grid[0] * grid[1]), device=qs.device, dtype=torch.float32)
    bias_part = (
        torch.empty((B, H, grid[0] * grid[1], DISTANCE_BUCKETS), device=qs.device, dtype=torch.float32)
        if with_bias
        else temperature_part
    )
    if grad.numel():
        seq_len, block_q, block_k = _bucket_geometry(geometry)
        _block_logits_sums_kernel[grid](
            grad,
            qs,
            ks,
            temperature_part if query_blocks is None else query_blocks,
            temperature_part,
            bias_part,
            *grad.stride(),
            *qs.stride(),
            *ks.stride(),
            H,
            R,
            NKB,
            S,
            seq_len,
            BLOCK_Q=block_q,
            BLOCK_K=block_k,
            NUM_BUCKETS=DISTANCE_BUCKETS,
            BUCKETS_P2=triton.next_power_of_2(DISTANCE_BUCKETS),
            BR=_TILE,
            BN=_TILE,
            S_P2=max(16, triton.next_power_of_2(S)),
            HAS_BIAS=with_bias,
            HAS_QUERY_BLOCKS=query_blocks is not None,
            num_warps=4,
        )
    else:
        temperature_part.zero_()
        bias_part.zero_()
    return temperature_part.sum(dim=(0, 2)), bias_part.sum(dim=(0, 2)) if with_bias else None


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd op
# ----------------------------------------------------------------------------------------------
class _FusedBlockLogits(torch.autograd.Function):
    """Forward: the kernel. Backward: the gradients of the reference's formula (logits = temp raw + bias, raw
    = qs ks^T): two matmuls for qs and ks, one kernel for the temperature's and the bias's sums (the raw product
    recomputed per tile instead of saved; the reference's bucket lookup took ~80 small kernels there)."""

    @staticmethod
    def forward(ctx, qs, ks, temperature, bias, geometry, query_blocks):
        query_blocks = None if query_blocks is None else query_blocks.to(torch.int32).contiguous()
        ctx.save_for_backward(qs, ks, temperature)
        ctx.geometry = geometry
        ctx.query_blocks = query_blocks
        ctx.has_bias = bias is not None
        return block_logits_launch(
            qs.detach(),
            ks.detach(),
            temperature.detach().contiguous(),
            None if bias is None else bias.detach().contiguous(),
            geometry,
            query_blocks,
        )

    @staticmethod
    def backward(ctx, grad):
        qs, ks, temperature = ctx.saved_tensors
        grad = grad.float()
        grad_raw = grad * temperature.view(1, -1, 1, 1)
        grad_qs = torch.matmul(grad_raw, ks) if ctx.needs_input_grad[0] else None
        grad_ks = torch.matmul(grad_raw.transpose(-1, -2), qs) if ctx.needs_input_grad[1] else None
        grad_temperature = grad_bias = None
        with_bias = ctx.has_bias and ctx.needs_input_grad[3]
        if ctx.needs_input_grad[2] or with_bias:
            grad_temperature, grad_bias = block_logits_sums_launch(
                grad, qs.detach(), ks.detach(), with_bias, ctx.geometry, ctx.query_blocks
            )
            if not ctx.needs_input_grad[2]:
                grad_temperature = None
        return grad_qs, grad_ks, grad_temperature, grad_bias, None, None


# ----------------------------------------------------------------------------------------------
# Layer 4: public function
# ----------------------------------------------------------------------------------------------
def triton_block_logits(
    qs: Tensor,
    ks: Tensor,
    temperature: Tensor,
    bias: Tensor | None = None,
    geometry=None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """The selector's block logits in one kernel, differentiable; the semantics of
    :func:`sparse_train.selection.scorer.reference_block_logits`.

    Args:
        qs: float32 ``[B, H, R, S]`` projected pooled queries (R = NQB, or the length of ``query_blocks``).
        ks: float32 ``[B, H, NKB, S]`` projected pooled keys. Any strides; CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        temperature: float32 ``[H]``, the logit scale per head.
        bias: optional float32 ``[H, C]``, C = ``DISTANCE_BUCKETS``: the distance bias per log2 bucket (needs
            ``geometry``).
        geometry: the call's ``SelectionGeometry`` (N, BQ, BK, NKB), required with ``bias``.
        query_blocks: optional int ``[R]``, the global query-block id of each row (values not checked here: the
            callers check them).

    Returns:
        float32 ``[B, H, R, NKB]``.

    Raises:
        ValueError: shapes that do not match, a dtype other than float32, tensors on different devices, a bias
            without a geometry.
    """
    if qs.dim() != 4 or ks.dim() != 4 or qs.shape[:2] != ks.shape[:2] or qs.shape[3] != ks.shape[3]:
        raise ValueError(
            f"qs [B, H, R, S] and ks [B, H, NKB, S] must agree on B, H and S, got {tuple(qs.shape)} "
            f"and {tuple(ks.shape)}"
        )
    H = qs.shape[1]
    for name, tensor in (("qs", qs), ("ks", ks), ("temperature", temperature), ("bias", bias)):
        if tensor is not None and (tensor.dtype != torch.float32 or tensor.device != qs.device):
            raise ValueError(f"{name} must be float32 on {qs.device}, got {tensor.dtype} on {tensor.device}")
    if temperature.shape != (H,):
        raise ValueError(f"temperature must be [H] = [{H}], got {tuple(temperature.shape)}")
    if bias is not None:
        if geometry is None:
            raise ValueError("the distance bias needs the selection geometry")
        if bias.shape != (H, DISTANCE_BUCKETS):
            raise ValueError(f"bias must be [H, C] = [{H}, {DISTANCE_BUCKETS}], got {tuple(bias.shape)}")
    if geometry is not None and ks.shape[2] != geometry.num_k_blocks:
        raise ValueError(f"ks has {ks.shape[2]} key blocks, the geometry {geometry.num_k_blocks}")
    if query_blocks is not None and query_blocks.shape != (qs.shape[2],):
        raise ValueError(f"query_blocks must list the {qs.shape[2]} rows of qs, got {tuple(query_blocks.shape)}")
    return _FusedBlockLogits.apply(qs, ks, temperature, bias, geometry, query_blocks)
