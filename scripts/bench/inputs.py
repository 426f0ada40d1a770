"""The benchmarks' inputs, built in one place so that every benchmark times the same data.

* :func:`benchmark_inputs`: q, k, v ``[B, H, N, D]`` and the output gradient, standard normal, seeded;
* :func:`random_selection` / :func:`build_index`: a seeded random top-k selection of causal key blocks for a
  pattern of :data:`PATTERNS`, made canonical with its window and sinks, and the index's plan;
* :func:`packed_document_ids`: document ids of a row packed with documents of random lengths;
* :func:`benchmark_tokens`: token ids for the training-step benchmarks;
* :func:`candidates_argument`: the value of the selector benchmarks' ``--candidates`` option.

The headline shape is B = 1, HQ = 32, HKV = 8, D = 128, bf16; the patterns are P64 (64-blocks, 1 sink + 8 window +
16 random top-k) and P128 (128-blocks, 1 sink + 4 window + 8 top-k).
"""

from __future__ import annotations

import argparse
import math

import torch

from sparse_train.documents import random_document_lengths
from sparse_train.index import BlockIndex, shares_document

PATTERNS = {"P64": dict(block=64, sinks=1, window=8, topk=16), "P128": dict(block=128, sinks=1, window=4, topk=8)}
B, HQ, HKV, D = 1, 32, 8, 128
DT = torch.bfloat16


def benchmark_inputs(
    n, head_dim=D, seed=0, *, batch=B, heads=HQ, kv_heads=HKV, dtype=DT, device="cuda", requires_grad=False
):
    """q ``[batch, heads, n, head_dim]``, k and v ``[batch, kv_heads, n, head_dim]`` and the output gradient do
    (q's shape), standard normal, drawn in that order after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    q = torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dtype, requires_grad=requires_grad)
    do = torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype)
    return q, k, v, do


def random_selection(n, pattern, seed=0, device="cuda", *, batch=B, kv_heads=HKV):
    """int32 ``[batch, kv_heads, NQB, topk]``: per query block, the ``pattern["topk"]`` causal key blocks of
    highest uniform random score (seeded), -1 where fewer are causal."""
    bs = pattern["block"]
    nqb = nkb = math.ceil(n / bs)
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(batch, kv_heads, nqb, nkb, device=device, generator=g)
    last = (torch.clamp((torch.arange(nqb, device=device) + 1) * bs, max=n) - 1) // bs
    causal = torch.arange(nkb, device=device).view(1, 1, 1, -1) <= last.view(1, 1, -1, 1)
    scores = scores.masked_fill(~causal, -1.0)
    val, sel = scores.topk(min(pattern["topk"], nkb), dim=-1)
    return torch.where(val >= 0, sel, -1).to(torch.int32)


def build_index(sel, n, pattern, r0=None, docs=None):
    """The canonical index of a selection with the pattern's window and sinks, and its plan (``r0``: the reuse
    threshold, default the plan's). With ``docs`` (int32 ``[B, N]`` document ids) the blocks that share no document
    with their query block are dropped, as a document-aware selection drops them."""
    idx = BlockIndex.from_selection(
        sel,
        seq_len=n,
        block_q=pattern["block"],
        block_k=pattern["block"],
        window=pattern["window"],
        sinks=pattern["sinks"],
    )
    if docs is not None:
        every_key_block = torch.arange(idx.num_k_blocks, device=docs.device)
        every_key_block = every_key_block.expand(docs.shape[0], 1, idx.num_q_blocks, -1)
        same = shares_document(docs, every_key_block, block_q=idx.block_q, block_k=idx.block_k)  # [B, 1, NQB, NKB]
        idx = BlockIndex.from_dense(idx.to_dense() & same, seq_len=n, block_q=idx.block_q, block_k=idx.block_k)
    return idx, idx.plan(r0)


def packed_document_ids(n, low, high, seed, device="cuda", *, batch=B):
    """int32 ``[batch, n]`` ids of documents with lengths drawn uniformly in [low, high] (seeded), the last one cut
    at n; and the lengths."""
    lengths = random_document_lengths(n, low, high, seed)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(device=device, dtype=torch.int32).view(1, n).expand(batch, n).contiguous(), lengths


def benchmark_tokens(n, vocab, seed=1, device="cuda"):
    """int64 ``[1, n + 1]`` token ids, uniform in ``[0, vocab)``, drawn on the CPU from a generator seeded with
    ``seed`` (the same ids on every device): inputs are ``[:, :-1]``, labels ``[:, 1:]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (1, n + 1), generator=g).to(device)


def candidates_argument(text: str) -> int | str | None:
    """``SparseAttentionConfig.selector_candidates`` from a command line: ``"auto"``, ``"none"`` (exact scores,
    ``None``) or a count >= 1."""
    if text == "auto":
        return text
    if text == "none":
        return None
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a count >= 1, got {text!r}")
