"""Readable PyTorch reference for block-sparse attention: the semantics every kernel must match.

    S[q, k] = scale * <Q[q], K[k]>   for k in the selected blocks of q's block, k <= q, k < len_b,
                                     doc_b[k] == doc_b[q] (packed documents, when given)
    lse[q]  = log sum_k exp(S[q, k])                     (natural log; -inf for an empty row)
    O[q]    = sum_k exp(S[q, k] - lse[q]) * keep(q, k) / (1 - p) * V[k]   (0 for an empty row)

Notation: B batch, HQ query heads, HKV key/value heads, G = HQ / HKV (query head h reads KV head
h // G), N sequence length, D head dim, BQ/BK query/key block sizes, K index capacity, p dropout
probability, keep(q, k) the dropout keep bit of element (b, h, q, k) (see :func:`dropout_keep_mask`).
The softmax denominator never includes dropout; only the kept numerators are rescaled.

It processes query blocks in chunks, gathering only the selected K/V blocks, so it never holds an
N x N matrix; it is differentiable through autograd, works in fp64, and is the CPU backend of the
module. Known limits: speed (it is a reference, not a kernel); dropout bits cost ~10 Philox rounds
of int64 tensor arithmetic per logit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...arguments import check_attention_args, check_query_blocks, global_query_stand_in
from ...index.block_index import BlockIndex
from ...validation import check_dropout_p

__all__ = [
    "reference_sparse_attention",
    "philox4x32_10",
    "philox_key",
    "dropout_offsets",
    "dropout_threshold",
    "dropout_keep_mask",
    "dense_block_mask_attention",
]

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_PHILOX_M0 = 0xD2511F53  # multiplier applied to counter word 0 (Triton: PHILOX_ROUND_A)
_PHILOX_M1 = 0xCD9E8D57  # multiplier applied to counter word 2 (Triton: PHILOX_ROUND_B)
_PHILOX_W0 = 0x9E3779B9  # key schedule increments (golden ratio, sqrt(3) - 1)
_PHILOX_W1 = 0xBB67AE85


def _mul32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(high 32 bits, low 32 bits) of the 64-bit product of the constant ``a`` and uint32 values ``b``
    held in int64. The product is split in 16-bit halves so no int64 intermediate overflows."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    p_lo = b * a_lo  # < 2**48
    p_hi = b * a_hi  # < 2**48
    upper = p_hi + (p_lo >> 16)  # the product shifted right by 16
    high = upper >> 16
    low = ((upper & 0xFFFF) << 16) | (p_lo & 0xFFFF)
    return high, low


def philox_key(seed: int) -> int:
    """The 64-bit Philox key (as an unsigned int) of a dropout seed in ``[0, 2**64)``, or of its int64
    two's-complement form, which is how the torch.library op carries seeds >= 2**63."""
    return int(seed) & _MASK64


