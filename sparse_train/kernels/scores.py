"""Triton kernel of the selector's block logits: the projected product, temperature and distance bias in one pass.

Math, per (batch b, KV head h, row r of query block i = r, or query_blocks[r], key block j):
    logits[b, h, r, j] = temp[h] * sum_s qs[b, h, r, s] ks[b, h, j, s]  +  bias[h, bucket(i, j)]
    bucket(i, j) = bit length of max(last_i - j, 0), at most C - 1   (0 on and past the causal edge, 1 for one
    block back, 2 for 2-3 blocks back, ...);  last_i = (min((i + 1) BQ, N) - 1) // BK

Notation: B batch, H KV heads, R query-block rows, NKB key blocks, S = selector_dim, N length, BQ / BK block
sizes, C = NUM_BUCKETS (``selectors.scorer.DISTANCE_BUCKETS``), BR x BN the output tile of a program.

Layers: (1) ``_block_logits_kernel``, one program per [BR, BN] tile of one (b, h) matrix: an IEEE float32 dot
over S (as the reference's float32 matmul), then the temperature and the bias looked up from the bucket the
program computes from (i, j), written once; (2) the launcher ``block_logits_launch``; (3) the autograd op
``_FusedBlockLogits``: the kernel forward, the reference's gradient formulas in PyTorch backward (the
selector's distillation trains through it); (4) the public function ``triton_block_logits``. The reference is
``selectors.scorer.reference_block_logits`` (a float32 matmul, a product with the temperature, the bucket table
from ``block_distance_buckets`` and a lookup: about ten kernels and three float32 [B, H, R, NKB] passes).

Known limits: float32 only (the scorer's dtype); the bias's gradient sums over the buckets' masks as the
reference's does (C passes over the gradient, deterministic); the float32 sums are ordered differently from
cuBLAS's, so logits differ from the reference's by rounding (the top-k of near-ties may differ).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..selectors.scorer import DISTANCE_BUCKETS, bucket_sums, distance_buckets_of_rows

__all__ = ["block_logits_launch", "triton_block_logits"]

_TILE = 64  # BR = BN: rows and key blocks per program


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _block_logits_kernel(
    QS, KS, TEMPERATURE, BIAS, QUERY_BLOCKS, OUT,
    stride_qb, stride_qh, stride_qr, stride_qs,
    stride_kb, stride_kh, stride_kj, stride_ks,
    H, R, NKB, S, N,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, NUM_BUCKETS: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    S_P2: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_QUERY_BLOCKS: tl.constexpr,
):
    batch_head = tl.program_id(2)
    b64 = (batch_head // H).to(tl.int64)
    h = batch_head % H
    h64 = h.to(tl.int64)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    offs_s = tl.arange(0, S_P2)
    row_ok = rows < R
    col_ok = cols < NKB
    s_ok = offs_s < S
    qs = tl.load(QS + b64 * stride_qb + h64 * stride_qh + rows.to(tl.int64)[:, None] * stride_qr
                 + offs_s[None, :] * stride_qs, mask=row_ok[:, None] & s_ok[None, :], other=0.0)  # [BR, S]
    ks = tl.load(KS + b64 * stride_kb + h64 * stride_kh + cols.to(tl.int64)[:, None] * stride_kj
                 + offs_s[None, :] * stride_ks, mask=col_ok[:, None] & s_ok[None, :], other=0.0)  # [BN, S]
    raw = tl.dot(qs, tl.trans(ks), input_precision="ieee")  # [BR, BN]
    logits = raw * tl.load(TEMPERATURE + h)
    if HAS_BIAS:
        if HAS_QUERY_BLOCKS:
            blocks = tl.load(QUERY_BLOCKS + rows, mask=row_ok, other=0)  # [BR] global query blocks
        else:
            blocks = rows
        last = (tl.minimum((blocks + 1) * BLOCK_Q, N) - 1) // BLOCK_K  # [BR] last causal key block
        behind = tl.maximum(last[:, None] - cols[None, :], 0)  # [BR, BN]
        bucket = tl.zeros([BR, BN], tl.int32)
        for e in tl.static_range(NUM_BUCKETS - 1):
            bucket += (behind >= (1 << e)).to(tl.int32)
        logits = logits + tl.load(BIAS + h64 * NUM_BUCKETS + bucket)  # 16 values: the lookups hit the cache
    out = OUT + ((b64 * H + h64) * R + rows.to(tl.int64))[:, None] * NKB + cols[None, :]
    tl.store(out, logits, mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def block_logits_launch(qs: Tensor, ks: Tensor, temperature: Tensor, bias: Tensor | None, geometry,
                        query_blocks: Tensor | None) -> Tensor:
    """float32 ``[B, H, R, NKB]``, contiguous. No validation: float32 ``qs [B, H, R, S]``, ``ks [B, H, NKB, S]``
    (any strides), ``temperature [H]`` and ``bias [H, C]`` contiguous, ``query_blocks`` int32 ``[R]`` or None."""
    B, H, R, S = qs.shape
    NKB = ks.shape[2]
    out = torch.empty((B, H, R, NKB), device=qs.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    # without a bias the geometry is not read (the kernel computes no bucket)
    seq_len, block_q, block_k = (0, 1, 1) if geometry is None else (geometry.seq_len, geometry.block_q, geometry.block_k)
    _block_logits_kernel[(triton.cdiv(R, _TILE), triton.cdiv(NKB, _TILE), B * H)](
        qs, ks, temperature, temperature if bias is None else bias, out if query_blocks is None else query_blocks,
        out, *qs.stride(), *ks.stride(), H, R, NKB, S, seq_len,
        BLOCK_Q=block_q, BLOCK_K=block_k, NUM_BUCKETS=1 if bias is None else bias.shape[1],
        BR=_TILE, BN=_TILE, S_P2=max(16, triton.next_power_of_2(S)), HAS_BIAS=bias is not None,
        HAS_QUERY_BLOCKS=query_blocks is not None, num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd op
# ----------------------------------------------------------------------------------------------
class _FusedBlockLogits(torch.autograd.Function):
    """Forward: the kernel. Backward: the gradients of the reference's formula (logits = temp raw + bias, raw
    = qs ks^T), the raw product recomputed (one small matmul) instead of saved."""

    @staticmethod
    def forward(ctx, qs, ks, temperature, bias, geometry, query_blocks):
        ctx.save_for_backward(qs, ks, temperature)
        ctx.geometry = geometry
        ctx.query_blocks = query_blocks
        ctx.has_bias = bias is not None
        ctx.num_buckets = 0 if bias is None else bias.shape[1]
        return block_logits_launch(qs.detach(), ks.detach(), temperature.detach().contiguous(),
                                   None if bias is None else bias.detach().contiguous(), geometry,
                                   None if query_blocks is None else query_blocks.to(torch.int32).contiguous())

    @staticmethod
    def backward(ctx, grad):

        qs, ks, temperature = ctx.saved_tensors
        grad_raw = grad * temperature.view(1, -1, 1, 1)
        grad_qs = torch.matmul(grad_raw, ks) if ctx.needs_input_grad[0] else None
        grad_ks = torch.matmul(grad_raw.transpose(-1, -2), qs) if ctx.needs_input_grad[1] else None
        grad_temperature = None
        if ctx.needs_input_grad[2]:
            raw = torch.matmul(qs, ks.transpose(-1, -2))
            grad_temperature = (grad * raw).sum(dim=(0, 2, 3))
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            buckets = distance_buckets_of_rows(ctx.geometry, ctx.query_blocks, grad.device)
            grad_bias = bucket_sums(grad.sum(0), buckets, ctx.num_buckets)
        return grad_qs, grad_ks, grad_temperature, grad_bias, None, None


# ----------------------------------------------------------------------------------------------
# Layer 4: public function
# ----------------------------------------------------------------------------------------------
def triton_block_logits(qs: Tensor, ks: Tensor, temperature: Tensor, bias: Tensor | None = None, geometry=None,
                        query_blocks: Tensor | None = None) -> Tensor:
    """The selector's block logits in one kernel, differentiable; the semantics of
    :func:`sparse_train.selectors.scorer.reference_block_logits`.

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
        raise ValueError(f"qs [B, H, R, S] and ks [B, H, NKB, S] must agree on B, H and S, got {tuple(qs.shape)} "
                         f"and {tuple(ks.shape)}")
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
