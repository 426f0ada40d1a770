"""The model of the held-out evaluation, written as a user writes one (not the package's Lightning model).

Token embedding, ``layers`` pre-LayerNorm blocks (attention, GELU MLP), a final LayerNorm and an untied
LM head. Attention has grouped KV heads (GQA) and RoPE that rotates *interleaved* pairs
``(x[2i], x[2i+1])`` as torchtune and Meta's reference Llama do. The attention *core* (what turns post-RoPE
q, k, v into the output) is swappable: :class:`DenseCore` (causal SDPA), ``st.SparseAttention`` or
:class:`RowOracleCore` (each query row keeps its own best key blocks, for measuring what sharing a
selection across a query block costs).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DenseCore", "EvalModel", "RowOracleCore", "rope_interleaved", "row_oracle_selection"]


def rope_interleaved(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """RoPE over interleaved pairs: ``(x[2i], x[2i+1])`` rotated by ``position * theta ** (-2i / D)``.
    x ``[B, H, N, D]``, positions ``[N]``; computed in float32, returned in x's dtype."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
    cos, sin = angles.cos(), angles.sin()
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class DenseCore(nn.Module):
    """Dense causal attention: ``F.scaled_dot_product_attention(is_causal=True)``, k/v repeated per GQA group."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)


def row_oracle_selection(
    q: Tensor, k: Tensor, rows: tuple[int, int], *, top_k: int, block: int, window: int, sinks: int, scale: float
) -> tuple[Tensor, Tensor]:
    """bool ``[B, HQ, r1 - r0, r1]``: the keys query rows ``r0 .. r1-1`` may attend under the row oracle, and
    float32 ``[B, HQ, r1 - r0]``: the dense attention mass each (query head, row) keeps on them (its mass recall).

    Each row's dense attention mass per key block (block size ``block``), max over the heads of its GQA
    group, picks the row's ``top_k`` best blocks among the causal blocks that the window and sinks do not
    already cover; the row then reads those blocks, its window (the block holding the row and the
    ``window - 1`` blocks before it) and the sink blocks ``0 .. sinks-1``, each causally masked.
    q ``[B, HQ, N, D]``, k ``[B, HKV, N, D]`` (post-RoPE; no gradient flows through the mask)."""
    r0, r1 = rows
    batch, hq, _, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    device = q.device
    with torch.no_grad():
        qc = q[:, :, r0:r1].float()
        keys = k[:, :, :r1].float().repeat_interleave(group, dim=1)
        row_pos = torch.arange(r0, r1, device=device)
        key_pos = torch.arange(r1, device=device)
        causal = key_pos[None, :] <= row_pos[:, None]  # [C, r1]
        logits = (qc @ keys.transpose(-1, -2)) * scale
        probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [B, HQ, C, r1]
        nkb = math.ceil(r1 / block)
        probs = F.pad(probs, (0, nkb * block - r1))
        mass = probs.view(batch, hkv, group, r1 - r0, nkb, block).sum(-1).amax(dim=2)  # [B, HKV, C, NKB]
        blocks = torch.arange(nkb, device=device)
        own = (row_pos // block)[:, None]  # [C, 1]
        forced = ((blocks[None, :] > own - window) & (blocks[None, :] <= own)) | (blocks[None, :] < sinks)
        reachable = blocks[None, :] <= own
        candidates = mass.masked_fill(forced | ~reachable, float("-inf"))
        best = candidates.topk(min(top_k, nkb), dim=-1)
        chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, best.indices, best.values > float("-inf"))
        allowed = chosen | (forced & reachable)  # [B, HKV, C, NKB]
        keys_allowed = (allowed.repeat_interleave(block, dim=-1)[..., :r1] & causal).repeat_interleave(group, dim=1)
        kept = (probs[..., :r1] * keys_allowed).sum(-1)  # [B, HQ, C]
        return keys_allowed, kept


class RowOracleCore(nn.Module):
    """Attention restricted by :func:`row_oracle_selection`'s mask (selection per query row instead of per query
    block), applied as a boolean mask to SDPA over chunks of ``chunk_rows`` query rows so long rows fit
    in memory. Dense causal attention for the first ``dense_warmup_steps`` training forwards (and in eval
    before that), as ``st.SparseAttention`` does."""

    def __init__(
        self, *, top_k: int, block: int, window: int, sinks: int, dense_warmup_steps: int, chunk_elements: int = 1 << 27
    ) -> None:
        super().__init__()
        self.top_k, self.block, self.window, self.sinks = top_k, block, window, sinks
        self.dense_warmup_steps = dense_warmup_steps
        self.chunk_elements = chunk_elements
        self.training_calls = 0
        self.dense = DenseCore()
        self.last_density: Tensor | None = None
        self.last_mass_recall: Tensor | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        warming_up = self.training_calls < self.dense_warmup_steps
        if self.training:
            self.training_calls += 1
        if warming_up:
            self.last_density = self.last_mass_recall = None
            return self.dense(q, k, v)
        batch, hq, n, d = q.shape
        group = hq // k.shape[1]
        k, v = k.to(q.dtype), v.to(q.dtype)
        kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows = max(self.block, self.chunk_elements // max(1, batch * hq * n) // self.block * self.block)
        outputs = []
        kept = q.new_zeros((), dtype=torch.float32)
        recall = q.new_zeros((), dtype=torch.float32)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            mask, mass = row_oracle_selection(
                q,
                k,
                (r0, r1),
                top_k=self.top_k,
                block=self.block,
                window=self.window,
                sinks=self.sinks,
                scale=1.0 / math.sqrt(d),
            )
            kept = kept + mask.sum(dtype=torch.float32)
            recall = recall + mass.sum()
            outputs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], kr[:, :, :r1], vr[:, :, :r1], attn_mask=mask))
        # fraction of the causal (query, key) pairs attended: a tensor, read only when logged
        self.last_density = kept / (batch * hq * n * (n + 1) / 2)
        # mean over (query head, row) of the dense attention mass kept, as st.collect_attention_stats' mass recall
        self.last_mass_recall = recall / (batch * hq * n)
        return torch.cat(outputs, dim=2)


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.theta = num_heads, num_kv_heads, head_dim, theta
        self.norm1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, num_heads * head_dim, bias=False)
        self.k = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.v = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.core: nn.Module = DenseCore()

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope_interleaved(q, positions, self.theta), rope_interleaved(k, positions, self.theta)
        o = self.core(q, k, v)
        x = x + self.o(o.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class EvalModel(nn.Module):
    """Decoder-only LM: embedding, ``layers`` blocks, final LayerNorm, untied head. ``set_cores(make)``
    replaces every block's attention core by ``make()`` (the model's own weights stay as they are)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 256,
        layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        if d_model % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"d_model={d_model} must be a multiple of num_heads={num_heads}, and num_heads of "
                f"num_kv_heads={num_kv_heads}"
            )
        self.head_dim = d_model // num_heads
        self.num_heads, self.num_kv_heads, self.rope_theta = num_heads, num_kv_heads, rope_theta
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, num_heads, num_kv_heads, self.head_dim, rope_theta) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # GPT-2's embedding scale: nn.Embedding's N(0, 1) rows are so long that Adam's steps of size lr
        # barely turn them, and every token's embedding is learnt from scratch here
        nn.init.normal_(self.embed.weight, std=0.02)

    def set_cores(self, make: Callable[[], nn.Module]) -> None:
        for block in self.blocks:
            block.core = make()

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x))