def philox4x32_10(
    seed: int, c0: Tensor, c1: Tensor, c2: Tensor | None = None, c3: Tensor | None = None, rounds: int = 10
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 with 10 rounds (Salmon et al., SC'11), counter (c0, c1, c2, c3), key = the 64-bit
    ``seed`` split into (low, high) 32-bit words, exactly as Triton's ``tl.philox`` orders them.

    Counters are uint32 values carried in int64 tensors (any shape, broadcastable). Returns the four
    output words as int64 tensors holding uint32 values; ``tl.randint(seed, offset)`` is word 0 with
    ``c0, c1`` the low and high halves of the offset and ``c2 = c3 = 0``.
    """
    seed = philox_key(seed)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0 = c0.to(torch.int64) & _MASK32
    c1 = c1.to(torch.int64) & _MASK32
    c2 = torch.zeros_like(c0) if c2 is None else c2.to(torch.int64) & _MASK32
    c3 = torch.zeros_like(c0) if c3 is None else c3.to(torch.int64) & _MASK32
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    for _ in range(rounds):
        hi0, lo0 = _mul32(_PHILOX_M0, c0)
        hi1, lo1 = _mul32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def dropout_offsets(b: Tensor, h: Tensor, q_pos: Tensor, k_pos: Tensor, num_q_heads: int, seq_len: int) -> Tensor:
    """The 64-bit Philox counter of element (b, h, q_pos, k_pos): ``((b*HQ + h)*N + q_pos)*N + k_pos``.

    It depends on nothing but the element's coordinates, so block sizes, traversal order, split
    count and forward/backward/recompute all regenerate the same bit."""
    return ((b.to(torch.int64) * num_q_heads + h) * seq_len + q_pos) * seq_len + k_pos


def dropout_threshold(p: float) -> int:
    """Keep iff ``randint_u32 >= threshold``, ``threshold = floor(p * 2**32)``: P(keep) = 1 - p up to
    2**-32. Raises ValueError unless 0 <= p < 1."""
    return min(int(math.floor(check_dropout_p(p) * 2.0**32)), _MASK32)


def dropout_keep_mask(
    seed: int, b: Tensor, h: Tensor, q_pos: Tensor, k_pos: Tensor, num_q_heads: int, seq_len: int, p: float
) -> Tensor:
    """bool keep bits of elements (b, h, q_pos, k_pos) (broadcastable int tensors)."""
    offsets = dropout_offsets(b, h, q_pos, k_pos, num_q_heads, seq_len)
    word0, _, _, _ = philox4x32_10(seed, offsets & _MASK32, offsets >> 32)
    return word0 >= dropout_threshold(p)


def _chunk_size(batch: int, heads: int, block_q: int, keys_per_row: int, budget: int = 1 << 23) -> int:
    per_block = max(1, batch * heads * block_q * keys_per_row)
    return max(1, budget // per_block)


def reference_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: BlockIndex,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    seq_lens: Tensor | None = None,
    upcast: bool = True,
    chunk_q_blocks: int | None = None,
    document_ids: Tensor | None = None,
    check_values: bool = True,
    query_blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact block-sparse attention in PyTorch.

    Args:
        q: ``[B, HQ, N, D]``; k, v: ``[B, HKV, N, D]``, HQ a multiple of HKV (GQA).
        index: the canonical :class:`BlockIndex` for (B, HKV, N).
        scale: logit scale, default ``1 / sqrt(D)``.
        dropout_p: attention-probability dropout in [0, 1); needs ``dropout_seed`` when > 0.
        dropout_seed: int seed of the counter-based keep bits, in ``[0, 2**64)``.
        seq_lens: optional int ``[B]``, values in ``[0, N]``; keys at positions >= seq_lens[b] are
            masked, by selection: their values (even NaN/inf) reach no output and no gradient.
        upcast: compute fp16/bf16 inputs in fp32 (default). False computes in the input dtype, which
            tests use as the "same computation in the kernel's precision" baseline.
        chunk_q_blocks: query blocks per chunk (default: sized to ~8M logits per chunk).
        document_ids: optional int ``[B, N]``, non-decreasing along N (:mod:`sparse_train.documents`):
            key k is masked for query q unless ``document_ids[b, k] == document_ids[b, q]``, applied to
            the logits like the causal mask (a masked key is 0 in the softmax; its value still enters
            the product, so unlike padding it must be finite).
        check_values: check the values of ``seq_lens`` and ``document_ids`` (host syncs on CUDA; see
            ``sparse_train.sparse_attention``); lengths are clamped to [0, N] either way.
        query_blocks: optional int ``[NQL]``, distinct global query-block ids (any order): q then holds
            only the rows of these query blocks, ``[B, HQ, L, D]`` with L their total length (BQ each,
            the last block of the sequence possibly shorter), concatenated in the listed order, while k,
            v, ``index``, ``seq_lens`` and ``document_ids`` stay global. Each row is computed exactly as
            in the full call (global positions for masks and dropout counters); the output rows come in
            q's order. This is the query-block map of context parallelism
            (:mod:`sparse_train.parallel.context_parallel`). Checked by
            :func:`~sparse_train.arguments.check_query_blocks` (the one home of these checks, shared with the
            Triton backend); the reference reads the ids back.

    Returns:
        ``(o, lse)``: o ``[B, HQ, N, D]`` (``[B, HQ, L, D]`` with ``query_blocks``) in q's dtype; lse
        ``[B, HQ, N]`` (``[B, HQ, L]``) natural log, fp32 (fp64 for fp64 inputs), ``-inf`` for rows with
        no valid key (whose o is 0 and gradients are 0).

    Raises:
        ValueError: any argument outside its domain (:func:`sparse_train.arguments.check_attention_args`):
            shape/dtype/device mismatch with the index, bad seq_lens, document_ids, dropout_p or
            dropout_seed; dropout without seed.
    """
    q_rows = None
    if query_blocks is not None:
        block_ids, q_rows = _query_block_rows(q, k, index, query_blocks, check_values)
        q_global = global_query_stand_in(q, index)
    else:
        q_global = q
    args = check_attention_args(
        q_global,
        k,
        v,
        index,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        seq_lens=seq_lens,
        document_ids=document_ids,
        seq_lens_values=check_values,
    )
    scale, dropout_p, dropout_seed = args.scale, args.dropout_p, args.dropout_seed
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs an explicit dropout_seed in the reference")
    threshold = dropout_threshold(dropout_p)

    batch, hq, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = hq // hkv
    # a block longer than the sequence is one block of N rows (padding it to its size would only cost memory)
    bq, bk = min(index.block_q, n), min(index.block_k, n)
    nqb, nkb, cap = index.num_q_blocks, index.num_k_blocks, index.capacity
    if query_blocks is None:
        block_ids = torch.arange(nqb, device=q.device)
    else:
        nqb = block_ids.numel()  # from here on: the query blocks this call computes, in q's order
    out_dtype = q.dtype
    compute = q.dtype
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        compute = torch.float32
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device

    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    # Pad N up to whole blocks; padded keys are masked by position, padded queries cut off at the end.
    if q_rows is None:
        qp = torch.nn.functional.pad(qc, (0, 0, 0, nqb * bq - n))
    else:
        qp = qc.new_zeros(batch, hq, nqb * bq, d).index_copy(2, q_rows, qc)
    qp = qp.view(batch, hkv, group, nqb, bq, d)
    kp = torch.nn.functional.pad(kc, (0, 0, 0, nkb * bk - n)).reshape(batch * hkv * nkb, bk, d)
    vp = torch.nn.functional.pad(vc, (0, 0, 0, nkb * bk - n)).reshape(batch * hkv * nkb, bk, d)

    idx = index.indices.to(torch.int64)  # [B, HKV, NQB, K]
    if query_blocks is not None:
        idx = idx.index_select(2, block_ids)
    slot_valid = idx >= 0
    rows = torch.arange(batch * hkv, device=device).view(batch, hkv, 1, 1) * nkb + idx.clamp_min(0)
    lens = torch.full((batch,), n, device=device, dtype=torch.int64) if seq_lens is None else seq_lens.to(torch.int64)
    lens = torch.clamp(lens, max=n).view(batch, 1, 1, 1)  # keys at positions >= lens are masked
    docs = None if document_ids is None else document_ids.to(torch.int64)  # [B, N]

    step = chunk_q_blocks or _chunk_size(batch, hq, bq, cap * bk)
    out_chunks, lse_chunks = [], []
    for c0 in range(0, nqb, step):
        c1 = min(nqb, c0 + step)
        chunk = c1 - c0
        sel_rows = rows[:, :, c0:c1].reshape(-1)
        key_pos = (idx[:, :, c0:c1, :, None] * bk + torch.arange(bk, device=device)).reshape(
            batch, hkv, chunk, cap * bk
        )
        q_pos = (block_ids[c0:c1].view(-1, 1) * bq + torch.arange(bq, device=device)).view(1, 1, chunk, bq, 1)
        key_ok = slot_valid[:, :, c0:c1, :, None].expand(-1, -1, -1, -1, bk).reshape(batch, hkv, chunk, cap * bk)
        key_ok = key_ok & (key_pos < lens)  # [B, HKV, C, K*BK]
        # Masked keys and values are replaced (selected away, not multiplied by 0) before any product:
        # garbage in them (even NaN/inf past a sequence's length) would otherwise leak through 0 * NaN,
        # into o via P @ V and into dQ via dS @ K in the backward of the logits.
        keep = key_ok.unsqueeze(-1)
        k_sel = torch.where(keep, kp.index_select(0, sel_rows).view(batch, hkv, chunk, cap * bk, d), 0.0)
        v_sel = torch.where(keep, vp.index_select(0, sel_rows).view(batch, hkv, chunk, cap * bk, d), 0.0)
        q_chunk = qp[:, :, :, c0:c1]  # [B, HKV, G, C, BQ, D]
        logits = torch.einsum("bhgcqd,bhckd->bhgcqk", q_chunk, k_sel) * scale  # [B, HKV, G, C, BQ, K*BK]
        valid = key_ok.unsqueeze(3) & (key_pos.unsqueeze(3) <= q_pos)  # [B, HKV, C, BQ, K*BK]
        if docs is not None:
            doc_k = docs.gather(1, key_pos.clamp(0, n - 1).flatten(1)).view(batch, hkv, chunk, 1, cap * bk)
            doc_q = docs[:, q_pos.clamp(max=n - 1).reshape(-1)].view(batch, 1, chunk, bq, 1)
            valid = valid & (doc_k == doc_q)
        valid = valid.unsqueeze(2)  # [B, HKV, 1, C, BQ, K*BK]

        logits = logits.masked_fill(~valid, float("-inf"))
        row_max = logits.amax(dim=-1, keepdim=True)
        # Softmax is invariant to the shift, so the shift carries no gradient; empty rows shift by 0.
        shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
        probs = torch.exp(logits - shift)  # masked entries are exactly 0
        denom = probs.sum(dim=-1)  # [B, HKV, G, C, BQ]
        safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        if dropout_p > 0.0:
            heads = torch.arange(hkv, device=device).view(hkv, 1) * group + torch.arange(group, device=device)
            offsets = dropout_offsets(
                torch.arange(batch, device=device).view(batch, 1, 1, 1, 1, 1),
                heads.view(1, hkv, group, 1, 1, 1),
                q_pos.view(1, 1, 1, chunk, bq, 1),
                key_pos.view(batch, hkv, 1, chunk, 1, cap * bk).clamp_min(0),
                hq,
                n,
            )
            word0, _, _, _ = philox4x32_10(dropout_seed, offsets & _MASK32, offsets >> 32)
            probs = probs * ((word0 >= threshold).to(compute) / (1.0 - dropout_p))
        out = torch.einsum("bhgcqk,bhckd->bhgcqd", probs, v_sel) / safe_denom.unsqueeze(-1)
        lse = torch.where(denom > 0, shift.squeeze(-1) + torch.log(safe_denom), torch.full_like(denom, float("-inf")))
        out_chunks.append(out)
        lse_chunks.append(lse)

    o = torch.cat(out_chunks, dim=3).reshape(batch, hq, nqb * bq, d)
    lse = torch.cat(lse_chunks, dim=3).reshape(batch, hq, nqb * bq)
    if q_rows is None:
        o, lse = o[:, :, :n], lse[:, :, :n]
    else:
        o, lse = o.index_select(2, q_rows), lse.index_select(2, q_rows)
    return o.to(out_dtype), lse.to(lse_dtype)


def _query_block_rows(
    q: Tensor, k: Tensor, index: BlockIndex, query_blocks, check_values: bool = True
) -> tuple[Tensor, Tensor]:
    """Checked ``query_blocks`` (:func:`~sparse_train.arguments.check_query_blocks`) as int64 on q's device, and
    int64 ``[L]``: where each row of q sits in the block-padded layout ``[NQL * BQ]`` (row r of listed block s at
    ``s * BQ + r``)."""
    blocks = check_query_blocks(q, k, index, query_blocks, check_values=check_values)
    block_q = min(index.block_q, index.seq_len)  # as in reference_sparse_attention
    positions = blocks.view(-1, 1) * block_q + torch.arange(block_q, device=q.device)  # [NQL, BQ]
    rows = (positions < index.seq_len).view(-1).nonzero().view(-1)
    return blocks, rows


def dense_block_mask_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: BlockIndex,
    *,
    scale: float | None = None,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The same function computed the naive way: expand the block index to an ``[N, N]`` element mask
    (and the document mask, when ``document_ids`` ``[B, N]`` is given) and run a plain masked softmax.
    O(N^2) memory, for tests on small shapes only; no dropout."""
    batch, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dense = index.to_dense()  # [B, HKV, NQB, NKB]
    elem = dense.repeat_interleave(index.block_q, dim=2)[:, :, :n].repeat_interleave(index.block_k, dim=3)[..., :n]
    elem = elem.repeat_interleave(group, dim=1)  # [B, HQ, N, N]
    pos = torch.arange(n, device=q.device)
    elem = elem & (pos.view(1, 1, 1, n) <= pos.view(1, 1, n, 1))
    if document_ids is not None:
        elem = elem & (document_ids.view(-1, 1, 1, n) == document_ids.view(-1, 1, n, 1))
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    if seq_lens is not None:
        elem = elem & (pos.view(1, 1, 1, n) < seq_lens.view(-1, 1, 1, 1))
        # keys past a sequence's length are selected away, not multiplied by 0: NaN/inf there must
        # not leak into o (P @ V) or into dQ (the backward of Q K^T)
        key_in = pos.view(1, 1, n, 1) < seq_lens.view(-1, 1, 1, 1)
        kk = torch.where(key_in, kk, 0.0)
        vv = torch.where(key_in, vv, 0.0)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~elem, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(elem, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1)), 0)
    return p @ vv, lse
