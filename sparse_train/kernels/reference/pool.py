"""PyTorch reference of the selector's block pooling (the semantics ``kernels/triton/pool.py`` computes, and the path
of every input the kernel does not take).

Math, for x ``[B, H * G, N, D]`` (G heads of a group, blocks of BLK rows, rows past ``valid_len[b]`` left out):
    x'[b, h, n] = mean_g x[b, h * G + g, n]  (then un-rotated by RoPE: x'[n] turned by -n * inv_freq)
    mean[b, h, j] = mean over the valid rows n of block j of x'[b, h, n];  max[b, h, j] likewise, element-wise
    a block without a valid row pools to 0.

Notation: B batch, H pooled heads (the KV heads), G heads averaged per pooled head (the GQA group for
queries, 1 for keys), N length, D head dim, BLK rows per block, R = 2 * len(inv_freq) rotated channels.
Without RoPE and without the max, the mean runs over (group, rows) at once (the same value).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROPE_STYLES", "block_mean", "block_max", "unrotate", "check_rope_args", "reference_block_pool"]

ROPE_STYLES = ("rotate_half", "interleaved")
"""RoPE conventions :func:`unrotate` undoes: pairs ``(i, i + R/2)`` or ``(2i, 2i + 1)``."""


def reference_block_pool(
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
    """Block pooling of ``x`` ``[B, H * group, N, D]`` as the selector pools its queries (``group`` = the GQA
    group) and keys (``group`` = 1): float32 ``[B, H, ceil(N / block), D]`` of block means, or
    ``[..., 2 * D]`` with the block maxima after them (``with_max``); float64 for a float64 ``x``.

    ``inv_freq`` (``[R / 2]``, optional): un-rotate RoPE (:func:`unrotate` in the ``rope_style`` convention, at
    ``positions`` ``[N]`` or ``[B, N]``, default ``0..N-1``) after averaging the group and before pooling. ``valid_len``
    (int ``[B]``):
    rows at positions >= valid_len[b] are left out (never read: NaN there stays out)."""
    rope = inv_freq is not None and inv_freq.numel() > 0
    if rope or (with_max and group > 1):
        x, group = group_mean(x, group), 1
    if rope:
        x = unrotate(x, inv_freq, positions, rope_style)
    mean = block_mean(x, block, group, valid_len)
    return torch.cat([mean, block_max(x, block, 1, valid_len)], dim=-1) if with_max else mean


def group_mean(x: Tensor, group: int) -> Tensor:
    """float32 (float64 for float64) mean of ``x`` ``[B, H * group, N, D]`` over each run of ``group`` heads."""
    batch, heads_total, seq_len, dim = x.shape
    dtype = torch.promote_types(x.dtype, torch.float32)
    return x.reshape(batch, heads_total // group, group, seq_len, dim).mean(2, dtype=dtype)


def check_rope_args(inv_freq: Tensor, positions, batch: int, seq_len: int, dim: int) -> None:
    """Raise ValueError unless ``inv_freq`` rotates at most ``dim`` channels and ``positions`` is None or a
    tensor ``[N]`` / ``[B, N]``."""
    half = inv_freq.shape[0]
    if 2 * half > dim:
        raise ValueError(f"{half} RoPE frequencies rotate {2 * half} channels but the head dim is {dim}")
    if positions is not None and (
        not isinstance(positions, Tensor) or positions.shape not in ((seq_len,), (batch, seq_len))
    ):
        raise ValueError(
            f"positions must be a tensor [N] or [B, N] = [{batch}, {seq_len}], got "
            f"{getattr(positions, 'shape', type(positions).__name__)}"
        )


def block_mean(x: Tensor, block: int, group: int = 1, valid_len: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over blocks of ``block`` rows and over ``group`` consecutive heads.

    Args:
        x: ``[B, H * group, N, D]`` (any strides).
        block: rows per block; the last block may be partial.
        group: heads averaged together (the GQA group for queries, 1 for keys).
        valid_len: optional int ``[B]``; rows at positions >= valid_len[b] are left out of the mean
            (their contents never matter, NaN included).

    Returns:
        float32 (float64 for a float64 ``x``) ``[B, H, ceil(N / block), D]``; a block with no valid row is all zeros.
    """
    return _block_pool(x, block, group, valid_len, "mean")


