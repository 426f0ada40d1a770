"""Triton kernel of the token-level index block scores: the largest index logit of each (query block, key block).

Math (the reference is kernels/reference/index_scores.py), per batch b, head h, query block i and key block j:

    score[b, h, i, j] = max over rows r of block i, index heads e, keys t of block j
                        with t <= r, r < len_b, t < len_b, doc[b, t] == doc[b, r]
                        of  sum_s u[b, h, r, e, s] * w[b, h, t, s]        (float32 accumulation)

-inf where no (r, t) is valid. N x N is never materialised: a program holds one query block's index rows and
walks its key blocks.

Notation: B batch, H heads, N length, M rows of u (N, or R * BQ with ``query_blocks``), E index heads, S index
dim, BQ / BK block sizes, NQB / NKB query / key blocks, R output rows (query blocks). A program's tile of u
has ROWS = BQ * E rows, row m = r * E + e (query row r = m // E, index head e = m % E), padded to a power of
two; the index dim is zero-padded to S_P2 = max(16, next power of two of S) (``tl.dot`` needs K >= 16; zeros
change no product).

Layers: (1) ``_index_block_scores_kernel``: one program per (query block row, b * H + h), or per two adjacent
rows that share each loaded key tile (``blocks_per_program``), the last rows launched first (they walk the most
key blocks, so the launch ends on short programs); the u tile is loaded
once (in ROW_TILE-row slices when ROWS exceeds the option's row tile: then the later slices are reloaded per
key step); the program walks the key blocks from the first that can share a document with the block's first
row (a binary search over the non-decreasing document ids) to the last the block's last valid row reaches,
KEY_BLOCKS key blocks per step: one ``tl.dot`` of the step's keys and the block's rows, [KEYS, S] x [S, ROWS]
(``KEYS_MAJOR``, the default: the max over rows stays in each thread's accumulator) or [ROWS, S] x [S, KEYS],
KEYS = KEY_BLOCKS * BK, the mask only on blocks that
need it (causal edge, sequence end, padding rows, two documents), a max over rows then over each block's keys
(with the winner's row * E + e and key position when autograd needs them: ``WITH_WINNER``); the columns outside
the walked range are stored as -inf; (2) the launcher ``index_block_scores_launch``; (3) the autograd op
``_IndexBlockScores`` (backward: a scatter-add of ``grad * w[t]`` into ``du[r, e]`` and ``grad * u[r, e]``
into ``dw[t]`` at the winners, by ``index_add_``, or ``index_put_(accumulate=True)`` under
``torch.use_deterministic_algorithms``), and the same forward and backward as the ``torch.library`` custom ops
``sparse_train::index_block_scores`` / ``sparse_train::index_block_scores_bwd`` (fake impls, ``register_autograd``)
that torch.compile, export and dispatch modes call (eager calls on plain tensors skip the op's Python dispatch:
``_launch.direct_call``); (4) the public function :func:`index_block_scores`.

Known limits: float16 / bfloat16 / float32 (float32 products exact: IEEE dot); float64 goes to the reference;
bfloat16 runs on CUDA only (the interpreter's bf16 math is wrong); block sizes 16..128, powers of two; M * E
below 2^31 (int32 winner rows). The
backward holds float32 ``[chunk * NKB, S]`` gathered rows per chunk of output rows (:data:`BACKWARD_CHUNK_BYTES`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...validation import check_choice, check_int
from ..reference.index_scores import (
    IndexScoreArgs,
    check_index_score_args,
    reference_index_block_scores,
)
from ._jit import documents_row, dot, index_block_bounds, load_index_rows, sequence_length
from ._launch import direct_call, kernel_document_ids, kernel_seq_lens, launch

__all__ = [
    "BACKWARD_CHUNK_BYTES",
    "MAX_ROW_TILE",
    "TILE_VALUES_PER_THREAD",
    "IndexScoreOptions",
    "index_block_scores",
    "index_block_scores_launch",
    "index_scores_support",
    "score_shape",
    "shape_args",
    "tile_options",
    "winner_gradients",
]

BACKWARD_CHUNK_BYTES = 256 * 2**20
"""Largest float32 buffer of gathered rows in one step of the backward's scatter-add."""

BACKENDS = ("auto", "triton", "reference")


class IndexScoreOptions(NamedTuple):
    """Tile choices of the index-scores kernel; they change speed, never the result (beyond float32 order).
    A field left None takes the value of :func:`tile_options` for the call's block sizes, E and S.

    Attributes:
        key_tile: keys per loop step (KEY_BLOCKS = max(1, key_tile // block_k) whole key blocks), a power of
            two >= 16.
        row_tile: most rows of u per ``tl.dot`` (a power of two >= 16); a block with more rows (BQ * E padded)
            is walked in slices of this many rows, the later slices reloaded per key step.
        num_warps: warps per program (1, 2, 4, 8 or 16).
        num_stages: software pipeline depth of the key loop (>= 1).
        blocks_per_program: query blocks per program, 1 or 2: two adjacent blocks share each loaded key tile
            (half the key traffic from L2, two u tiles held).
        keys_major: orientation of each step's product: True computes ``[keys, rows]`` (the max over rows
            reduces inside each thread's accumulator), False ``[rows, keys]`` (the max over rows crosses
            threads and warps).
    """

    key_tile: int | None = None
    row_tile: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    blocks_per_program: int | None = None
    keys_major: bool | None = None


