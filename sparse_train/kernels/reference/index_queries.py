"""PyTorch reference of the token indexer's inputs: RoPE undone, rows past the length zeroed, and the index queries
(the GQA group's heads projected together). ``kernels/triton/index_queries.py`` computes the index queries in one
pass with these semantics.

Math, for q ``[B, HKV * G, N, D]`` (G query heads per KV head) and the projection ``weight`` ``[HKV, G * D, X]``:

    x'[b, h, n]   = unrotate(x)[b, h, n]  (RoPE undone, when frequencies are given), 0 for rows n >= valid_len[b]
    u[b, h, n, :] = sum over g < G of  q'[b, h G + g, n, :] @ weight[h, g D : (g + 1) D, :]

x' is rounded to the indexer's input dtype (:func:`index_input_dtype`) before the product, as the indexer stores
it; the product accumulates in float32 (float64 for float64) and is rounded to that dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .pool import unrotate

__all__ = ["index_input", "index_input_dtype", "project_index_queries", "reference_index_queries"]


def index_input_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the indexer reads its inputs in: float16 / bfloat16 kept, float32 for float32 and below, float64
    for float64."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.promote_types(dtype, torch.float32)


def index_input(
    x: Tensor,
    inv_freq: Tensor | None = None,
    positions: Tensor | None = None,
    style: str = "rotate_half",
    valid_len: Tensor | None = None,
) -> Tensor:
    """x' of the module docstring for ``x`` ``[B, H, N, D]`` (queries or keys), in :func:`index_input_dtype`.

    ``inv_freq`` ``[R / 2]`` or None (nothing to undo), ``positions`` ``[N]`` / ``[B, N]`` or None (``0..N-1``),
    ``style`` ``"rotate_half"`` or ``"interleaved"``, ``valid_len`` int ``[B]`` or None. Rows past ``valid_len``
    may hold anything (NaN padding): they are replaced by 0 before any arithmetic."""
    dtype = index_input_dtype(x.dtype)
    if valid_len is not None:
        keep = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1) < valid_len.to(x.device).view(-1, 1, 1, 1)
        x = torch.where(keep, x, 0.0)
    if inv_freq is not None:
        x = unrotate(x, inv_freq, positions, style)
    return x.to(dtype)


def project_index_queries(q_input: Tensor, weight: Tensor) -> Tensor:
    """``[B, HKV, M, X]``: the product of the module docstring on already prepared rows ``q_input``
    ``[B, HKV * G, M, D]`` (:func:`index_input`'s result), in q_input's dtype; ``weight`` ``[HKV, G * D, X]``, cast to
    that dtype."""
    batch, heads, rows, dim = q_input.shape
    kv_heads = weight.shape[0]
    group = heads // kv_heads
    grouped = q_input.reshape(batch, kv_heads, group, rows, dim)
    weight = weight.to(q_input.dtype).view(kv_heads, group, dim, -1)
    return torch.einsum("bhgmd,hgdx->bhmx", grouped, weight)


def reference_index_queries(
    q: Tensor,
    weight: Tensor,
    inv_freq: Tensor | None = None,
    positions: Tensor | None = None,
    style: str = "rotate_half",
    valid_len: Tensor | None = None,
) -> Tensor:
    """Index queries u ``[B, HKV, N, X]`` of q ``[B, HKV * G, N, D]`` with ``weight`` ``[HKV, G * D, X]``, in
    :func:`index_input_dtype` of q's dtype (module docstring); the RoPE arguments as :func:`index_input`'s."""
    return project_index_queries(index_input(q, inv_freq, positions, style, valid_len), weight)
