"""PyTorch reference of the token-level index block scores, and the argument checks both paths share.

Math, per batch b, head h, query block i (``query_blocks[i]`` when given) and key block j:

    score[b, h, i, j] = max over rows r of query block i, index heads e, keys t of key block j
                        with t <= r, r < len_b, t < len_b, doc[b, t] == doc[b, r]
                        of  sum_s u[b, h, r, e, s] * w[b, h, t, s]

with ``len_b = seq_lens[b]`` (or N) and ``doc`` the packed-document ids (when given). A pair of blocks
without a valid (r, t) scores -inf. The kernel that computes the same scores in tiles is
:func:`sparse_train.kernels.triton.index_scores.index_block_scores`.

The reference is written for reading and for tests: the logits of a chunk of query blocks against every key,
``[B, H, C, BQ * E, N]`` in the compute dtype (float64 for float64 inputs, float32 otherwise), masked with -inf,
padded to whole key blocks and reduced with ``amax``. Autograd goes through the torch ops (``amax`` splits the
gradient among exact ties). Memory is O(C x N) per chunk, C sized to :data:`REFERENCE_CHUNK_BYTES`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...validation import check_document_ids, check_integer_tensor, check_seq_lens

__all__ = [
    "REFERENCE_CHUNK_BYTES",
    "IndexScoreArgs",
    "check_index_score_args",
    "listed_positions",
    "reference_index_block_scores",
    "sequence_lengths",
]

REFERENCE_CHUNK_BYTES = 256 * 2**20
"""Largest logits buffer of one chunk of query blocks in :func:`reference_index_block_scores`."""

BLOCK_SIZES = (16, 32, 64, 128)
"""Block sizes the index scores accept (the kernel's tile sizes: powers of two, 16..128)."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class IndexScoreArgs:
    """The checked geometry of one call: batch ``B``, heads ``H``, rows ``M`` of u, index heads ``E``, index dim
    ``S``, length ``N``, block sizes, ``NQB``, ``NKB`` and the number of output rows ``R``."""

    __slots__ = ("B", "E", "H", "M", "N", "S", "block_k", "block_q", "num_k_blocks", "num_q_blocks", "rows")

    def __init__(self, B, H, M, E, S, N, block_q, block_k, rows):
        self.B, self.H, self.M, self.E, self.S, self.N = B, H, M, E, S, N
        self.block_q, self.block_k = block_q, block_k
        self.num_q_blocks = math.ceil(N / block_q)
        self.num_k_blocks = math.ceil(N / block_k)
        self.rows = rows


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in BLOCK_SIZES:
        raise ValueError(f"{name} must be one of {BLOCK_SIZES} (a power of two from 16 to 128), got {value!r}")
    return value


def checks_values(device: torch.device) -> bool:
    """Whether :func:`check_index_score_args` checks the values of ``seq_lens``, ``document_ids`` and
    ``query_blocks`` on ``device``: on the CPU, where reading them costs nothing; on a GPU that read would be a host
    sync."""
    return device.type == "cpu"


def check_index_score_args(
    u, w, block_q, block_k, seq_lens=None, document_ids=None, query_blocks=None, *, dtypes=_FLOAT_DTYPES
) -> IndexScoreArgs:
    """Check the arguments of the index block scores; a bad one raises a ``ValueError`` that names it.

    u: float ``[B, H, M, E, S]``; w: float ``[B, H, N, S]`` with the same dtype (one of ``dtypes``), device, B, H
    and S; H, E, S, N >= 1 (B may be 0); block sizes in :data:`BLOCK_SIZES`; M = N without ``query_blocks``, else
    M = R * block_q for ``query_blocks`` an integer ``[R]`` tensor on u's device. ``seq_lens`` (int ``[B]``) and
    ``document_ids`` (int ``[B, N]``) as :mod:`sparse_train.validation` checks them. Values (of seq_lens,
    document_ids and query_blocks) are checked only where :func:`checks_values` says (CPU tensors).
    """
    for name, t, rank, layout in (("u", u, 5, "[B, H, M, E, S]"), ("w", w, 4, "[B, H, N, S]")):
        if not isinstance(t, Tensor) or t.dim() != rank:
            raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have a dtype among {tuple(str(d) for d in dtypes)}, got {t.dtype}")
    if u.dtype != w.dtype:
        raise ValueError(f"u and w must share a dtype, got u {u.dtype} and w {w.dtype}")
    if u.device != w.device:
        raise ValueError(f"u and w must be on one device, got u on {u.device} and w on {w.device}")
    B, H, M, E, S = u.shape
    if tuple(w.shape[:2]) != (B, H) or w.shape[3] != S:
        raise ValueError(
            f"u {tuple(u.shape)} and w {tuple(w.shape)} disagree on B, H or S "
            "(expected u [B, H, M, E, S] and w [B, H, N, S])"
        )
    N = w.shape[2]
    if H < 1 or N < 1 or S < 1:
        raise ValueError(f"w must have H, N, S >= 1, got shape {tuple(w.shape)}")
    if E < 1:
        raise ValueError(f"u must have E >= 1 index heads, got shape {tuple(u.shape)}")
    block_q = _check_block("block_q", block_q)
    block_k = _check_block("block_k", block_k)
    on_cpu = checks_values(u.device)
    check_seq_lens(seq_lens, B, N, u.device, values=on_cpu)
    check_document_ids(document_ids, B, N, u.device, values=on_cpu)
    num_q_blocks = math.ceil(N / block_q)
    if query_blocks is None:
        if M != N:
            raise ValueError(f"u must have M = N = {N} rows without query_blocks, got shape {tuple(u.shape)}")
        rows = num_q_blocks
    else:
        check_integer_tensor("query_blocks", query_blocks, dim=1)
        if query_blocks.device != u.device:
            raise ValueError(f"query_blocks is on {query_blocks.device} but u is on {u.device}")
        rows = query_blocks.numel()
        if M != rows * block_q:
            raise ValueError(
                f"u must have M = len(query_blocks) * block_q = {rows} * {block_q} = {rows * block_q} "
                f"rows with query_blocks, got shape {tuple(u.shape)}"
            )
        if on_cpu and rows:
            bad = (query_blocks < 0) | (query_blocks >= num_q_blocks)
            if bool(bad.any()):
                first = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"query_blocks values must lie in [0, NQB={num_q_blocks}), got "
                    f"query_blocks[{first}] = {int(query_blocks[first])}"
                )
    return IndexScoreArgs(B, H, M, E, S, N, block_q, block_k, rows)