def block_max(x: Tensor, block: int, group: int = 1, valid_len: Tensor | None = None) -> Tensor:
    """Element-wise max of ``x`` over blocks of ``block`` rows and ``group`` heads (as :func:`block_mean`;
    a block with no valid row is all zeros)."""
    return _block_pool(x, block, group, valid_len, "max")


def _block_pool(x: Tensor, block: int, group: int, valid_len: Tensor | None, how: str) -> Tensor:
    # Runs on q and k every step: reduce straight from the input dtype (fp32 accumulation for the
    # mean, exact max in the input dtype) without materialising an fp32 copy of q.
    batch, heads_total, seq_len, dim = x.shape
    heads = heads_total // group
    x = x.reshape(batch, heads, group, seq_len, dim)
    limit = torch.full((batch,), seq_len, device=x.device) if valid_len is None else valid_len.clamp(max=seq_len)
    if valid_len is not None:
        keep = torch.arange(seq_len, device=x.device).view(1, -1) < limit.view(-1, 1)  # [B, N]
        # selection, not multiplication: padded rows may hold NaN or inf
        x = torch.where(keep.view(batch, 1, 1, seq_len, 1), x, 0.0 if how == "mean" else float("-inf"))

    dtype = torch.promote_types(x.dtype, torch.float32)

    def reduce(t: Tensor, dims: tuple[int, int]) -> Tensor:
        return t.sum(dim=dims, dtype=dtype) if how == "mean" else t.amax(dim=dims).to(dtype)

    full = seq_len // block
    parts = []
    if full > 0:
        parts.append(reduce(x[:, :, :, : full * block].reshape(batch, heads, group, full, block, dim), (2, 4)))
    if seq_len > full * block:
        parts.append(reduce(x[:, :, :, full * block :], (2, 3)).unsqueeze(2))
    pooled = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]  # [B, H, NB, D]
    starts = torch.arange(pooled.shape[2], device=x.device) * block
    rows = torch.clamp(torch.minimum(limit.view(-1, 1), starts.view(1, -1) + block) - starts.view(1, -1), min=0)
    rows = (rows * group).view(batch, 1, pooled.shape[2], 1)  # valid rows per block, [B, 1, NB, 1]
    if how == "mean":
        pooled = pooled / rows.clamp(min=1).to(dtype)
    return torch.where(rows > 0, pooled, 0.0)


def unrotate(x: Tensor, inv_freq: Tensor, positions: Tensor | None = None, style: str = "rotate_half") -> Tensor:
    """Undo RoPE: float32 ``[B, H, N, D]`` from ``x [B, H, N, D]`` (float64 for a float64 ``x``: the oracle
    of the tests).

    RoPE turns pair i of the first ``R = 2 * len(inv_freq)`` channels by the angle ``n * inv_freq[i]`` at
    position n (channels past R are not rotated); this applies the opposite turn, which recovers the content
    the model wrote before the rotation. The pairs are ``(x[i], x[i + R/2])`` with ``style="rotate_half"`` (Hugging
    Face Llama / Qwen) and ``(x[2i], x[2i + 1])`` with ``style="interleaved"`` (torchtune, Meta's reference
    Llama, GPT-J).

    Args:
        positions: the positions RoPE used, integer or float ``[N]`` or ``[B, N]`` (packed documents
            restart at 0 per document, left-padded rows start later); ``None`` = ``0..N-1``.
        style: ``"rotate_half"`` or ``"interleaved"``.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"RoPE style must be one of {ROPE_STYLES}, got {style!r}")
    half = inv_freq.shape[0]
    batch, _, seq_len, dim = x.shape
    check_rope_args(inv_freq, positions, batch, seq_len, dim)
    if positions is None:
        positions = torch.arange(seq_len, device=x.device)
    dtype = torch.promote_types(x.dtype, torch.float32)
    positions = positions.to(x.device, dtype)
    angles = positions.unsqueeze(-1) * inv_freq.to(x.device, dtype)  # [(B,) N, R/2]
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # [B, 1, N, R/2]
    cos, sin = angles.cos(), angles.sin()
    x = x.to(dtype)
    rest = x[..., 2 * half :]
    if style == "interleaved":
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        turned = torch.stack((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).flatten(-2)
        return torch.cat((turned, rest), dim=-1)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin, rest), dim=-1)
