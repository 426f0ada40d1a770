"""Small ``@triton.jit`` helpers and constants shared by the kernels.

Each helper is a few lines the kernels would otherwise repeat (the program's tile, its index row, row
and pointer tiles, the IEEE-or-default dot, the dropout keep bit, the RoPE angles' cosine and sine of the
pooling and un-rotation kernels); Triton inlines them, so a kernel
compiles to the code it had with the lines written out.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = [
    "LN2",
    "LOG2E",
    "crosses_documents",
    "documents_row",
    "dot",
    "dropout_keep",
    "index_block_bounds",
    "index_row",
    "last_document",
    "load_documents",
    "load_index_rows",
    "load_key_tile",
    "load_rows",
    "log2_lse",
    "map_query_rows",
    "mask_scores",
    "query_documents",
    "query_tile",
    "rope_cos_sin",
    "rope_pairs",
    "sequence_length",
    "tile_pointers",
    "tile_row_slice",
    "tile_rows",
]

LOG2E = tl.constexpr(math.log2(math.e))
"""log2(e): the kernels run the softmax in base 2, exp(x) = exp2(x * LOG2E) (host side: ``LOG2E.value``)."""
LN2 = tl.constexpr(math.log(2.0))
"""ln(2): converts a base-2 log-sum-exp back to the natural log the API returns."""


INV_TWO_PI = tl.constexpr(1.0 / (2.0 * math.pi))
"""1 / (2 pi): turns of a RoPE angle (:func:`rope_cos_sin`)."""
TWO_PI_HI = tl.constexpr(6.28125)  # 8 significant bits: turns * TWO_PI_HI is exact in float32 below 2**16 turns
TWO_PI_LO = tl.constexpr(2.0 * math.pi - 6.28125)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``IEEE`` keeps fp32 inputs exact (the interpreter tests), otherwise
    the default precision (tensor cores: bf16/fp16 inputs; tf32 if the inputs were fp32)."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def tile_rows(
    query_block, kv_head, head_subset, GROUP: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_Q: tl.constexpr
):
    """The HEADS_PER_PROGRAM * BLOCK_Q rows of one tile, heads stacked: (query head, query position)
    of each row, int32."""
    return tile_row_slice(
        query_block, kv_head, head_subset, 0, HEADS_PER_PROGRAM * BLOCK_Q, GROUP, HEADS_PER_PROGRAM, BLOCK_Q
    )


@triton.jit
def tile_row_slice(
    query_block,
    kv_head,
    head_subset,
    first_row,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Rows ``first_row .. first_row + ROWS - 1`` of the tile of :func:`tile_rows` (a kernel that walks
    its tile in slices keeps fewer scores live): (query head, query position) of each row, int32."""
    rows = first_row + tl.arange(0, ROWS)
    head = kv_head * GROUP + head_subset * HEADS_PER_PROGRAM + rows // BLOCK_Q
    position = query_block * BLOCK_Q + rows % BLOCK_Q
    return head, position


@triton.jit
def query_tile(
    NQB,
    HKV,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    LATE_BLOCKS_FIRST: tl.constexpr,
):
    """This program's tile on a grid (NQB * HEAD_SUBSETS, B * HKV): query block, batch, KV head, and per
    row its query head and position (int32). Programs sharing a query block (and so its K/V blocks)
    are adjacent in launch order, so the second finds K/V in L2; ``LATE_BLOCKS_FIRST`` starts the late
    (longest) query blocks first."""
    HEAD_SUBSETS: tl.constexpr = GROUP // HEADS_PER_PROGRAM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if LATE_BLOCKS_FIRST:
        query_block = NQB - 1 - pid_m // HEAD_SUBSETS
    else:
        query_block = pid_m // HEAD_SUBSETS
    kv_head = pid_bh % HKV
    head, position = tile_rows(query_block, kv_head, pid_m % HEAD_SUBSETS, GROUP, HEADS_PER_PROGRAM, BLOCK_Q)
    return query_block, pid_bh // HKV, kv_head, head, position


