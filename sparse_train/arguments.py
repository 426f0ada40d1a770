"""The checked arguments of one attention call, shared by ``sparse_attention``, the PyTorch reference and the
Triton op: :func:`check_attention_args` (q/k/v against the index, seq_lens, document ids, dropout, scale and the
kernel options) and the ``query_blocks`` argument of context parallelism (:func:`check_query_blocks`,
:func:`query_block_args`, and the row layout it implies: :func:`query_block_row0`,
:func:`query_block_positions`). The single-argument rules are :mod:`sparse_train.validation`'s."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .index.block_index import BlockIndex, check_block_index, check_inputs
from .options import KernelOptions, check_kernel_option_shapes, normalize_kernel_options
from .plan.plan import check_plan
from .validation import check_dropout, check_integer_tensor, check_scale

__all__ = [
    "AttentionArgs",
    "check_attention_args",
    "check_query_blocks",
    "global_query_stand_in",
    "query_block_args",
    "query_block_positions",
    "query_block_row0",
]


class AttentionArgs(NamedTuple):
    """Normalised arguments of an attention call."""

    scale: float
    dropout_p: float
    dropout_seed: int | None
    kernel_options: KernelOptions
    """A plan among them belongs to the index."""


def check_attention_args(
    q,
    k,
    v,
    index,
    *,
    scale=None,
    dropout_p=0.0,
    dropout_seed=None,
    seq_lens=None,
    kernel_options=None,
    seq_lens_values: bool = True,
    document_ids=None,
) -> AttentionArgs:
    """Every argument of `sparse_attention` that has a meaning for both backends. The backends call it
    with ``seq_lens_values=True`` (the host syncs of the seq_lens and document_ids values, see the module
    docstring); the dispatcher calls it before choosing a backend with ``False``. ``kernel_options`` are normalised by
    :func:`~sparse_train.options.normalize_kernel_options` and must fit the shapes
    (:func:`~sparse_train.options.check_kernel_option_shapes`); a plan among them must belong to ``index``."""
    head_dim = check_inputs(q, k, v, index, seq_lens, seq_lens_values=seq_lens_values, document_ids=document_ids)
    p, seed = check_dropout(dropout_p, dropout_seed)
    options = normalize_kernel_options(kernel_options)
    check_kernel_option_shapes(options, q.shape[1] // k.shape[1], index.block_q)
    if options.plan is not None:
        check_plan(options.plan, index, options.r0)
    return AttentionArgs(check_scale(scale, head_dim), p, seed, options)


def check_query_blocks(q, k, index: BlockIndex, query_blocks, *, check_values: bool = True) -> Tensor:
    """The one validation of a ``query_blocks`` argument (both backends of ``sparse_attention``): int
    ``[NQL]`` on q's device, ``1 <= NQL <= NQB``, distinct ids in ``[0, NQB)``, and q ``[B, HQ, L, D]`` with
    L the total length of the listed blocks (BQ each, the last block of the sequence possibly shorter).
    Returns the ids as int64.

    The range and distinctness checks read the ids back to the host (one sync); ``check_values=False``
    skips them when N is a multiple of BQ (every block then has BQ rows, so L is a shape check) and clamps
    the ids to ``[0, NQB)`` on the device instead, so an unchecked id can change which rows are computed
    but never make a kernel address memory outside q, the index or k/v. When N is not a multiple of BQ
    the ids are read anyway: L depends on whether the short last block is listed.

    Raises:
        ValueError: naming ``query_blocks`` or q: not a 1-D integer tensor, another device than q, empty,
            longer than NQB, ids out of range or repeated, q's length not that of the listed blocks."""
    check_block_index(index)
    if not isinstance(q, Tensor) or q.dim() != 4 or not isinstance(k, Tensor) or k.dim() != 4:
        raise ValueError("q and k must be 4-D tensors [B, H, L, D] and [B, HKV, N, D]")
    blocks = check_integer_tensor("query_blocks", query_blocks, dim=1)
    if blocks.device != q.device:
        raise ValueError(f"query_blocks is on {blocks.device} but q is on {q.device}")
    blocks = blocks.to(torch.int64)
    nqb, bq, n = index.num_q_blocks, index.block_q, index.seq_len
    if blocks.numel() == 0 or blocks.numel() > nqb:
        raise ValueError(
            f"query_blocks must list between 1 and NQB={nqb} distinct query-block ids, got {blocks.numel()}"
        )
    if not check_values and n % bq == 0:
        expected = blocks.numel() * bq
        blocks = blocks.clamp(0, nqb - 1)
    else:
        if bool(((blocks < 0) | (blocks >= nqb)).any()):
            raise ValueError(
                f"query_blocks must be a non-empty list of query-block ids in [0, NQB={nqb}), got "
                f"{blocks.tolist()[:16]}"
            )
        if torch.unique(blocks).numel() != blocks.numel():
            raise ValueError(f"query_blocks must be distinct, got {blocks.tolist()[:16]}")
        short = n % bq
        expected = blocks.numel() * bq - (bq - short if short and bool((blocks == nqb - 1).any()) else 0)
    if q.shape[2] != expected:
        raise ValueError(
            f"with query_blocks, q must hold the {expected} rows of the {blocks.numel()} listed "
            f"query blocks (BQ={bq}, N={n}), got q with {q.shape[2]} rows"
        )
    return blocks


def global_query_stand_in(q: Tensor, index: BlockIndex) -> Tensor:
    """A broadcast stand-in of the global q ``[B, HQ, N, D]`` (no memory), so the checks written for a full
    call (k, v, the index, seq_lens, document_ids are global) apply to a call with ``query_blocks``."""
    return q.new_zeros(()).expand(q.shape[0], q.shape[1], index.seq_len, q.shape[3])


def query_block_args(
    q: Tensor, k: Tensor, index: BlockIndex, query_blocks, check_values: bool = True
) -> tuple[Tensor | None, Tensor]:
    """``(blocks, q_global)`` of a call that may take ``query_blocks``: the checked ids
    (:func:`check_query_blocks`; None without them) and the q that the checks of a full call see (q
    itself, or its :func:`global_query_stand_in`)."""
    if query_blocks is None:
        return None, q
    blocks = check_query_blocks(q, k, index, query_blocks, check_values=check_values)
    return blocks, global_query_stand_in(q, index)  # k, v, index, seq_lens, document_ids are global


def query_block_row0(blocks: Tensor, index: BlockIndex) -> Tensor:
    """int64 ``[NQL]``: the first row in q of each listed block (exclusive prefix sum of their lengths, BQ
    or the short last block's). On the device, no host read."""
    lengths = (index.seq_len - blocks * index.block_q).clamp(0, index.block_q)
    return torch.cumsum(lengths, 0) - lengths


def query_block_positions(blocks: Tensor, index: BlockIndex, rows: int) -> Tensor:
    """int64 ``[rows]``: the global position of each of the ``rows`` rows of q under ``query_blocks`` (checked
    ids, :func:`check_query_blocks`). On the device, no host read."""
    row0 = query_block_row0(blocks, index)
    local = torch.arange(rows, device=blocks.device)
    block = torch.searchsorted(row0, local, right=True) - 1  # the listed block holding each row
    return blocks[block] * index.block_q + (local - row0[block])
