"""PyTorch reference of the token selector's token-level distillation loss (``selector_distill="token"``), the
semantics ``kernels/triton/token_kl.py`` computes.

Math, per batch b, KV head h and listed row r (a row of a listed query block, at position pos_r):

    allowed(r, t) = t <= pos_r, t < seq_lens[b], t in pos_r's document, pos_r < min(N, seq_lens[b])
    p_g[r, t]     = softmax over the allowed t of  scale * q[b, h G + g, r] . k[b, h, t]      (one per GQA head g)
    target[r, t]  = max over g of p_g[r, t], renormalised over t
    z[r, t]       = temperature[h] * max over index heads e of  u[b, h, r, e] . w[b, h, t]
    kl[r]         = sum over allowed t of  target (log target - log_softmax(z))     (0 for a row without keys)

The target takes no gradient; u, w and the temperature do (through z). A valid row always has a key (its own), so
the rows with keys are the valid rows (:func:`token_kl_rows`).

Notation: B batch, H KV heads, G query heads per KV head, N length, D head dim, E index heads, S index dim, BQ query
block, R listed query blocks, M = R * BQ listed rows (block by block).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .index_scores import listed_positions, sequence_lengths

__all__ = ["reference_token_kl", "token_kl_rows"]


def token_kl_rows(query_blocks: Tensor, block_q: int, seq_len: int, seq_lens: Tensor | None, batch: int) -> Tensor:
    """bool ``[B, M]``: the listed rows that are valid (inside the sequence and before ``seq_lens[b]``): the rows
    with at least one allowed key, over which the loss is averaged."""
    device = query_blocks.device
    positions = listed_positions(query_blocks, block_q, device).view(1, -1)
    return positions < sequence_lengths(seq_lens, batch, seq_len, device).view(-1, 1)


def reference_token_kl(
    u: Tensor,
    w: Tensor,
    q_rows: Tensor,
    k: Tensor,
    temperature: Tensor,
    query_blocks: Tensor,
    *,
    block_q: int,
    scale: float,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Per-row KL ``[B, H, M]`` of the module docstring, float32 (float64 for float64 inputs), 0 on rows without
    keys; differentiable in ``u``, ``w`` and ``temperature``.

    Args:
        u: ``[B, H, M, E, S]`` index queries of the listed rows. w: ``[B, H, N, S]`` index keys.
        q_rows: ``[B, H * G, M, D]`` the attention's queries at the listed rows (positions past N repeat row N - 1).
        k: ``[B, H, N, D]`` the attention's keys. temperature: ``[H]``, the index logits' multiplier.
        query_blocks: int ``[R]``, the listed query blocks. seq_lens: int ``[B]`` or None. document_ids: int
        ``[B, N]`` or None.

    One listed block at a time: memory O(H G BQ N)."""
    batch, heads, seq_len, _ = k.shape
    group = q_rows.shape[1] // heads
    device = k.device
    dtype = torch.promote_types(torch.promote_types(u.dtype, q_rows.dtype), torch.float32)
    keys = torch.arange(seq_len, device=device)
    limit = sequence_lengths(seq_lens, batch, seq_len, device)
    temperature = temperature.to(dtype).view(1, -1, 1, 1)
    with torch.no_grad():
        k_wide = k.detach().to(dtype)  # once for every listed block
    w_wide = w.to(dtype)
    per_block = []
    for listed, block in enumerate(query_blocks.to(device, torch.int64).unbind(0)):
        positions = block * block_q + torch.arange(block_q, device=device)
        rows = positions.clamp(max=seq_len - 1)
        valid = (positions < seq_len).view(1, -1, 1) & (rows.view(1, -1, 1) < limit.view(-1, 1, 1))  # [B, BQ, 1]
        allowed = (keys.view(1, 1, -1) <= rows.view(1, -1, 1)) & (keys.view(1, 1, -1) < limit.view(-1, 1, 1))
        if document_ids is not None:
            allowed = allowed & (document_ids[:, rows].unsqueeze(-1) == document_ids.unsqueeze(1))
        allowed = (allowed & valid).unsqueeze(1)  # [B, 1, BQ, N]
        span = slice(listed * block_q, (listed + 1) * block_q)
        with torch.no_grad():
            q_block = q_rows[:, :, span].detach().to(dtype).view(batch, heads, group, block_q, q_rows.shape[-1])
            logits = torch.einsum("bhgrd,bhnd->bhgrn", q_block, k_wide) * scale
            probs = torch.softmax(logits.masked_fill(~allowed.unsqueeze(2), float("-inf")), dim=-1)
            target = torch.nan_to_num(probs).amax(dim=2)  # [B, H, BQ, N]: max over the group's heads
            target = target / target.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        index_logits = torch.einsum("bhres,bhns->bhren", u[:, :, span].to(dtype), w_wide).amax(dim=3)
        log_p = torch.log_softmax((index_logits * temperature).masked_fill(~allowed, float("-inf")), dim=-1)
        kl = torch.where(target > 0, target * (torch.log(target.clamp(min=1e-30)) - log_p), 0.0)
        per_block.append(torch.where(allowed.any(dim=-1), kl.sum(dim=-1), 0.0))  # [B, H, BQ]
    if not per_block:
        return torch.zeros(batch, heads, 0, device=device, dtype=dtype)
    return torch.cat(per_block, dim=-1)