@triton.jit
def map_query_rows(QUERY_MAP, QUERY_ROW0, local_block, position, BLOCK_Q: tl.constexpr, HAS_QUERY_MAP: tl.constexpr):
    """Rows of LOCAL query block ``local_block`` under a query-block map (context parallelism): q, o,
    lse, dO and dQ hold only the rows of the listed global blocks, while positions (masks, dropout
    counters, document ids) are global. ``position`` int32 ``[R]``: the rows as ``local_block * BQ + r``
    (what :func:`tile_rows` gives for the local block). Returns (global query block, global positions
    int32 ``[R]``, rows of q/o/lse int64 ``[R]``): the global block is ``QUERY_MAP[local_block]``, the first
    row of the block in q is ``QUERY_ROW0[local_block]`` (int64: a short last block listed before
    others shifts the rows after it). Without a map (``HAS_QUERY_MAP`` False) local is global."""
    if HAS_QUERY_MAP:
        global_block = tl.load(QUERY_MAP + local_block)
        offset = position - local_block * BLOCK_Q
        global_position = global_block * BLOCK_Q + offset
        row = tl.load(QUERY_ROW0 + local_block) + offset.to(tl.int64)
    else:
        global_block = local_block
        global_position = position
        row = position.to(tl.int64)
    return global_block, global_position, row


@triton.jit
def index_row(
    INDICES, COUNTS, b64, kv_head64, query_block64, stride_ib, stride_ih, stride_iq, stride_cb, stride_ch, stride_cq
):
    """(pointer to the first slot, number of valid slots) of the index row of one query block."""
    count = tl.load(COUNTS + b64 * stride_cb + kv_head64 * stride_ch + query_block64 * stride_cq)
    return INDICES + b64 * stride_ib + kv_head64 * stride_ih + query_block64 * stride_iq, count


@triton.jit
def tile_pointers(base, positions, offs_d, stride_n, stride_d):
    """Pointers of a ``[len(positions), D]`` tile: ``base + positions * stride_n + d * stride_d``
    (``base`` a pointer or a column of pointers, ``positions`` int64)."""
    return base + positions[:, None] * stride_n + offs_d[None, :] * stride_d


@triton.jit
def load_rows(X, b64, head64, position64, offs_d, stride_b, stride_h, stride_n, stride_d, mask):
    """Rows ``X[b, head[r], position[r], :]`` of a ``[B, H, N, D]`` tensor as an ``[R, D]`` tile, 0 where
    ``mask`` is False (heads and positions int64 ``[R]``)."""
    pointers = tile_pointers(X + b64 * stride_b + head64[:, None] * stride_h, position64, offs_d, stride_n, stride_d)
    return tl.load(pointers, mask=mask[:, None], other=0.0)