TILE_VALUES_PER_THREAD = 64
"""Float32 logits per thread of one step's [row_tile, key_tile] tile in the automatic tiles (:func:`tile_options`):
more spills past the register file (compiled for sm_90a: 64 gives 70-130 registers at S <= 32)."""
MAX_ROW_TILE = 256
"""Largest automatic row tile: E * BQ rows above it are walked in slices."""
DEFAULT_KEYS_MAJOR = True
"""Orientation of the automatic tiles (:attr:`IndexScoreOptions.keys_major`)."""


def tile_options(
    block_q: int, block_k: int, index_heads: int, index_dim: int, options: IndexScoreOptions | None = None
) -> IndexScoreOptions:
    """``options`` with every None field filled: the whole block's rows in one tile up to :data:`MAX_ROW_TILE`
    (4 warps; rows major: 8 above 128 rows), and as many keys per step as keep :data:`TILE_VALUES_PER_THREAD` logits
    per thread (half as many for S > 32, whose operand tiles take registers too, and for two query blocks per
    program in the keys-major orientation), at least one key block; the orientation :data:`DEFAULT_KEYS_MAJOR`."""
    options = options or IndexScoreOptions()
    keys_major = DEFAULT_KEYS_MAJOR if options.keys_major is None else options.keys_major
    rows = triton.next_power_of_2(block_q * index_heads)
    row_tile = options.row_tile or min(rows, MAX_ROW_TILE)
    num_warps = options.num_warps or (4 if keys_major or min(rows, row_tile) <= 128 else 8)
    values = TILE_VALUES_PER_THREAD * 32 * num_warps // (2 if index_dim > 32 else 1)
    if keys_major and options.blocks_per_program == 2:
        values //= 2  # two blocks' [keys, rows] products live at once
    keys = triton.next_power_of_2(max(16, values // min(rows, row_tile)))
    key_tile = options.key_tile or max(block_k, min(256, keys))
    return IndexScoreOptions(
        key_tile=key_tile,
        row_tile=row_tile,
        num_warps=num_warps,
        num_stages=options.num_stages,
        blocks_per_program=options.blocks_per_program or 1,
        keys_major=keys_major,
    )


def _check_options(options) -> IndexScoreOptions | None:
    if options is None:
        return None
    if not isinstance(options, IndexScoreOptions):
        raise ValueError(f"options must be an IndexScoreOptions or None, got {type(options).__name__}")
    for name in ("key_tile", "row_tile"):
        value = check_int(f"options.{name}", getattr(options, name), minimum=16, optional=True)
        if value is not None and value & (value - 1):
            raise ValueError(f"options.{name} must be a power of two >= 16, got {value}")
    if options.num_warps is not None:
        check_choice("options.num_warps", options.num_warps, (1, 2, 4, 8, 16))
    check_int("options.num_stages", options.num_stages, minimum=1)
    if options.blocks_per_program is not None:
        check_choice("options.blocks_per_program", options.blocks_per_program, (1, 2))
    if options.keys_major is not None and not isinstance(options.keys_major, bool):
        raise ValueError(f"options.keys_major must be a bool or None, got {options.keys_major!r}")
    return options


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _block_step(
    u0,
    pos0,
    row_ok0,
    U,
    u_head,
    block_row0,
    q_first,
    q_end,
    seqlen,
    w,
    kpos,
    key_first,
    docs_row,
    doc_k,
    doc_q_last,
    stride_um,
    stride_ue,
    stride_us,
    offs_s,
    S,
    IEEE: tl.constexpr,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROW_TILE: tl.constexpr,
    ROW_SLICES: tl.constexpr,
    KEYS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WITH_WINNER: tl.constexpr,
    KEYS_MAJOR: tl.constexpr,
):
    """Best logit of each of the step's keys over the block's rows ([KEYS] float32, -inf where no row is valid)
    and its tile row m ([KEYS] int32; with ``WITH_WINNER``)."""
    # every (row, key) of the step is valid unless a key may follow a row, a row is not a real query (past the
    # length, or padding rows of the tile), or the step's first key and the block's last row lie in two documents
    padded_rows: tl.constexpr = ROW_TILE * ROW_SLICES != BLOCK_Q * E
    needs_mask = (key_first + KEYS - 1 > q_first) | (q_first + BLOCK_Q > seqlen) | padded_rows
    if HAS_DOCS:
        needs_mask = needs_mask | (tl.load(docs_row + key_first) != doc_q_last)
    ROW_AXIS: tl.constexpr = 1 if KEYS_MAJOR else 0  # the axis of s that holds the block's rows
    KEY_AXIS: tl.constexpr = 1 - ROW_AXIS
    best = tl.full([KEYS], float("-inf"), tl.float32)
    best_m = tl.zeros([KEYS], tl.int32)
    for sl in tl.static_range(ROW_SLICES):
        if sl == 0:
            u, pos, row_ok = u0, pos0, row_ok0
        else:
            u, pos, row_ok = load_index_rows(
                U,
                u_head,
                block_row0,
                q_first,
                seqlen,
                sl,
                stride_um,
                stride_ue,
                stride_us,
                offs_s,
                S,
                E,
                BLOCK_Q,
                ROW_TILE,
            )
        if KEYS_MAJOR:
            # keys on the product's M axis: the max over rows runs along each thread's own accumulator columns
            s = dot(w, tl.trans(u), IEEE)  # [KEYS, ROW_TILE] float32
        else:
            s = dot(u, tl.trans(w), IEEE)  # [ROW_TILE, KEYS] float32
        if needs_mask:
            # per-row vectors spread along the row axis of s, per-key vectors along the other
            ok = tl.expand_dims(row_ok, KEY_AXIS) & (tl.expand_dims(kpos, ROW_AXIS) <= tl.expand_dims(pos, KEY_AXIS))
            if HAS_DOCS:
                doc_r = tl.load(docs_row + pos.to(tl.int64), mask=row_ok, other=-2)
                ok = ok & (tl.expand_dims(doc_r, KEY_AXIS) == tl.expand_dims(doc_k, ROW_AXIS))
            s = tl.where(ok, s, float("-inf"))
        if WITH_WINNER:
            col, col_m = tl.max(s, axis=ROW_AXIS, return_indices=True)  # [KEYS]: best row of each key
            col_m = col_m + sl * ROW_TILE
            better = col > best
            best_m = tl.where(better, col_m, best_m)
            best = tl.where(better, col, best)
        else:
            best = tl.maximum(best, tl.max(s, axis=ROW_AXIS))
    return best, best_m


@triton.jit
def _store_step(
    best,
    best_m,
    OUT,
    WIN_ROW,
    WIN_KEY,
    out_row,
    j0,
    j_start,
    j_end,
    block_row0,
    E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    KEY_BLOCKS: tl.constexpr,
    WITH_WINNER: tl.constexpr,
):
    """Scores (and winners) of the step's key blocks j0 .. j0 + KEY_BLOCKS - 1 that lie in [j_start, j_end)."""
    j = j0 + tl.arange(0, KEY_BLOCKS)  # [KEY_BLOCKS]
    store_ok = (j >= j_start) & (j < j_end)
    per_block = tl.reshape(best, (KEY_BLOCKS, BLOCK_K))
    if WITH_WINNER:
        score, key_arg = tl.max(per_block, axis=1, return_indices=True)  # [KEY_BLOCKS]
        pick = tl.arange(0, BLOCK_K)[None, :] == key_arg[:, None]
        m = tl.sum(tl.where(pick, tl.reshape(best_m, (KEY_BLOCKS, BLOCK_K)), 0), axis=1)
        found = score > float("-inf")
        tl.store(WIN_ROW + out_row + j, tl.where(found, block_row0 * E + m, -1), mask=store_ok)
        tl.store(WIN_KEY + out_row + j, tl.where(found, j * BLOCK_K + key_arg, -1), mask=store_ok)
    else:
        score = tl.max(per_block, axis=1)
    tl.store(OUT + out_row + j, score, mask=store_ok)


@triton.jit
def _fill_outside(
    OUT, WIN_ROW, WIN_KEY, out_row, j_start, j_end, fill_end, FILL: tl.constexpr, WITH_WINNER: tl.constexpr
):
    """-inf scores (winners -1) in the columns no valid key reaches: before ``j_start`` (the first block that can
    share a document) and from ``j_end`` (past the causal edge) to ``fill_end`` (NKB; ``j_end`` for an absent
    block, which stores nothing)."""
    for c0 in range(0, j_start, FILL):
        cols = c0 + tl.arange(0, FILL)
        fill_ok = cols < j_start
        tl.store(OUT + out_row + cols, tl.full([FILL], float("-inf"), tl.float32), mask=fill_ok)
        if WITH_WINNER:
            tl.store(WIN_ROW + out_row + cols, tl.full([FILL], -1, tl.int32), mask=fill_ok)
            tl.store(WIN_KEY + out_row + cols, tl.full([FILL], -1, tl.int32), mask=fill_ok)
    for c0 in range(j_end, fill_end, FILL):
        cols = c0 + tl.arange(0, FILL)
        fill_ok = cols < fill_end
        tl.store(OUT + out_row + cols, tl.full([FILL], float("-inf"), tl.float32), mask=fill_ok)
        if WITH_WINNER:
            tl.store(WIN_ROW + out_row + cols, tl.full([FILL], -1, tl.int32), mask=fill_ok)
            tl.store(WIN_KEY + out_row + cols, tl.full([FILL], -1, tl.int32), mask=fill_ok)


@triton.jit
def _index_block_scores_kernel(
    U,
    W,
    QUERY_BLOCKS,
    SEQ_LENS,
    DOCS,
    OUT,
    WIN_ROW,
    WIN_KEY,
    stride_ub,
    stride_uh,
    stride_um,
    stride_ue,
    stride_us,
    stride_wb,
    stride_wh,
    stride_wn,
    stride_ws,
    H,
    N,
    R,
    NKB,
    S,
    SEARCH_STEPS,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_P2: tl.constexpr,
    ROW_TILE: tl.constexpr,
    ROW_SLICES: tl.constexpr,
    KEY_BLOCKS: tl.constexpr,
    PAIR: tl.constexpr,
    FILL: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    WITH_WINNER: tl.constexpr,
    IEEE: tl.constexpr,
    KEYS_MAJOR: tl.constexpr,
):
    KEYS: tl.constexpr = KEY_BLOCKS * BLOCK_K
    # the program's output rows (local query blocks): one, or two adjacent ones (PAIR) that share each key tile;
    # the last first: late query blocks walk the most key blocks, so the launch ends on short programs
    PER_PROGRAM: tl.constexpr = 2 if PAIR else 1
    i0 = (tl.cdiv(R, PER_PROGRAM) - 1 - tl.program_id(0)) * PER_PROGRAM
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    seqlen = sequence_length(SEQ_LENS, b, N, HAS_SEQ_LENS)  # in [0, N] (the launcher clamps)
    docs_row = DOCS
    if HAS_DOCS:
        docs_row = documents_row(DOCS, b64, N)
    u_head = U + b64 * stride_ub + h.to(tl.int64) * stride_uh
    w_head = W + b64 * stride_wb + h.to(tl.int64) * stride_wh
    offs_s = tl.arange(0, S_P2)
    offs_keys = tl.arange(0, KEYS)

    q_first0, q_end0, j_start0, j_end0, doc_last0 = index_block_bounds(
        QUERY_BLOCKS, i0, i0 < R, seqlen, docs_row, N, SEARCH_STEPS, BLOCK_Q, BLOCK_K, HAS_QUERY_BLOCKS, HAS_DOCS
    )
    u0, pos0, row_ok0 = load_index_rows(
        U, u_head, i0 * BLOCK_Q, q_first0, seqlen, 0, stride_um, stride_ue, stride_us, offs_s, S, E, BLOCK_Q, ROW_TILE
    )
    out_row0 = (bh.to(tl.int64) * R + i0) * NKB
    # the key blocks the program walks (a block without valid rows adds none)
    j_lo = tl.where(j_end0 > 0, j_start0, NKB)
    j_hi = j_end0
    q_end_max = q_end0
    if PAIR:
        i1 = i0 + 1
        present1 = i1 < R
        q_first1, q_end1, j_start1, j_end1, doc_last1 = index_block_bounds(
            QUERY_BLOCKS, i1, present1, seqlen, docs_row, N, SEARCH_STEPS, BLOCK_Q, BLOCK_K, HAS_QUERY_BLOCKS, HAS_DOCS
        )
        u1, pos1, row_ok1 = load_index_rows(
            U,
            u_head,
            i1 * BLOCK_Q,
            q_first1,
            seqlen,
            0,
            stride_um,
            stride_ue,
            stride_us,
            offs_s,
            S,
            E,
            BLOCK_Q,
            ROW_TILE,
        )
        out_row1 = out_row0 + NKB
        j_lo = tl.minimum(j_lo, tl.where(j_end1 > 0, j_start1, NKB))
        j_hi = tl.maximum(j_hi, j_end1)
        q_end_max = tl.maximum(q_end_max, q_end1)

    for j0 in range(j_lo, j_hi, KEY_BLOCKS):
        key_first = j0 * BLOCK_K
        kpos = key_first + offs_keys  # [KEYS]
        key_in = kpos < q_end_max  # keys at or past every block's valid rows are never loaded (NaN padding)
        w = tl.load(
            w_head + kpos.to(tl.int64)[:, None] * stride_wn + offs_s.to(tl.int64)[None, :] * stride_ws,
            mask=key_in[:, None] & (offs_s[None, :] < S),
            other=0.0,
        )  # [KEYS, S_P2]
        doc_k = kpos
        if HAS_DOCS:
            doc_k = tl.load(docs_row + kpos.to(tl.int64), mask=key_in, other=-1)
        if PAIR:
            # each block of the pair computes only the steps inside its own range
            if (j0 + KEY_BLOCKS > j_start0) & (j0 < j_end0):
                best, best_m = _block_step(
                    u0,
                    pos0,
                    row_ok0,
                    U,
                    u_head,
                    i0 * BLOCK_Q,
                    q_first0,
                    q_end0,
                    seqlen,
                    w,
                    kpos,
                    key_first,
                    docs_row,
                    doc_k,
                    doc_last0,
                    stride_um,
                    stride_ue,
                    stride_us,
                    offs_s,
                    S,
                    IEEE,
                    E,
                    BLOCK_Q,
                    ROW_TILE,
                    ROW_SLICES,
                    KEYS,
                    HAS_DOCS,
                    WITH_WINNER,
                    KEYS_MAJOR,
                )
                _store_step(
                    best,
                    best_m,
                    OUT,
                    WIN_ROW,
                    WIN_KEY,
                    out_row0,
                    j0,
                    j_start0,
                    j_end0,
                    i0 * BLOCK_Q,
                    E,
                    BLOCK_K,
                    KEY_BLOCKS,
                    WITH_WINNER,
                )
            if (j0 + KEY_BLOCKS > j_start1) & (j0 < j_end1):
                best1, best_m1 = _block_step(
                    u1,
                    pos1,
                    row_ok1,
                    U,
                    u_head,
                    i1 * BLOCK_Q,
                    q_first1,
                    q_end1,
                    seqlen,
                    w,
                    kpos,
                    key_first,
                    docs_row,
                    doc_k,
                    doc_last1,
                    stride_um,
                    stride_ue,
                    stride_us,
                    offs_s,
                    S,
                    IEEE,
                    E,
                    BLOCK_Q,
                    ROW_TILE,
                    ROW_SLICES,
                    KEYS,
                    HAS_DOCS,
                    WITH_WINNER,
                    KEYS_MAJOR,
                )
                _store_step(
                    best1,
                    best_m1,
                    OUT,
                    WIN_ROW,
                    WIN_KEY,
                    out_row1,
                    j0,
                    j_start1,
                    j_end1,
                    i1 * BLOCK_Q,
                    E,
                    BLOCK_K,
                    KEY_BLOCKS,
                    WITH_WINNER,
                )
        else:
            # the loop is this block's range: no branch around the dot (the pipeliner keeps the key loads ahead)
            best, best_m = _block_step(
                u0,
                pos0,
                row_ok0,
                U,
                u_head,
                i0 * BLOCK_Q,
                q_first0,
                q_end0,
                seqlen,
                w,
                kpos,
                key_first,
                docs_row,
                doc_k,
                doc_last0,
                stride_um,
                stride_ue,
                stride_us,
                offs_s,
                S,
                IEEE,
                E,
                BLOCK_Q,
                ROW_TILE,
                ROW_SLICES,
                KEYS,
                HAS_DOCS,
                WITH_WINNER,
                KEYS_MAJOR,
            )
            _store_step(
                best,
                best_m,
                OUT,
                WIN_ROW,
                WIN_KEY,
                out_row0,
                j0,
                j_start0,
                j_end0,
                i0 * BLOCK_Q,
                E,
                BLOCK_K,
                KEY_BLOCKS,
                WITH_WINNER,
            )

    _fill_outside(OUT, WIN_ROW, WIN_KEY, out_row0, j_start0, j_end0, NKB, FILL, WITH_WINNER)
    if PAIR:
        _fill_outside(
            OUT, WIN_ROW, WIN_KEY, out_row1, j_start1, j_end1, tl.where(present1, NKB, j_end1), FILL, WITH_WINNER
        )


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
_FILL = 256  # columns per store of the -inf fill


def index_block_scores_launch(
    u: Tensor,
    w: Tensor,
    args: IndexScoreArgs,
    *,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
    with_winner: bool = False,
    options: IndexScoreOptions | None = None,
):
    """(scores float32 ``[B, H, R, NKB]``, winner rows int32 ``[B, H, R, NKB]`` or None, winner keys likewise).

    A winner row is ``m * E + e`` (m the row of u, e the index head) and a winner key the key position t of the
    (r, e, t) that gives the score; both -1 where the score is -inf. Computed only with ``with_winner``. No
    validation (``args`` from :func:`check_index_score_args`); u and w are read through their strides."""
    B, H, N, R, NKB = args.B, args.H, args.N, args.rows, args.num_k_blocks
    block_q, block_k, E, S = args.block_q, args.block_k, args.E, args.S
    options = tile_options(block_q, block_k, E, S, options)
    out = torch.empty((B, H, R, NKB), device=u.device, dtype=torch.float32)
    win_row = win_key = None
    if with_winner:
        win_row = torch.empty((B, H, R, NKB), device=u.device, dtype=torch.int32)
        win_key = torch.empty((B, H, R, NKB), device=u.device, dtype=torch.int32)
    if out.numel() == 0:
        return out, win_row, win_key
    rows = triton.next_power_of_2(block_q * E)
    row_tile = min(rows, options.row_tile)
    key_blocks = max(1, options.key_tile // block_k)
    blocks = None if query_blocks is None else query_blocks.to(torch.int32).contiguous()
    launch(
        _index_block_scores_kernel,
        (triton.cdiv(R, options.blocks_per_program), B * H),
        u,
        w,
        out if blocks is None else blocks,
        kernel_seq_lens(seq_lens, N, out),
        kernel_document_ids(document_ids, out),
        out,
        out if win_row is None else win_row,
        out if win_key is None else win_key,
        *u.stride(),
        *w.stride(),
        H,
        N,
        R,
        NKB,
        S,
        max(1, N.bit_length()),
        E=E,
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        S_P2=max(16, triton.next_power_of_2(S)),
        ROW_TILE=row_tile,
        ROW_SLICES=rows // row_tile,
        KEY_BLOCKS=key_blocks,
        PAIR=options.blocks_per_program == 2,
        FILL=_FILL,
        HAS_QUERY_BLOCKS=blocks is not None,
        HAS_SEQ_LENS=seq_lens is not None,
        HAS_DOCS=document_ids is not None,
        WITH_WINNER=with_winner,
        IEEE=u.dtype == torch.float32,
        KEYS_MAJOR=options.keys_major,
        num_warps=options.num_warps,
        num_stages=options.num_stages,
    )
    return out, win_row, win_key


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd op
# ----------------------------------------------------------------------------------------------
def _scatter_rows(target: Tensor, index: Tensor, values: Tensor, deterministic: bool) -> None:
    """``target[index[k]] += values[k]`` for every k (rows of a 2-D float32 target)."""
    if deterministic:
        target.index_put_((index,), values, accumulate=True)  # sorted accumulation under the deterministic flag
    else:
        target.index_add_(0, index, values)


def winner_gradients(
    grad: Tensor,
    scores: Tensor,
    win_row: Tensor,
    win_key: Tensor,
    u: Tensor,
    w: Tensor,
    *,
    need_u: bool = True,
    need_w: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """(du, dw) of the scores through the hard max: each finite score's gradient times ``w[t]`` lands on
    ``du[m, e]`` and times ``u[m, e]`` on ``dw[t]`` at its winner (``win_row = m * E + e``, ``win_key = t``);
    -inf scores pass nothing. Accumulated in float32 over chunks of output rows, returned in u's / w's dtype."""
    B, H, M, E, S = u.shape
    N = w.shape[2]
    R, NKB = scores.shape[2], scores.shape[3]
    deterministic = torch.are_deterministic_algorithms_enabled()
    u_rows = u.reshape(B * H * M * E, S)
    w_rows = w.reshape(B * H * N, S)
    du = torch.zeros((B * H * M * E, S), device=u.device, dtype=torch.float32) if need_u else None
    dw = torch.zeros((B * H * N, S), device=w.device, dtype=torch.float32) if need_w else None
    per_row = B * H * NKB * S * 4 * 2
    step = max(1, min(R, BACKWARD_CHUNK_BYTES // max(1, per_row)))
    head = torch.arange(B * H, device=u.device, dtype=torch.int64).view(B, H, 1, 1)
    for start in range(0, R, step):
        part = slice(start, start + step)
        found = (scores[:, :, part] > float("-inf")).reshape(-1, 1)
        g = grad[:, :, part].to(torch.float32).reshape(-1, 1)
        row = (head * (M * E) + win_row[:, :, part].clamp(min=0).to(torch.int64)).reshape(-1)
        key = (head * N + win_key[:, :, part].clamp(min=0).to(torch.int64)).reshape(-1)
        # selection, not multiplication: the rows gathered for -inf scores may be NaN padding
        if need_u:
            _scatter_rows(
                du, row, torch.where(found, g * w_rows.index_select(0, key).to(torch.float32), 0.0), deterministic
            )
        if need_w:
            _scatter_rows(
                dw, key, torch.where(found, g * u_rows.index_select(0, row).to(torch.float32), 0.0), deterministic
            )
    return (
        None if du is None else du.view(B, H, M, E, S).to(u.dtype),
        None if dw is None else dw.view(B, H, N, S).to(w.dtype),
    )


class _IndexBlockScores(torch.autograd.Function):
    """Forward: the kernel with the winners stored. Backward: the scatter-add of :func:`winner_gradients`."""

    @staticmethod
    def forward(ctx, u, w, seq_lens, document_ids, query_blocks, args, options):
        scores, win_row, win_key = index_block_scores_launch(
            u.detach(),
            w.detach(),
            args,
            seq_lens=seq_lens,
            document_ids=document_ids,
            query_blocks=query_blocks,
            with_winner=True,
            options=options,
        )
        ctx.save_for_backward(u, w, scores, win_row, win_key)
        return scores

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        u, w, scores, win_row, win_key = ctx.saved_tensors
        du, dw = winner_gradients(
            grad,
            scores,
            win_row,
            win_key,
            u.detach(),
            w.detach(),
            need_u=ctx.needs_input_grad[0],
            need_w=ctx.needs_input_grad[1],
        )
        return du, dw, None, None, None, None, None


def shape_args(u: Tensor, w: Tensor, block_q: int, block_k: int, query_blocks: Tensor | None) -> IndexScoreArgs:
    """The geometry of a call read from its shapes, unchecked: the custom ops' implementations rebuild it (their
    public functions checked the arguments with :func:`check_index_score_args`)."""
    B, H, M, E, S = u.shape
    N = w.shape[2]
    rows = -(-N // block_q) if query_blocks is None else query_blocks.shape[0]
    return IndexScoreArgs(B, H, M, E, S, N, block_q, block_k, rows)


def score_shape(u: Tensor, w: Tensor, block_q: int, block_k: int, query_blocks: Tensor | None) -> tuple:
    """``(B, H, R, NKB)``, the shape of the block scores of u ``[B, H, M, E, S]`` and w ``[B, H, N, S]`` (the fake
    implementations' outputs; symbolic sizes welcome)."""
    args = shape_args(u, w, block_q, block_k, query_blocks)
    return (args.B, args.H, args.rows, -(-args.N // block_k))


def _option_values(options: IndexScoreOptions) -> list[int]:
    """Filled tile options (:func:`tile_options`) as the custom op's int list."""
    return [*options[:5], int(options.keys_major)]


def _options_of(values: list[int]) -> IndexScoreOptions:
    """The tile options of :func:`_option_values`'s list."""
    return IndexScoreOptions(*values[:5], keys_major=bool(values[5]))


# ``sparse_train::index_block_scores``: the kernel as a torch.library custom op (torch.compile, export and dispatch
# modes run it as one graph node; eager calls on plain tensors take ``_IndexBlockScores``). The winners are stored
# only with ``with_winner`` (autograd needs them); without, the op returns two empty int32 tensors in their place.
@torch.library.custom_op("sparse_train::index_block_scores", mutates_args=())
def _index_block_scores_op(
    u: Tensor,
    w: Tensor,
    seq_lens: Tensor | None,
    document_ids: Tensor | None,
    query_blocks: Tensor | None,
    block_q: int,
    block_k: int,
    options: list[int],
    with_winner: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    scores, win_row, win_key = index_block_scores_launch(
        u,
        w,
        shape_args(u, w, block_q, block_k, query_blocks),
        seq_lens=seq_lens,
        document_ids=document_ids,
        query_blocks=query_blocks,
        with_winner=with_winner,
        options=_options_of(options),
    )
    if not with_winner:
        win_row, win_key = u.new_empty((0,), dtype=torch.int32), u.new_empty((0,), dtype=torch.int32)
    return scores, win_row, win_key


@_index_block_scores_op.register_fake
def _(u, w, seq_lens, document_ids, query_blocks, block_q, block_k, options, with_winner):
    shape = score_shape(u, w, block_q, block_k, query_blocks)  # [B, H, R, NKB]
    winners = shape if with_winner else (0,)
    return (
        u.new_empty(shape, dtype=torch.float32),
        u.new_empty(winners, dtype=torch.int32),
        u.new_empty(winners, dtype=torch.int32),
    )


# ``sparse_train::index_block_scores_bwd``: :func:`winner_gradients` as the op's backward node; a gradient not
# asked for (``need_u`` / ``need_w`` false) comes back as an empty tensor.
@torch.library.custom_op("sparse_train::index_block_scores_bwd", mutates_args=())
def _index_block_scores_bwd_op(
    grad: Tensor, scores: Tensor, win_row: Tensor, win_key: Tensor, u: Tensor, w: Tensor, need_u: bool, need_w: bool
) -> tuple[Tensor, Tensor]:
    du, dw = winner_gradients(grad, scores, win_row, win_key, u, w, need_u=need_u, need_w=need_w)
    return (u.new_empty((0,)) if du is None else du), (w.new_empty((0,)) if dw is None else dw)


@_index_block_scores_bwd_op.register_fake
def _(grad, scores, win_row, win_key, u, w, need_u, need_w):
    return u.new_empty(u.shape if need_u else (0,)), w.new_empty(w.shape if need_w else (0,))


def _index_block_scores_setup(ctx, inputs, output) -> None:
    u, w = inputs[:2]
    scores, win_row, win_key = output
    ctx.save_for_backward(u, w, scores, win_row, win_key)


def _index_block_scores_backward(ctx, grad, *_):
    u, w, scores, win_row, win_key = ctx.saved_tensors
    if win_row.dim() != 4:
        raise RuntimeError("sparse_train::index_block_scores has a gradient only when called with with_winner=True")
    need_u, need_w = ctx.needs_input_grad[:2]
    du, dw = torch.ops.sparse_train.index_block_scores_bwd(grad, scores, win_row, win_key, u, w, need_u, need_w)
    return (du if need_u else None), (dw if need_w else None), *([None] * 7)


_index_block_scores_op.register_autograd(_index_block_scores_backward, setup_context=_index_block_scores_setup)


# ----------------------------------------------------------------------------------------------
# Layer 4: public function
# ----------------------------------------------------------------------------------------------
def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def index_scores_support(u: Tensor) -> tuple[bool, str]:
    """(whether the kernel runs ``u``'s device and dtype, the reason when not)."""
    if u.device.type == "cuda":
        if u.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"dtype {u.dtype} on CUDA (the kernel takes float16, bfloat16, float32)"
        return True, "ok"
    if u.device.type == "cpu":
        if not _interpreter():
            return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton kernel"
        if u.dtype not in (torch.float16, torch.float32):
            return False, (
                f"dtype {u.dtype} under the Triton interpreter (float16, float32 only: its bf16 math is wrong)"
            )
        return True, "ok"
    return False, f"device type {u.device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"


def index_block_scores(
    u: Tensor,
    w: Tensor,
    *,
    block_q: int,
    block_k: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
    backend: str = "auto",
    options: IndexScoreOptions | None = None,
) -> Tensor:
    """Token-level index block scores: the largest index logit of each (query block, key block) pair, in tiles.

    ``score[b, h, i, j]`` is the max over the rows r of query block i, the index heads e and the keys t of key
    block j with t <= r, r < len_b, t < len_b and (with documents) doc[b, t] == doc[b, r] of
    ``sum_s u[b, h, r, e, s] * w[b, h, t, s]``, accumulated in float32; -inf where no (r, t) is valid (key
    blocks after the query block, blocks past ``seq_lens``, blocks of other documents).

    Args:
        u: index queries ``[B, H, M, E, S]``, E >= 1 index heads of dim S per row; float16, bfloat16 or float32
            (float64 on the reference), any strides. Without ``query_blocks`` M = N and row m is position m; with
            them M = R * block_q and row m is position ``query_blocks[m // block_q] * block_q + m % block_q``
            (positions >= N are padding).
        w: index keys ``[B, H, N, S]``, u's dtype and device, any strides.
        block_q, block_k: block sizes, each one of 16, 32, 64, 128.
        seq_lens: optional int ``[B]`` in [0, N]: rows and keys at positions >= seq_lens[b] take no part; u and
            w may hold anything there (NaN included) without reaching a score or a gradient.
        document_ids: optional int ``[B, N]``, non-decreasing per row (packed documents): a key counts only for
            rows of its own document.
        query_blocks: optional int ``[R]`` of global query-block ids, any order (sampled query blocks of the
            distillation; a rank's local query blocks under context parallelism).
        backend: ``"auto"`` (default): the kernel for CUDA tensors of float16 / bfloat16 / float32, the
            reference otherwise; ``"triton"``: the kernel (CPU tensors too when ``TRITON_INTERPRET=1``; raises
            when it cannot run the input); ``"reference"``:
            :func:`~sparse_train.kernels.reference.index_scores.reference_index_block_scores`.
        options: tile choices (:class:`IndexScoreOptions`); None fields (all by default) take
            :func:`tile_options`.

    Returns:
        float32 ``[B, H, R, NKB]``, NKB = ceil(N / block_k), R = NQB = ceil(N / block_q) without
        ``query_blocks`` (the reference returns float64 for float64 inputs). Differentiable in u and w: the
        gradient of a score reaches the winning (r, e, t) only (``grad * w[t]`` into ``du[r, e]``, ``grad *
        u[r, e]`` into ``dw[t]``); -inf scores pass none. Deterministic under
        ``torch.use_deterministic_algorithms(True)``.

    Raises:
        ValueError: a tensor of the wrong rank, shape (B, H, S disagreeing; M not N or R * block_q), dtype or
            device; E < 1; a block size outside (16, 32, 64, 128); bad ``seq_lens``, ``document_ids`` or
            ``query_blocks`` (shapes and dtypes always, values for CPU tensors); an unknown ``backend``; bad
            ``options``; ``backend="triton"`` with an input the kernel cannot run (float64, bfloat16 under the
            interpreter, CPU tensors without ``TRITON_INTERPRET=1``).
    """
    check_choice("backend", backend, BACKENDS)
    options = _check_options(options)
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    if backend == "reference":
        use_kernel = False
    else:
        supported, reason = index_scores_support(u)
        if backend == "triton" and not supported:
            raise ValueError(f"backend='triton' cannot run this input: {reason}")
        use_kernel = supported and (backend == "triton" or u.device.type == "cuda")
    if not use_kernel:
        return reference_index_block_scores(
            u,
            w,
            block_q=block_q,
            block_k=block_k,
            seq_lens=seq_lens,
            document_ids=document_ids,
            query_blocks=query_blocks,
        )
    with_grad = torch.is_grad_enabled() and (u.requires_grad or w.requires_grad)
    if not direct_call(u, w, seq_lens, document_ids, query_blocks):
        tiles = _option_values(tile_options(block_q, block_k, args.E, args.S, options))
        scores, _, _ = torch.ops.sparse_train.index_block_scores(
            u, w, seq_lens, document_ids, query_blocks, block_q, block_k, tiles, with_grad
        )
        return scores
    if with_grad:
        return _IndexBlockScores.apply(u, w, seq_lens, document_ids, query_blocks, args, options)
    scores, _, _ = index_block_scores_launch(
        u.detach(),
        w.detach(),
        args,
        seq_lens=seq_lens,
        document_ids=document_ids,
        query_blocks=query_blocks,
        options=options,
    )
    return scores
