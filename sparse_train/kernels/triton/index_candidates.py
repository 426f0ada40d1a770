"""Triton kernels of the candidate index scores: the upper bound of every (query block, key block) token score, and
the exact token scores of listed key blocks.

Math (the reference is kernels/reference/index_candidates.py), per batch b, head h, query block i:

    bound[b, h, i, j] = max over valid rows r of block i, heads e with j * BK <= r of
                        relu(u[r, e]) . w_max[j] + min(u[r, e], 0) . w_min[j]          (every key block j)
    exact[b, h, i, c] = max over valid rows r of block i, heads e, valid keys t of block candidates[c], t <= r,
                        same document, of  u[r, e] . w[t]                                (the C listed blocks)

with ``w_max`` / ``w_min`` the element-wise extremes of each key block's valid index keys (float32 accumulation;
-inf where nothing is valid). Notation as kernels/triton/index_scores.py (B, H, N, M, E, S, BQ, BK, NQB, NKB, R;
a program's tile of u has ROWS = BQ * E rows padded to a power of two, row m = r * E + e, the index dim padded to
S_P2 >= 16).

Layers: (1) ``_index_bounds_kernel``: one program per (query block row, b * H + h); the u tile is loaded once,
split into its positive and negative parts, and the program walks the causally reachable key blocks KEY_BLOCKS
at a time (:func:`bound_key_blocks`): ``[KEY_BLOCKS, 2S] x [2S, ROWS]`` as two ``tl.dot`` (max extremes with the
positive part, min extremes with the negative part), masked (a key block after a row, padding rows), a max over
rows; the columns past the reach are stored as -inf. ``_candidate_scores_kernel``: one program per (query block row,
b * H + h); it walks the row's C listed key blocks STEP at a time (:func:`candidate_tiles`), gathering their keys
into one ``[KEYS, S]`` tile, ``[KEYS, S] x [S, ROWS]`` by ``tl.dot``, the mask only on steps that need it (a key
that may follow a row, the sequence end, padding rows, an unlisted slot, documents), a max over rows then over each
block's keys.
(2) the launchers. (3) the launchers as the ``torch.library`` custom ops ``sparse_train::index_score_bounds`` and
``sparse_train::candidate_index_scores`` (fake impls; torch.compile, export and dispatch modes call them, eager calls
on plain tensors the launchers: ``_launch.direct_call``). (4) the public functions :func:`index_score_bounds` and
:func:`candidate_index_scores`.

No autograd: the bound ranks blocks and takes no gradient; the candidate scores with autograd on go to the reference
(:func:`candidate_index_scores`). Known limits: as the index-score kernel (float16 / bfloat16 / float32, bf16 on CUDA
only, block sizes 16..128, powers of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...validation import check_choice
from ..reference.index_candidates import (
    check_candidates,
    key_block_extremes,
    reference_candidate_index_scores,
    reference_index_score_bounds,
)
from ..reference.index_scores import IndexScoreArgs, check_index_score_args, sequence_lengths
from ._jit import documents_row, dot, index_block_bounds, load_index_rows, sequence_length
from ._launch import direct_call, kernel_document_ids, kernel_seq_lens, launch
from .index_scores import BACKENDS, TILE_VALUES_PER_THREAD, index_scores_support, score_shape, shape_args

__all__ = [
    "NUM_WARPS",
    "bound_key_blocks",
    "candidate_index_scores",
    "candidate_index_scores_launch",
    "candidate_tiles",
    "index_score_bounds",
    "index_score_bounds_launch",
]

NUM_WARPS = 4
"""Warps per program of the bound kernel, and of the candidate kernel where its tile fits them
(:func:`candidate_tiles`)."""
MAX_BOUND_KEY_BLOCKS = 128
"""Most key blocks per step of the bound kernel."""


def bound_key_blocks(rows: int) -> int:
    """Key blocks per step of the bound kernel for a u tile of ``rows`` rows: as many as keep
    :data:`~sparse_train.kernels.triton.index_scores.TILE_VALUES_PER_THREAD` float32 values per thread of
    :data:`NUM_WARPS` warps, at least 16 (``tl.dot``), at most :data:`MAX_BOUND_KEY_BLOCKS`."""
    return min(MAX_BOUND_KEY_BLOCKS, triton.next_power_of_2(max(16, TILE_VALUES_PER_THREAD * 32 * NUM_WARPS // rows)))


def candidate_tiles(block_k: int, rows: int) -> tuple[int, int]:
    """(listed blocks gathered per step, warps) of the candidate kernel for a u tile of ``rows`` rows: as many
    blocks as keep :data:`~sparse_train.kernels.triton.index_scores.TILE_VALUES_PER_THREAD` float32 logits per thread
    of :data:`NUM_WARPS` warps, at least one, and more warps (up to 16) when one block's tile needs them."""
    budget = TILE_VALUES_PER_THREAD * 32
    step = max(1, budget * NUM_WARPS // (rows * block_k))
    warps = min(16, max(NUM_WARPS, triton.next_power_of_2(-(-step * block_k * rows // budget))))
    return step, warps


# ----------------------------------------------------------------------------------------------
# Layer 1: kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _index_bounds_kernel(
    U,
    EXT,
    QUERY_BLOCKS,
    SEQ_LENS,
    OUT,
    stride_ub,
    stride_uh,
    stride_um,
    stride_ue,
    stride_us,
    stride_xb,
    stride_xh,
    stride_xj,
    stride_xs,
    H,
    N,
    R,
    NKB,
    S,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_P2: tl.constexpr,
    ROWS: tl.constexpr,
    KEY_BLOCKS: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    IEEE: tl.constexpr,
):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    # key blocks 0 .. j_end - 1 start at or before the block's last valid row (no documents: they only remove keys)
    q_first, q_end, _, j_end, _ = index_block_bounds(
        QUERY_BLOCKS, i, True, seqlen, SEQ_LENS, N, 0, BLOCK_Q, BLOCK_K, HAS_QUERY_BLOCKS, False
    )
    offs_s = tl.arange(0, S_P2)
    u_head = U + b64 * stride_ub + h.to(tl.int64) * stride_uh
    u, pos, row_ok = load_index_rows(
        U, u_head, i * BLOCK_Q, q_first, seqlen, 0, stride_um, stride_ue, stride_us, offs_s, S, E, BLOCK_Q, ROWS
    )  # [ROWS, S_P2], 0 where invalid
    zero = tl.zeros_like(u)
    u_pos = tl.maximum(u, zero).to(u.dtype)  # in u's dtype, as the extremes (the max of bf16 computes in fp32)
    u_neg = tl.minimum(u, zero).to(u.dtype)
    x_head = EXT + b64 * stride_xb + h.to(tl.int64) * stride_xh
    out_row = (bh.to(tl.int64) * R + i) * NKB
    s_ok = offs_s < S
    for j0 in range(0, j_end, KEY_BLOCKS):
        j = j0 + tl.arange(0, KEY_BLOCKS)  # [KEY_BLOCKS]
        j_ok = j < j_end
        x_rows = x_head + j.to(tl.int64)[:, None] * stride_xj
        mask = j_ok[:, None] & s_ok[None, :]
        w_max = tl.load(x_rows + offs_s.to(tl.int64)[None, :] * stride_xs, mask=mask, other=0.0)  # [KEY_BLOCKS, S_P2]
        w_min = tl.load(x_rows + (S + offs_s).to(tl.int64)[None, :] * stride_xs, mask=mask, other=0.0)
        s = dot(w_max, tl.trans(u_pos), IEEE) + dot(w_min, tl.trans(u_neg), IEEE)  # [KEY_BLOCKS, ROWS] float32
        ok = row_ok[None, :] & ((j * BLOCK_K)[:, None] <= pos[None, :])
        best = tl.max(tl.where(ok, s, float("-inf")), axis=1)  # [KEY_BLOCKS]
        tl.store(OUT + out_row + j, best, mask=j_ok)
    for j0 in range(j_end, NKB, KEY_BLOCKS):
        j = j0 + tl.arange(0, KEY_BLOCKS)
        tl.store(OUT + out_row + j, tl.full([KEY_BLOCKS], float("-inf"), tl.float32), mask=j < NKB)


@triton.jit
def _candidate_scores_kernel(
    U,
    W,
    CAND,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    OUT,
    stride_ub,
    stride_uh,
    stride_um,
    stride_ue,
    stride_us,
    stride_wb,
    stride_wh,
    stride_wn,
    stride_ws,
    stride_cb,
    stride_ch,
    stride_cr,
    stride_cc,
    H,
    N,
    R,
    NKB,
    C,
    S,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_P2: tl.constexpr,
    ROWS: tl.constexpr,
    STEP: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    IEEE: tl.constexpr,
):
    KEYS: tl.constexpr = STEP * BLOCK_K
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)
    docs_row = DOCS
    if HAS_DOCS:
        docs_row = documents_row(DOCS, b64, N)
    q_first, q_end, _, _, _ = index_block_bounds(
        QUERY_BLOCKS, i, True, seqlen, docs_row, N, 0, BLOCK_Q, BLOCK_K, HAS_QUERY_BLOCKS, HAS_DOCS
    )
    offs_s = tl.arange(0, S_P2)
    u_head = U + b64 * stride_ub + h64 * stride_uh
    w_head = W + b64 * stride_wb + h64 * stride_wh
    u, pos, row_ok = load_index_rows(
        U, u_head, i * BLOCK_Q, q_first, seqlen, 0, stride_um, stride_ue, stride_us, offs_s, S, E, BLOCK_Q, ROWS
    )  # [ROWS, S_P2]
    doc_r = pos
    if HAS_DOCS:
        doc_r = tl.load(docs_row + pos.to(tl.int64), mask=row_ok, other=-2)
    padded_rows: tl.constexpr = ROWS != BLOCK_Q * E
    rows_partial = (q_first + BLOCK_Q > seqlen) | padded_rows
    cand_row = CAND + b64 * stride_cb + h64 * stride_ch + i.to(tl.int64) * stride_cr
    out_row = (bh.to(tl.int64) * R + i) * C
    slot = tl.arange(0, KEYS) // BLOCK_K  # [KEYS]: the step's slot of each key
    within = tl.arange(0, KEYS) % BLOCK_K
    for c0 in range(0, C, STEP):
        # each key reads its slot's block id (repeated addresses, cached): no reshape of a broadcast slot vector
        key_slot = c0 + slot
        key_block = tl.load(cand_row + key_slot.to(tl.int64) * stride_cc, mask=key_slot < C, other=-1)  # [KEYS]
        key_listed = (key_slot < C) & (key_block >= 0) & (key_block < NKB)
        kpos = tl.where(key_listed, key_block, 0) * BLOCK_K + within  # [KEYS]
        key_in = key_listed & (kpos < q_end)  # keys at or past the block's valid rows are never loaded (NaN padding)
        w = tl.load(
            w_head + kpos.to(tl.int64)[:, None] * stride_wn + offs_s.to(tl.int64)[None, :] * stride_ws,
            mask=key_in[:, None] & (offs_s[None, :] < S),
            other=0.0,
        )  # [KEYS, S_P2]
        s = dot(w, tl.trans(u), IEEE)  # [KEYS, ROWS] float32
        # every (key, row) is valid unless a key may follow a row, a row is not a real query, a slot lists no
        # block or documents may differ
        last_key = tl.max(tl.where(key_listed, kpos, 0))
        unlisted = tl.min(key_listed.to(tl.int32)) == 0
        if HAS_DOCS:
            doc_k = tl.load(docs_row + kpos.to(tl.int64), mask=key_in, other=-1)
            ok = key_in[:, None] & row_ok[None, :] & (kpos[:, None] <= pos[None, :])
            s = tl.where(ok & (doc_k[:, None] == doc_r[None, :]), s, float("-inf"))
        elif (last_key > q_first) | rows_partial | unlisted:
            ok = key_in[:, None] & row_ok[None, :] & (kpos[:, None] <= pos[None, :])
            s = tl.where(ok, s, float("-inf"))
        best = tl.max(s, axis=1)  # [KEYS]: best row of each key
        score = tl.max(tl.reshape(best, (STEP, BLOCK_K)), axis=1)  # [STEP]
        c = c0 + tl.arange(0, STEP)
        tl.store(OUT + out_row + c, score, mask=c < C)


# ----------------------------------------------------------------------------------------------
# Layer 2: launchers
# ----------------------------------------------------------------------------------------------
def _row_tile(args: IndexScoreArgs) -> int:
    return max(16, triton.next_power_of_2(args.block_q * args.E))


def index_score_bounds_launch(
    u: Tensor,
    w: Tensor,
    args: IndexScoreArgs,
    *,
    seq_lens: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """float32 ``[B, H, R, NKB]`` bounds. No validation (``args`` from
    :func:`~sparse_train.kernels.reference.index_scores.check_index_score_args`); u is read through its strides."""
    B, H, N, R, NKB = args.B, args.H, args.N, args.rows, args.num_k_blocks
    out = torch.empty((B, H, R, NKB), device=u.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    extremes, _ = key_block_extremes(w, args.block_k, sequence_lengths(seq_lens, B, N, u.device))  # [B, H, NKB, 2S]
    rows = _row_tile(args)
    blocks = None if query_blocks is None else query_blocks.to(torch.int32).contiguous()
    launch(
        _index_bounds_kernel,
        (R, B * H),
        u,
        extremes,
        out if blocks is None else blocks,
        kernel_seq_lens(seq_lens, N, out),
        out,
        *u.stride(),
        *extremes.stride(),
        H,
        N,
        R,
        NKB,
        args.S,
        E=args.E,
        BLOCK_Q=args.block_q,
        BLOCK_K=args.block_k,
        S_P2=max(16, triton.next_power_of_2(args.S)),
        ROWS=rows,
        KEY_BLOCKS=bound_key_blocks(rows),
        HAS_QUERY_BLOCKS=blocks is not None,
        HAS_SEQ_LENS=seq_lens is not None,
        IEEE=u.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=2,
    )
    return out


def candidate_index_scores_launch(
    u: Tensor,
    w: Tensor,
    candidates: Tensor,
    args: IndexScoreArgs,
    *,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """float32 ``[B, H, R, C]`` exact scores of the listed blocks. No validation; u, w and candidates are read
    through their strides."""
    B, H, N, R = args.B, args.H, args.N, args.rows
    count = candidates.shape[3]
    out = torch.empty((B, H, R, count), device=u.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    blocks = None if query_blocks is None else query_blocks.to(torch.int32).contiguous()
    rows = _row_tile(args)
    step, warps = candidate_tiles(args.block_k, rows)
    launch(
        _candidate_scores_kernel,
        (R, B * H),
        u,
        w,
        candidates,
        out if blocks is None else blocks,
        kernel_seq_lens(seq_lens, N, out),
        kernel_document_ids(document_ids, out),
        out,
        *u.stride(),
        *w.stride(),
        *candidates.stride(),
        H,
        N,
        R,
        args.num_k_blocks,
        count,
        args.S,
        E=args.E,
        BLOCK_Q=args.block_q,
        BLOCK_K=args.block_k,
        S_P2=max(16, triton.next_power_of_2(args.S)),
        ROWS=rows,
        STEP=step,
        HAS_QUERY_BLOCKS=blocks is not None,
        HAS_SEQ_LENS=seq_lens is not None,
        HAS_DOCS=document_ids is not None,
        IEEE=u.dtype == torch.float32,
        num_warps=warps,
        num_stages=2,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 3: custom ops
# ----------------------------------------------------------------------------------------------
# The launchers as torch.library custom ops (no autograd), which torch.compile, export and dispatch modes run as
# graph nodes; eager calls on plain tensors call the launchers directly (``_launch.direct_call``).
@torch.library.custom_op("sparse_train::index_score_bounds", mutates_args=())
def _index_score_bounds_op(
    u: Tensor, w: Tensor, seq_lens: Tensor | None, query_blocks: Tensor | None, block_q: int, block_k: int
) -> Tensor:
    args = shape_args(u, w, block_q, block_k, query_blocks)
    return index_score_bounds_launch(u, w, args, seq_lens=seq_lens, query_blocks=query_blocks)


@_index_score_bounds_op.register_fake
def _(u, w, seq_lens, query_blocks, block_q, block_k):
    return u.new_empty(score_shape(u, w, block_q, block_k, query_blocks), dtype=torch.float32)  # [B, H, R, NKB]


@torch.library.custom_op("sparse_train::candidate_index_scores", mutates_args=())
def _candidate_index_scores_op(
    u: Tensor,
    w: Tensor,
    candidates: Tensor,
    seq_lens: Tensor | None,
    document_ids: Tensor | None,
    query_blocks: Tensor | None,
    block_q: int,
    block_k: int,
) -> Tensor:
    args = shape_args(u, w, block_q, block_k, query_blocks)
    return candidate_index_scores_launch(
        u, w, candidates, args, seq_lens=seq_lens, document_ids=document_ids, query_blocks=query_blocks
    )


@_candidate_index_scores_op.register_fake
def _(u, w, candidates, seq_lens, document_ids, query_blocks, block_q, block_k):
    return u.new_empty(candidates.shape, dtype=torch.float32)  # [B, H, R, C]


# ----------------------------------------------------------------------------------------------
# Layer 4: public functions
# ----------------------------------------------------------------------------------------------
def _use_kernel(u: Tensor, backend: str) -> bool:
    if backend == "reference":
        return False
    supported, reason = index_scores_support(u)
    if backend == "triton" and not supported:
        raise ValueError(f"backend='triton' cannot run this input: {reason}")
    return supported and (backend == "triton" or u.device.type == "cuda")


def index_score_bounds(
    u: Tensor,
    w: Tensor,
    *,
    block_q: int,
    block_k: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Upper bounds of the token index scores of every (query block, key block) pair, in tiles (no gradient).

    ``bound[b, h, i, j]`` is the max over the valid rows r of query block i with ``j * block_k <= r`` and the index
    heads e of ``relu(u[r, e]) . w_max[j] + min(u[r, e], 0) . w_min[j]``, with ``w_max`` / ``w_min`` the element-wise
    extremes of key block j's valid index keys: at least the pair's token score
    (:func:`~sparse_train.kernels.triton.index_scores.index_block_scores`) in exact arithmetic.

    Args:
        u: index queries ``[B, H, M, E, S]`` (M = N, or R * block_q with ``query_blocks``); float16, bfloat16 or
            float32 (float64 on the reference), any strides.
        w: index keys ``[B, H, N, S]``, u's dtype and device.
        block_q, block_k: block sizes, each one of 16, 32, 64, 128.
        seq_lens: optional int ``[B]`` in [0, N]: rows and keys at positions >= seq_lens[b] take no part (NaN there
            reaches nothing).
        document_ids: optional int ``[B, N]``: checked and ignored (documents only remove keys from a block).
        query_blocks: optional int ``[R]`` global query-block ids, any order.
        backend: ``"auto"`` (the kernel for CUDA tensors it takes, the reference otherwise), ``"triton"`` or
            ``"reference"`` (:func:`~sparse_train.kernels.reference.index_candidates.reference_index_score_bounds`).

    Returns:
        float32 ``[B, H, R, NKB]`` (float64 for float64 inputs on the reference), -inf where the key block starts
        after the query block's last valid row or the query block has no valid row. Detached.

    Raises:
        ValueError: as :func:`~sparse_train.kernels.triton.index_scores.index_block_scores`.
    """
    check_choice("backend", backend, BACKENDS)
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    if not _use_kernel(u, backend):
        with torch.no_grad():
            return reference_index_score_bounds(
                u,
                w,
                block_q=block_q,
                block_k=block_k,
                seq_lens=seq_lens,
                document_ids=document_ids,
                query_blocks=query_blocks,
            )
    u, w = u.detach(), w.detach()
    if not direct_call(u, w, seq_lens, query_blocks):
        return torch.ops.sparse_train.index_score_bounds(u, w, seq_lens, query_blocks, block_q, block_k)
    return index_score_bounds_launch(u, w, args, seq_lens=seq_lens, query_blocks=query_blocks)


def candidate_index_scores(
    u: Tensor,
    w: Tensor,
    candidates: Tensor,
    *,
    block_q: int,
    block_k: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Exact token index scores of listed key blocks, in tiles: ``out[b, h, i, c]`` is the score of the pair (query
    block i, key block ``candidates[b, h, i, c]``) as
    :func:`~sparse_train.kernels.triton.index_scores.index_block_scores` computes it.

    Args:
        u, w, block_q, block_k, seq_lens, document_ids, query_blocks: as :func:`index_score_bounds` (documents
            apply: a key counts only for rows of its own document).
        candidates: int32 or int64 ``[B, H, R, C]`` key-block ids, any strides; an id outside [0, NKB) lists no block.
        backend: as :func:`index_score_bounds`. With autograd on and u or w requiring grad, ``"auto"`` takes the
            reference (the kernel has no backward).

    Returns:
        float32 ``[B, H, R, C]`` (float64 for float64 inputs on the reference): -inf for a pair without a valid
        (row, key) and for a slot that lists no block.

    Raises:
        ValueError: as :func:`index_score_bounds`; ``candidates`` of the wrong rank, shape, dtype or device;
            ``backend="triton"`` with autograd on and an input that requires grad.
    """
    check_choice("backend", backend, BACKENDS)
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    check_candidates(candidates, args, u.device)
    wants_grad = torch.is_grad_enabled() and (u.requires_grad or w.requires_grad)
    if backend == "triton" and wants_grad:
        raise ValueError("backend='triton' has no backward for candidate scores: call it without autograd")
    if wants_grad or not _use_kernel(u, backend):
        return reference_candidate_index_scores(
            u,
            w,
            candidates,
            block_q=block_q,
            block_k=block_k,
            seq_lens=seq_lens,
            document_ids=document_ids,
            query_blocks=query_blocks,
        )
    u, w = u.detach(), w.detach()
    if not direct_call(u, w, candidates, seq_lens, document_ids, query_blocks):
        return torch.ops.sparse_train.candidate_index_scores(
            u, w, candidates, seq_lens, document_ids, query_blocks, block_q, block_k
        )
    return candidate_index_scores_launch(
        u,
        w,
        candidates,
        args,
        seq_lens=seq_lens,
        document_ids=document_ids,
        query_blocks=query_blocks,
    )