@triton.jit
def load_key_tile(
    DESC,
    base,
    b,
    kv_head,
    block,
    positions64,
    offs_d,
    stride_n,
    stride_d,
    valid,
    crosses_length,
    TMA_LOADS: tl.constexpr,
    ZERO_PAST_LENGTH: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Key block ``block`` of K or V (``[BK, D]``) of one (batch, KV head). Pointer loads (``base`` the
    head's first row) give 0 where ``valid`` (``positions < seq_len``) is false. A TMA descriptor load gives
    0 only past N: rows in ``[seq_len, N)`` arrive as stored, so with ``ZERO_PAST_LENGTH`` (a kernel whose
    product with this tile would turn NaN padding into NaN results through 0 * NaN) the block that crosses
    the length (``crosses_length``) has those rows zeroed."""
    if TMA_LOADS:
        tile = DESC.load([b, kv_head, block * BLOCK_K, 0]).reshape(BLOCK_K, HEAD_DIM)
        if ZERO_PAST_LENGTH:
            if crosses_length:
                tile = tl.where(valid[:, None], tile, 0.0)
    else:
        tile = tl.load(tile_pointers(base, positions64, offs_d, stride_n, stride_d), mask=valid[:, None], other=0.0)
    return tile


@triton.jit
def sequence_length(SEQ_LENS, batch, N, HAS_SEQ_LENS: tl.constexpr):
    """Keys at positions >= this are padding: seq_lens[batch] (clamped to [0, N] by the launcher), or N."""
    if HAS_SEQ_LENS:
        length = tl.load(SEQ_LENS + batch).to(tl.int32)
    else:
        length = N
    return length


@triton.jit
def documents_row(DOCS, b64, N):
    """Pointer to the document ids of batch row b (the launcher passes them as int32 contiguous ``[B, N]``)."""
    return DOCS + b64 * N


@triton.jit
def load_documents(docs_row, positions, N):
    """Document ids of ``positions`` (int32 ``[R]``); -1 past N, where the length mask already excludes
    every key and no query row is stored."""
    return tl.load(docs_row + positions.to(tl.int64), mask=positions < N, other=-1)


@triton.jit
def last_document(docs_row, first, LENGTH: tl.constexpr, N):
    """Document id of the last real position of the block of ``LENGTH`` positions from ``first`` (the
    last block may be cut by N): the block's largest id, since ids are non-decreasing."""
    return tl.load(docs_row + tl.minimum(first + LENGTH, N) - 1)


@triton.jit
def query_documents(DOCS, b64, positions, query_first, N, BLOCK_Q: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The query side of the document mask of one tile (:func:`mask_scores`): (pointer to batch row b's
    document ids, document id of each query ``positions`` int32 ``[M]``, document id of the last real
    query of the block starting at ``query_first``). Without documents the three are unused
    placeholders of the right kinds (``DOCS``, ``positions``, 0)."""
    if HAS_DOCS:
        docs_row = documents_row(DOCS, b64, N)
        doc_q = load_documents(docs_row, positions, N)
        doc_q_last = last_document(docs_row, query_first, BLOCK_Q, N)
    else:
        docs_row = DOCS
        doc_q = positions
        doc_q_last = 0
    return docs_row, doc_q, doc_q_last


@triton.jit
def crosses_documents(docs_row, key_first, query_last_doc):
    """Whether a key block that ends at or before its query tile's first query holds a (key, query)
    pair of two documents. Such a block precedes every query of the tile, so its first key and the
    tile's last query are the smallest and largest ids of the pair (ids are non-decreasing): the pair
    is one document iff those two ids are equal. Blocks reaching past the tile's first query take the
    causal mask, document check included, anyway."""
    return tl.load(docs_row + key_first) != query_last_doc


@triton.jit
def mask_scores(
    s,
    qpos,
    kpos,
    seqlen,
    key_first,
    query_first,
    docs_row,
    doc_q,
    doc_q_last,
    N,
    HAS_DOCS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Scores ``s`` ``[M, BK]`` (rows = queries ``qpos``, columns = keys ``kpos``, the key block starting at
    ``key_first``) with -inf where the key is not visible: after the query, at or past ``seqlen``, or
    (``HAS_DOCS``) in another document. Only blocks that reach past the tile's first query, cross the
    sequence end or hold two documents can hold such a pair, so the others skip the mask; the forward
    and the dQ kernel mask alike (dK/dV masks the transposed tile the same way). Without documents,
    ``docs_row``, ``doc_q`` and ``doc_q_last`` are unused placeholders."""
    edge = (key_first + BLOCK_K - 1 > query_first) | (key_first + BLOCK_K > seqlen)
    if HAS_DOCS:
        if edge | crosses_documents(docs_row, key_first, doc_q_last):
            doc_k = load_documents(docs_row, kpos, N)
            ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seqlen) & (doc_q[:, None] == doc_k[None, :])
            s = tl.where(ok, s, float("-inf"))
    else:
        if edge:
            ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seqlen)
            s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def log2_lse(lse):
    """The forward's natural-log lse in base 2; rows without a valid key (lse = -inf) get +inf, so
    exp2(s - lse2) = 0 for every key instead of NaN."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def dropout_keep(seed, counters, threshold):
    """Keep bits of the elements with Philox counters ``counters`` (int64, see
    ``reference.dropout_offsets``): ``randint(seed, counter) >= threshold``, as ``reference.dropout_keep_mask``."""
    return tl.randint(seed, counters).to(tl.int64) >= threshold


@triton.jit
def rope_cos_sin(POS, b64, rows, row_ok, freq, HAS_POS: tl.constexpr, FAST_TRIG: tl.constexpr, stride_pb, stride_pn):
    """cos and sin [ROWS, HALF] of the RoPE angles pos[n] * w_d of a row tile (``freq`` [HALF] the inverse
    frequencies; positions from POS, or the row numbers without HAS_POS). The angle is the float32 product of
    the float32 position and frequency, as in the reference; FAST_TRIG takes the hardware approximations after
    a reduction by whole turns (errors far below the float32 angle's own rounding, ~4e-3 rad at position
    65536), otherwise tl.cos / tl.sin (the interpreter)."""
    rows64 = rows.to(tl.int64)
    if HAS_POS:
        pos = tl.load(POS + b64 * stride_pb + rows64 * stride_pn, mask=row_ok, other=0).to(tl.float32)
    else:
        pos = rows.to(tl.float32)
    angle = pos[:, None] * freq[None, :]  # [ROWS, HALF]
    if FAST_TRIG:
        # the hardware's sine and cosine are accurate to ~1e-6 on [-pi, pi]; reduce by whole turns first
        # (2 pi = TWO_PI_HI + TWO_PI_LO, the high part exact times any turn count below 2**16, angles below
        # ~4e5 rad)
        turns = tl.floor(angle * INV_TWO_PI + 0.5)
        angle = (angle - turns * TWO_PI_HI) - turns * TWO_PI_LO
        return libdevice.fast_cosf(angle), libdevice.fast_sinf(angle)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rope_pairs(INV_FREQ, ROT_HALF: tl.constexpr, HALF_P2: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The rotated pairs of RoPE, [HALF] each: (pair valid, first channel, partner channel, inverse frequency
    float32). Pair i is channels (i, i + R/2) (rotate-half) or (2i, 2i + 1) (``INTERLEAVED``)."""
    half = tl.arange(0, HALF_P2)  # [HALF] pair index i
    half_ok = half < ROT_HALF
    if INTERLEAVED:
        first_ch = 2 * half
        second_ch = 2 * half + 1
    else:
        first_ch = half
        second_ch = half + ROT_HALF
    freq = tl.load(INV_FREQ + half, mask=half_ok, other=0.0).to(tl.float32)
    return half_ok, first_ch, second_ch, freq


@triton.jit
def load_index_rows(
    U,
    u_head,
    block_row0,
    q_first,
    seqlen,
    slice_index,
    stride_um,
    stride_ue,
    stride_us,
    offs_s,
    S,
    E: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROW_TILE: tl.constexpr,
):
    """Index-score kernels: rows ``slice_index * ROW_TILE ..`` of one query block's tile of index queries u (row
    m = r * E + e): (tile [ROW_TILE, S_P2], 0 where invalid; the query position of each row; whether the row is a
    real query)."""
    offs_m = slice_index * ROW_TILE + tl.arange(0, ROW_TILE)  # [ROW_TILE] m = r * E + e
    r = offs_m // E
    e = offs_m % E
    pos = q_first + r
    row_ok = (offs_m < BLOCK_Q * E) & (pos < seqlen)
    pointers = (
        u_head
        + (block_row0 + r).to(tl.int64)[:, None] * stride_um
        + e.to(tl.int64)[:, None] * stride_ue
        + offs_s.to(tl.int64)[None, :] * stride_us
    )
    tile = tl.load(pointers, mask=row_ok[:, None] & (offs_s[None, :] < S), other=0.0)
    return tile, pos, row_ok


@triton.jit
def index_block_bounds(
    QUERY_BLOCKS,
    i,
    present,
    seqlen,
    docs_row,
    N,
    SEARCH_STEPS,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_QUERY_BLOCKS: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Index-score kernels: (first position, end of the valid rows, first and end key block that can hold a valid
    key, document of the block's last row) of local query block ``i``; an absent block (``present`` False: past R)
    has no rows."""
    if HAS_QUERY_BLOCKS:
        qb = tl.load(QUERY_BLOCKS + i, mask=present, other=0)
    else:
        qb = i
    q_first = qb * BLOCK_Q
    q_end = tl.where(present, tl.minimum(q_first + BLOCK_Q, seqlen), q_first)  # valid rows: q_first .. q_end - 1
    # key blocks j_start .. j_end - 1 can hold a valid key: t <= r < q_end
    j_end = tl.where(q_end > q_first, (q_end + BLOCK_K - 1) // BLOCK_K, 0)
    j_start = q_first * 0
    doc_q_last = q_first * 0
    if HAS_DOCS:
        doc_q_last = last_document(docs_row, q_first, BLOCK_Q, N)
        if j_end > 0:
            # first key position of the document of the block's first row (ids are non-decreasing)
            doc_first = tl.load(docs_row + q_first)
            lo = q_first * 0
            hi = q_first
            for _ in range(SEARCH_STEPS):
                mid = (lo + hi) // 2
                right = tl.load(docs_row + mid) < doc_first
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where(right, hi, mid)
            j_start = lo // BLOCK_K
    return q_first, q_end, j_start, j_end, doc_q_last