def listed_positions(query_blocks: Tensor, block_q: int, device) -> Tensor:
    """int64 ``[R, BQ]``: the sequence position of each row of the query blocks ``query_blocks`` (int ``[R]``), block
    by block (a partial last block's positions run past N; callers clamp or mask them)."""
    return query_blocks.to(device, torch.int64).view(-1, 1) * block_q + torch.arange(block_q, device=device)


def sequence_lengths(seq_lens: Tensor | None, batch: int, seq_len: int, device) -> Tensor:
    """int64 ``[B]``: ``seq_lens`` clamped to [0, N], or N for every row without it."""
    if seq_lens is None:
        return torch.full((batch,), seq_len, device=device, dtype=torch.int64)
    return seq_lens.to(device=device, dtype=torch.int64).clamp(0, seq_len)


def reference_index_block_scores(
    u: Tensor,
    w: Tensor,
    *,
    block_q: int,
    block_k: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """Index block scores by PyTorch ops, chunked over query blocks; differentiable in u and w.

    Args:
        u: index queries ``[B, H, M, E, S]`` (float16, bfloat16, float32 or float64): row m is position m
            (M = N), or with ``query_blocks`` position ``query_blocks[m // block_q] * block_q + m % block_q``
            (M = R * block_q; positions >= N are padding).
        w: index keys ``[B, H, N, S]``, u's dtype and device.
        block_q, block_k: block sizes, each in (16, 32, 64, 128).
        seq_lens: optional int ``[B]``, values in [0, N]: rows and keys at positions >= seq_lens[b] take no part
            (u and w may hold anything there, NaN included).
        document_ids: optional int ``[B, N]``, non-decreasing per row: a key counts for a row of its own document.
        query_blocks: optional int ``[R]``, global query-block ids in any order.

    Returns:
        float32 ``[B, H, R, NKB]`` (R = NQB without ``query_blocks``), -inf for pairs without a valid (row, key);
        float64 for float64 inputs. Products are summed in float32 (float64 for float64 inputs).

    Raises:
        ValueError: as :func:`check_index_score_args`.
    """
    args = check_index_score_args(u, w, block_q, block_k, seq_lens, document_ids, query_blocks)
    B, H, M, E, S, N = args.B, args.H, args.M, args.E, args.S, args.N
    nkb = args.num_k_blocks
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    device = u.device
    blocks = (
        torch.arange(args.num_q_blocks, device=device)
        if query_blocks is None
        else query_blocks.to(device=device, dtype=torch.int64)
    )
    lengths = sequence_lengths(seq_lens, B, N, device)
    key_pos = torch.arange(N, device=device)
    key_ok = key_pos.view(1, N) < lengths.view(B, 1)  # [B, N]
    # padding may hold NaN: select zeros there (not multiply) so that neither the values nor the gradients see it
    keys = torch.where(key_ok.view(B, 1, N, 1), w, 0).to(compute)
    docs = None if document_ids is None else document_ids.to(torch.int64)
    per_block = B * H * block_q * E * nkb * block_k * (8 if compute == torch.float64 else 4)
    step = max(1, min(args.rows, REFERENCE_CHUNK_BYTES // max(1, per_block)))
    offsets = torch.arange(block_q, device=device)
    parts = []
    for start in range(0, args.rows, step):
        chunk = blocks[start : start + step]  # [C] global query blocks
        C = chunk.numel()
        pos = chunk.view(C, 1) * block_q + offsets  # [C, BQ] positions
        local = pos if query_blocks is None else (start + torch.arange(C, device=device)).view(C, 1) * block_q + offsets
        row_ok = pos.view(1, C, block_q) < lengths.view(B, 1, 1)  # [B, C, BQ]
        rows = u.index_select(2, local.clamp(max=M - 1).reshape(-1)).view(B, H, C, block_q, E, S)
        rows = torch.where(row_ok.view(B, 1, C, block_q, 1, 1), rows, 0).to(compute)
        logits = torch.einsum("bhcres,bhns->bhcren", rows, keys)  # [B, H, C, BQ, E, N]
        valid = (key_pos.view(1, 1, N) <= pos.view(1, C * block_q, 1)) & key_ok.view(B, 1, N)
        valid = valid.view(B, C, block_q, N) & row_ok.view(B, C, block_q, 1)
        if docs is not None:
            row_doc = docs.gather(1, pos.clamp(max=N - 1).view(1, -1).expand(B, -1)).view(B, C, block_q, 1)
            valid = valid & (docs.view(B, 1, 1, N) == row_doc)
        logits = logits.masked_fill(~valid.view(B, 1, C, block_q, 1, N), float("-inf"))
        if nkb * block_k > N:
            logits = torch.nn.functional.pad(logits, (0, nkb * block_k - N), value=float("-inf"))
        logits = logits.view(B, H, C, block_q * E, nkb, block_k)
        parts.append(logits.amax(dim=(3, 5)))
    scores = torch.cat(parts, dim=2) if parts else keys.new_empty((B, H, 0, nkb))
    return scores if compute == torch.float64 else scores.to(torch.float32)
