"""Context parallelism: one sequence sharded over the ranks of a process group, with the exact semantics
of the single-process op (the attention on the PyTorch reference or the Triton kernels).

Layout (zig-zag). With world size W the global sequence of length N is cut into 2W equal chunks of
C = N / (2W) tokens; rank r holds chunks r and 2W-1-r, concatenated in that order. Under the causal
mask the work of a query grows with its position, so pairing an early chunk with a late one gives every
rank the same causal area, ``N (N + 1) / (2W)`` query-key pairs (:func:`causal_area`). C must be a multiple of
the query and key block sizes, so every local block is a whole global block: the global
:class:`~sparse_train.index.block_index.BlockIndex` applies to the local query blocks unchanged, and pooled key blocks
of the selector gather into global block order.

Attention (:func:`context_parallel_sparse_attention`): every rank holds q, k, v of its local rows. K and V
are all-gathered (functional collectives: autograd and torch.compile see them; the backward of the
all-gather is a reduce-scatter, which *is* the dK/dV reduction), put back in global order, and the
local query rows attend to them under the rows of the global index that belong to the local query
blocks, with causal, length and document masks and the dropout counters at GLOBAL positions. So outputs
and gradients equal those of the single-process op on the same global tensors, dropout bits included.
The global index, ``seq_lens`` and ``document_ids`` are the same (global) tensors on every rank; they are
small (``[B, HKV, NQB, K]`` int32, ``[B]``, ``[B, N]``).

Selector (:func:`context_parallel_block_scores`, :func:`context_parallel_selection`): each rank pools its
own q and k blocks (un-rotating RoPE at the global positions of its rows), all-gathers the pooled keys
(``[B, HKV, NKB, D]`` float32, tiny), scores its local query blocks against every key block, picks its
local rows' candidates, and all-gathers the candidates so every rank builds the same global index. The token
selector (:class:`~sparse_train.selection.indexer.TokenIndexer`) un-rotates its local q and k rows at their global
positions and all-gathers the un-rotated keys (``[B, HKV, N, D]``, detached); each rank projects every key to its
index key itself (so the index keys' gradients stay on the rank, and the backward runs no collective for them) and
scores its local rows' index queries against all of them. The oracle selector is refused (it scores dense attention
of the whole sequence on one process).

Communication per rank and layer: the all-gather of K and V receives ``2 * B * HKV * N * D * bytes *
(W-1)/W`` in the forward, and the backward reduce-scatters the same volume of dK/dV; the pooled keys and
the candidates add ``B * HKV * (NKB * P * D * 4 + NQB * k * 8) * (W-1)/W`` bytes (float32 keys, P = 2 for
``mean_max`` pooling; int64 candidates). The token selector gathers un-rotated keys instead of pooled ones:
``B * HKV * N * D`` elements of the indexer's input dtype (k's for half precision and float64, float32 for
float32) times ``(W-1)/W``, half the volume of the K/V all-gather; its token-level distillation
(``selector_distill="token"``) gathers K once more (detached), and divides by a count every rank computes alike
(no all-reduce). ``docs/context_parallel.md`` has the numbers.

The attention is :func:`sparse_train.sparse_attention` with ``query_blocks``, the local-query-block ->
global-query-block map, on either backend: the reference, or the Triton kernels, which address
the rows of q by local block and positions by global block.

Training: :func:`enable_context_parallel` switches ``SparseAttention`` (its ``layout`` becomes a
:class:`ContextParallelLayout`) and the repository's ``Transformer`` to take their inputs as zig-zag shards
(every path, distillation and checkpoint replay included); :func:`context_parallel_dense_attention` is the exact dense
path; the Lightning callback is
:class:`sparse_train.lightning.context_parallel.ContextParallel`. ``docs/context_parallel.md``, "Training with CP".

What the caller must keep identical on every rank (not checked: that would need a collective per call):
the index, ``seq_lens``, ``document_ids``, ``scale``, ``dropout_p`` and ``dropout_seed``
(:func:`shared_dropout_seed` draws one on rank 0 and broadcasts it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..documents import document_positions
from ..functional import BACKENDS, choose_backend, sparse_attention
from ..index.block_index import BlockIndex, check_block_index
from ..module.attention import SparseAttention
from ..module.layout import SequenceLayout
from ..options import check_no_plan_with_query_blocks
from ..selection.indexer import OracleSelector, TokenIndexer
from ..selection.scorer import BlockScorer, SelectionGeometry, selection_candidates
from ..validation import check_document_ids, check_dropout, check_int, check_qkv, check_scale, check_seq_lens

__all__ = [
    "CP_BACKENDS",
    "ContextParallelLayout",
    "all_reduce_sum",
    "causal_area",
    "check_layout",
    "context_parallel_block_scores",
    "context_parallel_dense_attention",
    "context_parallel_rank",
    "context_parallel_selection",
    "context_parallel_sparse_attention",
    "disable_context_parallel",
    "enable_context_parallel",
    "gather_sequence",
    "local_query_blocks",
    "shard_sequence",
    "shared_dropout_seed",
    "zigzag_positions",
]

CP_BACKENDS = ("auto", "triton", "reference")
"""Backends of :func:`context_parallel_sparse_attention`, as :data:`sparse_train.functional.BACKENDS`."""


def _functional_all_gather(autograd: bool):
    """torch's functional all-gather along dim 0 (with or without autograd). Newer torch names it
    ``all_gather_single[_autograd]`` and deprecates the ``_tensor`` names, which older versions (the GPU
    machine's) only have."""
    from torch.distributed import _functional_collectives as fc

    if autograd:
        return getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return getattr(fc, "all_gather_single", None) or fc.all_gather_tensor


# ------------------------------------------------------------------------------------------- layout
def check_layout(seq_len, world, block_q: int = 1, block_k: int = 1) -> int:
    """The chunk length ``C = N / (2W)`` of the zig-zag layout, after checking that ``N`` splits into
    ``2W`` chunks that are whole query blocks and whole key blocks.

    Raises:
        ValueError: N, W or a block size not a positive int, or ``N % (2 * W * lcm(BQ, BK)) != 0``."""
    seq_len = check_int("seq_len", seq_len, minimum=1)
    world = check_int("world size", world, minimum=1)
    block_q = check_int("block_q", block_q, minimum=1)
    block_k = check_int("block_k", block_k, minimum=1)
    unit = 2 * world * math.lcm(block_q, block_k)
    if seq_len % unit:
        raise ValueError(
            f"context parallelism splits the sequence into 2 * world = {2 * world} chunks of whole blocks: "
            f"N={seq_len} must be a multiple of 2 * W * lcm(block_q, block_k) = 2 * {world} * "
            f"{math.lcm(block_q, block_k)} = {unit} (W={world}, block_q={block_q}, block_k={block_k}); "
            "pad the sequence (and pass seq_lens)"
        )
    return seq_len // (2 * world)


def _check_rank(rank, world) -> tuple[int, int]:
    world = check_int("world size", world, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    if rank >= world:
        raise ValueError(f"rank must lie in [0, world={world}), got {rank}")
    return rank, world


def zigzag_positions(seq_len: int, rank: int, world: int, device=None) -> Tensor:
    """int64 ``[N / W]``: the global positions of rank ``rank``'s local rows, chunk ``rank`` then chunk
    ``2W - 1 - rank`` of the ``2W`` chunks of ``N / (2W)`` tokens. Raises ValueError unless ``N % 2W == 0``
    and ``0 <= rank < world``."""
    rank, world = _check_rank(rank, world)
    chunk = check_layout(seq_len, world)
    offsets = torch.arange(chunk, device=device)
    return torch.cat([rank * chunk + offsets, (2 * world - 1 - rank) * chunk + offsets])


def local_query_blocks(seq_len: int, block_q: int, rank: int, world: int, device=None) -> Tensor:
    """int64 ``[N / (W * BQ)]``: the global query-block ids of the local rows, in local order (the map
    the attention takes). Raises ValueError unless ``N % (2 * W * BQ) == 0``."""
    rank, world = _check_rank(rank, world)
    chunk_blocks = check_layout(seq_len, world, block_q) // block_q
    offsets = torch.arange(chunk_blocks, device=device)
    return torch.cat([rank * chunk_blocks + offsets, (2 * world - 1 - rank) * chunk_blocks + offsets])


def causal_area(seq_len: int, rank: int, world: int) -> int:
    """Causally valid (query, key) pairs ``q >= k`` of rank ``rank``'s query rows: the attention work
    of a dense causal rank, the same for every rank under the zig-zag layout (``N (N + 1) / (2W)``)."""
    positions = zigzag_positions(seq_len, rank, world)
    return int((positions + 1).sum())


def shard_sequence(x: Tensor, dim: int, rank: int, world: int) -> Tensor:
    """The local rows of a global tensor: along ``dim`` (length N), chunk ``rank`` then chunk
    ``2W - 1 - rank`` of ``2W`` chunks. Differentiable (two slices and a concatenation)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, world = _check_rank(rank, world)
    if x.dim() == 0:
        raise ValueError("x must have the sequence dimension, got a 0-d tensor")
    dim = dim % x.dim()
    chunk = check_layout(x.shape[dim], world)
    return torch.cat(
        [x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * world - 1 - rank) * chunk, chunk)], dim=dim
    )


def _group_info(group) -> tuple[object, int, int]:
    """(group, world size, rank); ``None`` is the default group. ValueError before any collective when
    torch.distributed is not initialised or this process is not in the group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "context parallelism needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group), got none"
        )
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return group, dist.get_world_size(group), rank


def _global_order(world: int, device) -> Tensor:
    """int64 ``[2W]``: for global chunk c, its position among the gathered chunks (rank-major, each rank's
    two chunks in local order)."""
    chunks = torch.arange(2 * world, device=device)
    return torch.where(chunks < world, 2 * chunks, 2 * (2 * world - 1 - chunks) + 1)


def gather_sequence(x_local: Tensor, dim: int, group=None) -> Tensor:
    """All-gather the local rows of every rank along ``dim`` and put them back in global order (the
    inverse of :func:`shard_sequence`): ``[..., N / W, ...] -> [..., N, ...]``.

    A functional collective, autograd-aware when ``x_local`` requires grad: the backward reduce-scatters
    (sums) the gradient of the global tensor back to the ranks' local rows. Every rank must call it with
    the same shape."""
    group, world, _ = _group_info(group)
    if not isinstance(x_local, Tensor) or x_local.dim() == 0:
        raise ValueError(
            "x_local must be a tensor with a sequence dimension, got "
            f"{getattr(x_local, 'shape', type(x_local).__name__)}"
        )
    dim = dim % x_local.dim()
    local = x_local.shape[dim]
    if local % 2:
        raise ValueError(f"x_local holds two chunks along dim {dim}, so its length must be even, got {local}")
    # the functional all-gather concatenates along dim 0 only
    moved = x_local.movedim(dim, 0).contiguous()
    gathered = _functional_all_gather(moved.requires_grad)(moved, 0, group)
    chunk = local // 2
    pieces = gathered.reshape(2 * world, chunk, *moved.shape[1:])
    ordered = pieces.index_select(0, _global_order(world, moved.device))
    return ordered.reshape(world * local, *moved.shape[1:]).movedim(0, dim)


def shared_dropout_seed(
    group=None, generator: torch.Generator | None = None, draw: Callable[[], int] | None = None
) -> int:
    """A dropout seed in ``[0, 2**63)`` drawn on the group's rank 0 and broadcast, so every rank drops the same
    elements: ``draw()`` when given (called on every rank, so that each rank's draw state advances alike; rank 0's
    value is used), else from ``generator`` or torch's global RNG. One small blocking collective (a host read):
    draw it once per step, not per layer, and derive per-layer seeds from it."""
    group, _, rank = _group_info(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    seed = torch.zeros(1, dtype=torch.int64)
    if draw is not None:
        seed = torch.tensor([draw()], dtype=torch.int64)
    elif rank == 0:
        seed = torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator)
    seed = seed.to(device)
    dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    return int(seed.item())


# ------------------------------------------------------------------------------------------- attention
def context_parallel_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: BlockIndex,
    *,
    group=None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    backend: str = "reference",
    return_lse: bool = False,
    deterministic: bool = False,
    kernel_options: dict | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse attention of this rank's query rows over the whole (context-parallel) sequence.

    Args:
        q: ``[B, HQ, N/W, D]``, k, v: ``[B, HKV, N/W, D]``: this rank's rows in the zig-zag layout
            (:func:`shard_sequence`), HQ a multiple of HKV.
        index: the GLOBAL canonical :class:`BlockIndex` for (B, HKV, N), the same on every rank.
        group: the context-parallel process group (``None``: the default group); W its size.
        scale, dropout_p: as :func:`sparse_train.sparse_attention`, the same on every rank.
        dropout_seed: required when ``dropout_p > 0`` and the same on every rank
            (:func:`shared_dropout_seed`); the keep bit of element (b, h, q, k) uses global positions,
            so it equals the single-process bit.
        seq_lens: optional int ``[B]``, GLOBAL lengths (keys at global positions >= seq_lens[b] masked).
        document_ids: optional int ``[B, N]``, the GLOBAL document ids of packed rows.
        backend: ``"reference"`` (default), ``"triton"`` (the kernels with the query-block map; raises on
            input they do not support) or ``"auto"`` (Triton on supported CUDA input, else the reference),
            as :func:`sparse_train.sparse_attention`.
        deterministic: bitwise-reproducible kernel gradients (Triton; the dK/dV reduce-scatter adds the
            ranks' partials in a fixed order on gloo/NCCL rings, see their documentation).
        kernel_options: the Triton performance options of :func:`sparse_train.sparse_attention`, less
            ``plan`` (each call builds the plan of its local index rows).
        return_lse: also return lse ``[B, HQ, N/W]`` (natural log, fp32; fp64 for fp64 inputs).

    Returns:
        o ``[B, HQ, N/W, D]`` in q's dtype, this rank's rows of the single-process output (and lse).

    Cost: the all-gather of K and V (each rank receives ``2 * B * HKV * N * D`` elements, minus its own),
    the same volume reduce-scattered in the backward, and the attention of N/W query rows; the gathered
    K and V (``2 * B * HKV * N * D``) are held for the backward.

    Raises:
        ValueError: torch.distributed not initialised or this process outside ``group``; N not a
            multiple of ``2 * W * lcm(BQ, BK)``; local q/k/v not of length N/W, or mismatched with the
            index (batch, KV heads, device, dtype); bad seq_lens, document_ids, scale, dropout_p or
            dropout_seed; dropout without a seed; an unknown backend, ``"triton"`` on input the kernels do
            not support, bad kernel_options. Everything is checked locally before the first collective,
            so a bad argument raises instead of hanging.
    """
    if backend not in CP_BACKENDS:
        raise ValueError(f"backend must be one of {CP_BACKENDS}, got {backend!r}")
    group, world, rank = _group_info(group)
    check_block_index(index)
    seq_len = index.seq_len
    check_layout(seq_len, world, index.block_q, index.block_k)
    batch, _, _, local, head_dim = check_qkv(q, k, v, device=index.device)
    scale = check_scale(scale, head_dim)
    if local * world != seq_len:
        raise ValueError(
            f"the global index is for N={seq_len}, so with W={world} ranks q/k/v must hold "
            f"N/W={seq_len // world} local rows, got {local}"
        )
    if batch != index.batch or k.shape[1] != index.num_kv_heads:
        raise ValueError(
            f"block index is for batch={index.batch}, kv_heads={index.num_kv_heads} but k has "
            f"batch={batch}, kv_heads={k.shape[1]}"
        )
    check_seq_lens(seq_lens, batch, seq_len, q.device)
    check_document_ids(document_ids, batch, seq_len, q.device)
    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError(
            "dropout_p > 0 under context parallelism needs a dropout_seed, the same on every rank "
            "(shared_dropout_seed(group) draws one)"
        )

    # backend support and the kernel options, before the first collective
    choose_backend(q, index.block_q, index.block_k, backend)
    check_no_plan_with_query_blocks(kernel_options)

    k_full = gather_sequence(k, 2, group)
    v_full = gather_sequence(v, 2, group)
    blocks = local_query_blocks(seq_len, index.block_q, rank, world, device=q.device)
    # the values of seq_lens and document_ids were checked above, and the local blocks are whole and in
    # range by construction: check_values=False spares the attention their host reads
    o, lse = sparse_attention(
        q,
        k_full,
        v_full,
        index,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        seq_lens=seq_lens,
        document_ids=document_ids,
        query_blocks=blocks,
        backend=backend,
        deterministic=deterministic,
        kernel_options=kernel_options,
        return_lse=True,
        check_values=False,
    )
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------------------- selector
def _local_valid_lengths(seq_lens: Tensor, seq_len: int, rank: int, world: int) -> Tensor:
    """Valid local rows per batch row for global lengths ``seq_lens``. The valid global positions are a
    prefix, and the second local chunk lies after the first, so the valid local rows are a prefix too:
    the first chunk's valid part, then the second's (non-empty only when the first is full)."""
    chunk = seq_len // (2 * world)
    lens = seq_lens.to(torch.int64)
    first = (lens - rank * chunk).clamp(0, chunk)
    second = (lens - (2 * world - 1 - rank) * chunk).clamp(0, chunk)
    return first + second


def context_parallel_block_scores(
    scorer: BlockScorer | TokenIndexer,
    q: Tensor,
    k: Tensor,
    *,
    block_q: int,
    block_k: int,
    scale: float,
    group=None,
    seq_lens: Tensor | None = None,
    position_ids: Tensor | None = None,
    document_ids: Tensor | None = None,
    geometry: SelectionGeometry | None = None,
) -> Tensor:
    """The selector's block logits of this rank's query blocks against every key block.

    Pooled selector (:class:`BlockScorer`): pools the local q and k blocks (:meth:`BlockScorer.pool`; RoPE
    un-rotated at the GLOBAL positions of the local rows), all-gathers the pooled keys into global block order, and
    scores the local query blocks (:meth:`BlockScorer.forward`; the distance bias of the local rows is added when
    ``geometry`` is given). Token selector (:class:`~sparse_train.selection.indexer.TokenIndexer`): un-rotates the
    local q and k at the GLOBAL positions of the local rows (:meth:`TokenIndexer.pool` with the local query blocks),
    all-gathers the un-rotated keys (``[B, HKV, N, D]``, detached: each rank projects every key to its index key
    itself, so the index keys' gradients stay local and no collective runs in the backward), and scores the local
    rows' index queries against every index key (:meth:`TokenIndexer.forward` with ``query_blocks``; exact scores, or
    the candidates' with ``candidates``). Either way the scores equal the rows :func:`local_query_blocks` of the
    single-process scores. The oracle selector is refused (it scores dense attention over the whole sequence).

    Args:
        scorer: the layer's :class:`BlockScorer` or :class:`~sparse_train.selection.indexer.TokenIndexer` (the same
            parameters on every rank).
        q: ``[B, HQ, N/W, D]``, k: ``[B, HKV, N/W, D]``: local rows, zig-zag layout.
        block_q, block_k, scale: as the single-process selection.
        seq_lens: optional int ``[B]`` GLOBAL lengths.
        position_ids: optional GLOBAL RoPE positions ``[N]`` or ``[B, N]``; default ``0..N-1``, or the
            per-document positions when ``document_ids`` is given and the scorer un-rotates (as
            :class:`~sparse_train.module.attention.SparseAttention` does).
        document_ids: optional int ``[B, N]`` GLOBAL document ids (the default positions; the token selector's
            document mask).
        geometry: the :func:`~sparse_train.selection.scorer.selection_geometry` of the global call (required by the
            token selector).

    Returns:
        float32 ``[B, HKV, N/(W*BQ), NKB]``, with gradients to the scorer's parameters only.

    Communication: the pooled selector all-gathers the pooled keys, ``B * HKV * (N/BK) * P * D`` float32 (P = 2 for
    ``mean_max``); the token selector the un-rotated keys, ``B * HKV * N * D`` elements of the indexer's input dtype
    (k's for half precision and float64, float32 for float32); each rank receives ``(W-1)/W`` of them.

    Raises:
        ValueError: a scorer other than these two (the oracle selector included), the token selector without
            ``geometry``, and the argument errors, before any collective.
    """
    group, world, rank = _group_info(group)
    if isinstance(scorer, OracleSelector):
        raise ValueError(
            "context parallelism does not support the oracle selector (selector='oracle'): it scores the dense "
            "attention of the whole sequence on one process; use selector='pooled' or 'token'"
        )
    if not isinstance(scorer, (BlockScorer, TokenIndexer)):
        raise ValueError(
            "context parallelism supports the pooled and token selectors (a BlockScorer or TokenIndexer), got a "
            f"{type(scorer).__name__}"
        )
    if isinstance(scorer, TokenIndexer) and geometry is None:
        raise ValueError("the token selector (TokenIndexer) needs geometry, the selection geometry of the global call")
    _, _, _, local, _ = check_qkv(q, k, k)
    seq_len = local * world
    check_layout(seq_len, world, block_q, block_k)
    check_seq_lens(seq_lens, q.shape[0], seq_len, q.device)
    check_document_ids(document_ids, q.shape[0], seq_len, q.device)
    if geometry is not None and (geometry.seq_len, geometry.block_q, geometry.block_k) != (seq_len, block_q, block_k):
        raise ValueError(
            f"geometry is for (N, BQ, BK) = {(geometry.seq_len, geometry.block_q, geometry.block_k)}, "
            f"the call for {(seq_len, block_q, block_k)}"
        )
    if position_ids is None and document_ids is not None and scorer.rope_inv_freq.numel():
        position_ids = document_positions(document_ids)
    if position_ids is None:
        positions = zigzag_positions(seq_len, rank, world, device=q.device)
    else:
        if not isinstance(position_ids, Tensor) or position_ids.shape not in ((seq_len,), (q.shape[0], seq_len)):
            raise ValueError(
                f"position_ids must be the GLOBAL positions [N] or [B, N] with N={seq_len}, got "
                f"{getattr(position_ids, 'shape', type(position_ids).__name__)}"
            )
        positions = shard_sequence(position_ids, -1, rank, world)
    valid = None if seq_lens is None else _local_valid_lengths(seq_lens, seq_len, rank, world)
    rows = local_query_blocks(seq_len, block_q, rank, world, device=q.device)

    qbar, kbar = scorer.pool(q, k, block_q, block_k, valid, positions, query_blocks=rows)
    kbar = gather_sequence(kbar, 2, group)
    if isinstance(scorer, TokenIndexer):
        return scorer(qbar, kbar, scale, geometry, rows, seq_lens=seq_lens, document_ids=document_ids)
    return scorer(qbar, kbar, scale, geometry, query_blocks=rows)


def context_parallel_selection(
    scores: Tensor,
    geometry: SelectionGeometry,
    *,
    window: int,
    sinks: int,
    group=None,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    top_p: float | None = None,
    capacity: int | None = None,
    check: str = "cheap",
) -> BlockIndex:
    """The GLOBAL :class:`BlockIndex`, built on every rank from every rank's local selection.

    Each rank picks the candidates of its own query blocks from its local ``scores`` (the output of
    :func:`context_parallel_block_scores`) with :func:`~sparse_train.selection.scorer.selection_candidates`,
    the candidates (``[B, HKV, N/(W*BQ), k]`` int64, small) are all-gathered into global block order, and
    :meth:`BlockIndex.from_selection` makes them canonical with the window and sinks, the same on every
    rank and equal to the single-process index.

    The local rows are picked with ``selection_candidates(..., query_blocks=)``: only the boolean mask of
    allowed blocks is built for all query blocks (``[NQB, NKB]``, or ``[B, NQB, NKB]`` with documents).

    Args:
        scores: float ``[B, HKV, N/(W*BQ), NKB]``, this rank's query blocks.
        geometry: :func:`~sparse_train.selection.scorer.selection_geometry` of the global call.
        window, sinks, top_p: as :func:`~sparse_train.selection.scorer.selection_candidates`.
        seq_lens, document_ids: GLOBAL, as there.
        capacity: index capacity (default ``geometry.capacity``, or ``geometry.document_capacity`` with
            documents, as :class:`~sparse_train.module.attention.SparseAttention` uses); check: as
            :meth:`BlockIndex.from_selection`.
    """
    group, world, rank = _group_info(group)
    if not isinstance(geometry, SelectionGeometry):
        raise ValueError(f"geometry must be a SelectionGeometry, got {type(geometry).__name__}")
    seq_len = geometry.seq_len
    check_layout(seq_len, world, geometry.block_q, geometry.block_k)
    local_blocks = geometry.num_q_blocks // world
    if (
        not isinstance(scores, Tensor)
        or scores.dim() != 4
        or tuple(scores.shape[2:]) != (local_blocks, geometry.num_k_blocks)
    ):
        raise ValueError(
            f"scores must be [B, HKV, NQB/W={local_blocks}, NKB={geometry.num_k_blocks}], got "
            f"{getattr(scores, 'shape', type(scores).__name__)}"
        )
    check_seq_lens(seq_lens, scores.shape[0], seq_len, scores.device)
    check_document_ids(document_ids, scores.shape[0], seq_len, scores.device)
    rows = local_query_blocks(seq_len, geometry.block_q, rank, world, device=scores.device)
    picked = selection_candidates(
        scores,
        geometry,
        window=window,
        sinks=sinks,
        seq_lens=seq_lens,
        document_ids=document_ids,
        top_p=top_p,
        query_blocks=rows,
    )
    candidates = gather_sequence(picked, 2, group)
    if capacity is None:
        capacity = geometry.capacity if document_ids is None else geometry.document_capacity
    return BlockIndex.from_selection(
        candidates,
        seq_len=seq_len,
        block_q=geometry.block_q,
        block_k=geometry.block_k,
        window=window,
        sinks=sinks,
        capacity=capacity,
        check=check,
        document_ids=document_ids,
    )


# ------------------------------------------------------------------------------------------- training helpers
def context_parallel_rank(group=None) -> tuple[int, int]:
    """``(rank, world)`` of this process in the context-parallel ``group`` (``None``: the default group).
    Raises ValueError when torch.distributed is not initialised or this process is outside ``group``."""
    _, world, rank = _group_info(group)
    return rank, world


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """The sum of ``x`` over the ranks of ``group`` (a functional collective without autograd: for counts
    and other values that carry no gradient). Every rank must call it with the same shape and dtype."""
    from torch.distributed import _functional_collectives as fc

    group, _, _ = _group_info(group)
    return fc.wait_tensor(fc.all_reduce(x.detach(), "sum", group))


def context_parallel_dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_q: int,
    block_k: int,
    group=None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    backend: str = "reference",
    return_lse: bool = False,
    check: str = "cheap",
) -> Tensor | tuple[Tensor, Tensor]:
    """Dense causal attention of this rank's query rows (zig-zag layout) over the whole sequence: the
    context-parallel attention over the full causal index (``BlockIndex.full``; with ``document_ids`` every
    causal block that shares a document), so every mask, dropout bit and gradient is that of the dense
    single-process attention on the global tensors (with dropout: of the sparse kernels' counter-based bits,
    the bits the module's dense path with dropout uses too).

    Args:
        q: ``[B, HQ, N/W, D]``, k, v: ``[B, HKV, N/W, D]``: local rows (:func:`shard_sequence`).
        block_q, block_k: the block sizes of the full index (N must be a multiple of ``2 * W * lcm``).
        check: value check of ``document_ids`` when the index is built (``"cheap"`` or ``"none"``).
        Others: as :func:`context_parallel_sparse_attention`.

    Cost: the all-gather of K and V of :func:`context_parallel_sparse_attention` and dense causal work of
    ``N (N + 1) / (2W)`` query-key pairs per rank; the full index holds ``B * HKV * NQB * NKB`` int32."""
    _, world, _ = _group_info(group)
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [B, HQ, N/W, D], got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(k, Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a 4-D tensor [B, HKV, N/W, D], got {getattr(k, 'shape', type(k).__name__)}")
    seq_len = q.shape[2] * world
    check_layout(seq_len, world, block_q, block_k)
    index = BlockIndex.full(
        q.shape[0], k.shape[1], seq_len, block_q, block_k, device=q.device, document_ids=document_ids, check=check
    )
    return context_parallel_sparse_attention(
        q,
        k,
        v,
        index,
        group=group,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        seq_lens=seq_lens,
        document_ids=document_ids,
        backend=backend,
        return_lse=return_lse,
    )


def enable_context_parallel(model: torch.nn.Module, group=None, *, backend: str | None = None) -> int:
    """Turn context parallelism on in every module of ``model`` that supports it: each
    :class:`~sparse_train.module.attention.SparseAttention` gets a :class:`ContextParallelLayout` (its
    ``layout``), each other module with a ``context_parallel_group`` attribute (the repository's
    :class:`~sparse_train.lightning.model.Transformer` and its dense attention) that group. From then on each
    call treats its inputs as this rank's zig-zag shard of the sequence (:func:`shard_sequence`) and the
    sequence-level arguments (``seq_lens``, ``document_ids``, ``position_ids``) as GLOBAL.

    Args:
        model: any module; every submodule that supports context parallelism is switched.
        group: the context-parallel process group (``None``: the default group), the same on the ranks
            that hold one sequence.
        backend: the attention backend passed to :func:`context_parallel_sparse_attention`; ``None`` =
            each module's own (``SparseAttention``: its ``config.backend``).

    Returns:
        The number of modules switched (at least 1).

    Raises:
        ValueError: ``model`` not a module; a module with the oracle selector (``selector="oracle"``: it scores the
            dense attention of the whole sequence on one process; ``"pooled"`` and ``"token"`` are supported);
            torch.distributed not initialised or this process outside ``group``; ``backend`` not None or one of
            :data:`~sparse_train.functional.BACKENDS`; no module of ``model`` supports context
            parallelism (a Hugging Face model needs ``hf.enable`` first; it then runs on each rank's shard with
            global ``position_ids``: :func:`sparse_train.integrations.hf.context_parallel_inputs`)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend is not None and not any(isinstance(backend, str) and backend == name for name in BACKENDS):
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    for module in model.modules():
        scorer = getattr(module, "scorer", None)
        if isinstance(module, SparseAttention) and not isinstance(scorer, (BlockScorer, TokenIndexer)):
            raise ValueError(
                "context parallelism supports the pooled and token selectors (SparseAttentionConfig.selector="
                f"'pooled' or 'token'), not the oracle selector, which scores the dense attention of the whole "
                f"sequence on one process; {type(model).__name__} has a {type(scorer).__name__}"
            )
    group, _, _ = _group_info(group)
    switched = 0
    for module in model.modules():
        if isinstance(module, SparseAttention):
            module.layout = ContextParallelLayout(group, backend)
            switched += 1
        elif hasattr(module, "context_parallel_group"):
            module.context_parallel_group = group
            module.context_parallel_backend = backend
            switched += 1
    if not switched:
        raise ValueError(
            f"{type(model).__name__} has no module that supports context parallelism "
            "(SparseAttention, sparse_train.lightning.model.Transformer)"
        )
    return switched


def disable_context_parallel(model: torch.nn.Module) -> None:
    """Undo :func:`enable_context_parallel`: every module computes the whole sequence again."""
    for module in model.modules():
        if isinstance(module, SparseAttention):
            module.layout = SequenceLayout()
        elif hasattr(module, "context_parallel_group"):
            module.context_parallel_group = None
            module.context_parallel_backend = None


# ------------------------------------------------------------------------------------------- the module's strategy
class ContextParallelLayout(SequenceLayout):
    """The layout of a :class:`~sparse_train.module.attention.SparseAttention` under context parallelism: this
    rank holds one zig-zag shard ``[B, H, N/W, D]`` of q, k and v, while ``seq_lens``, ``document_ids`` and
    ``position_ids`` are GLOBAL (``[B]``, ``[B, N]``, ``[N]`` or ``[B, N]``). Set by
    :func:`enable_context_parallel`.

    Every rank takes the same path (a function of N and of the call count, the same on every rank), builds the
    same global index (its local query blocks' candidates, all-gathered) and attends its own rows over the
    all-gathered keys (:func:`context_parallel_sparse_attention`); the dense paths attend the full causal
    index the same way. Outputs and input gradients are the rows of the single-process call; the
    distillation loss is this rank's share (the ranks' losses and their selector gradients sum to the
    single-process ones, see :meth:`distillation_loss`). Selectors: pooled and token (its keys: the un-rotated keys
    all-gathered by :meth:`gather`; its token-level KL: the rows of the sampled blocks held here against the
    all-gathered K, over the count of every sampled row, so the shares sum to the single-process loss too).

    Args:
        group: the context-parallel process group (``None``: the default group).
        backend: the attention backend (``None``: the module's ``config.backend``)."""

    splits_sequence = True

    def __init__(self, group=None, backend: str | None = None) -> None:
        self.group = group
        self.backend_name = backend

    def check_inputs(
        self,
        module,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_lens: Tensor | None,
        document_ids: Tensor | None,
        position_ids: Tensor | None,
    ) -> int:
        if module.config.metrics_every > 0:
            raise ValueError(
                "SparseAttention under context parallelism: metrics_every > 0 is not supported (the "
                "recall metrics need every query row on one rank); set metrics_every=0"
            )
        _, world = context_parallel_rank(self.group)
        module._check_inputs(q, k, v, None)
        batch, _, local_len, _ = q.shape
        seq_len = local_len * world
        check_layout(seq_len, world, module.config.block_q, module.config.block_k)
        check_values = module._checks_values(q.device)
        check_seq_lens(seq_lens, batch, seq_len, q.device, values=check_values)
        check_document_ids(document_ids, batch, seq_len, q.device, values=check_values)
        if position_ids is not None and (
            not isinstance(position_ids, Tensor) or tuple(position_ids.shape) not in ((seq_len,), (batch, seq_len))
        ):
            raise ValueError(
                f"position_ids under context parallelism must be the GLOBAL positions [B, N] = "
                f"[{batch}, {seq_len}] or [N], got "
                f"{getattr(position_ids, 'shape', type(position_ids).__name__)}"
            )
        return seq_len

    def pooling_rows(
        self, seq_len: int, seq_lens: Tensor | None, position_ids: Tensor | None, device
    ) -> tuple[Tensor | None, Tensor | None]:
        rank, world = context_parallel_rank(self.group)
        if position_ids is None:
            positions = zigzag_positions(seq_len, rank, world, device=device)
        else:
            positions = shard_sequence(position_ids, -1, rank, world)
        valid = None if seq_lens is None else _local_valid_lengths(seq_lens, seq_len, rank, world)
        return valid, positions

    def query_blocks(self, seq_len: int, block_q: int, device) -> Tensor:
        rank, world = context_parallel_rank(self.group)
        return local_query_blocks(seq_len, block_q, rank, world, device=device)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        return gather_sequence(x, dim, self.group)

    def dropout_seed(self, draw) -> int:
        return shared_dropout_seed(self.group, draw=draw)

    def backend(
        self, module, q: Tensor, k: Tensor, v: Tensor, index: BlockIndex, document_ids: Tensor | None
    ) -> tuple[str, str]:
        return self.backend_name or module.config.backend, "requested"

    def plan(self, index: BlockIndex, r0: int | None):
        return None  # each call plans its local index rows (context_parallel_sparse_attention)

    def attention(
        self,
        module,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        index: BlockIndex,
        *,
        selected: bool,
        plan,
        backend: str,
        scale: float,
        dropout_p: float,
        dropout_seed: int | None,
        seq_lens: Tensor | None,
        document_ids: Tensor | None,
        check_values: bool,
    ) -> tuple[Tensor, Tensor]:
        common = dict(
            group=self.group,
            scale=scale,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
            seq_lens=seq_lens,
            document_ids=document_ids,
            backend=backend,
            return_lse=True,
        )
        if selected:
            return context_parallel_sparse_attention(
                q,
                k,
                v,
                index,
                deterministic=module.config.deterministic,
                kernel_options=module._kernel_options(),
                **common,
            )
        return context_parallel_sparse_attention(q, k, v, index, **common)  # the full index of the dense path

    def distillation_loss(
        self,
        module,
        q: Tensor,
        k: Tensor,
        scores: Tensor,
        index: BlockIndex | None,
        lse: Tensor | None,
        seq_lens: Tensor | None,
        scale: float,
        geometry,
        mode: str,
        distill_blocks: Tensor | None,
        document_ids: Tensor | None,
        check_values: bool,
        target=None,
        row_scores=None,
    ) -> tuple[Tensor, tuple]:
        """This rank's share of the distillation loss, and its target (``target``: the first forward's, which a
        checkpoint recompute reuses instead of gathering and computing it again).

        The target of a query block is computed where its query rows live, against the all-gathered keys
        (detached, at global positions); ``scores`` holds this rank's query blocks. ``"dense"``: every
        local query block. ``"sampled"``: the sampled blocks are GLOBAL ids drawn identically on every rank
        (one sample of the whole sequence, as one process draws it); each rank supervises those of them it
        holds. The loss is the sum of the KL over this rank's valid rows divided by the number of valid rows
        of ALL ranks (one all-reduce of a count), so the ranks' losses, and their gradients to the
        selector, sum to the single-process loss and gradient. ``row_scores`` (the token selector's sampled
        blocks, scored apart): the scores of every sampled block with gradients, those of other ranks' blocks on
        zero placeholder rows (masked out here), in place of rows of ``scores``.

        Cost: one more all-gather of K (detached); the block-mass functions take the global q (and lse),
        so the local rows are placed in a zero ``[B, HQ, N, D]`` buffer (transient, no grad). The
        ``dense`` / ``sampled`` targets read only the listed blocks' rows; the ``sparse`` target walks an
        index whose rows of other ranks are emptied."""
        rank, world = context_parallel_rank(self.group)
        seq_len = geometry.seq_len
        device = q.device
        local_blocks = local_query_blocks(seq_len, module.config.block_q, rank, world, device=device)
        positions = zigzag_positions(seq_len, rank, world, device=device)
        if target is None:
            with torch.no_grad():
                k_full = gather_sequence(k.detach(), 2, self.group)
                q_full = q.new_zeros(q.shape[0], q.shape[1], seq_len, q.shape[3]).index_copy_(2, positions, q.detach())
        support = module._distill_support(geometry, device, document_ids)
        if mode in ("dense", "sampled"):
            if mode == "dense":
                rows, picks, held = local_blocks, None, None
            else:
                rows = distill_blocks.to(device)
                # local row of each sampled block (-1: another rank holds it); shapes stay fixed, so no
                # host read: the blocks of other ranks are computed on placeholder rows and masked out
                where = torch.full((geometry.num_q_blocks,), -1, dtype=torch.int64, device=device)
                where[local_blocks] = torch.arange(local_blocks.shape[0], device=device)
                picks = where[rows]
                held = picks >= 0
                picks = picks.clamp(min=0)
            if target is None:
                target = module._dense_target(
                    q_full, k_full, rows, scale, seq_lens, document_ids, check_values
                )  # [B, HKV, S, NKB] twice
            target, row_valid = target
            if held is not None:
                row_valid = row_valid & held.view(1, 1, -1)
                # the token selector scores the sampled blocks apart (row_scores: every sampled block, those of
                # other ranks on zero placeholder rows), the others pick them from this rank's scores
                scores = scores.index_select(2, picks) if row_scores is None else row_scores(rows)
            allowed = support.index_select(2, rows)
        else:
            if target is None:
                lse_full = lse.new_zeros(lse.shape[0], lse.shape[1], seq_len).index_copy_(2, positions, lse.detach())
                mine = torch.zeros(geometry.num_q_blocks, dtype=torch.bool, device=device)
                mine[local_blocks] = True
                mine = mine.view(1, 1, -1)
                own_rows = BlockIndex(
                    indices=torch.where(mine.unsqueeze(-1), index.indices, -1),
                    counts=torch.where(mine, index.counts, 0),
                    seq_len=seq_len,
                    block_q=index.block_q,
                    block_k=index.block_k,
                )
                full_target, full_valid = module._sparse_target(
                    q_full, k_full, own_rows, lse_full, scale, seq_lens, document_ids, check_values
                )  # [B, HKV, NQB, K]
                target = full_target.index_select(2, local_blocks), full_valid.index_select(2, local_blocks)
            target, row_valid = target
            scores, allowed = module._slot_scores(
                scores, index.indices.index_select(2, local_blocks), support.index_select(2, local_blocks)
            )
        total, count = module._kl_parts(target, scores, allowed, row_valid)
        return module._mean_kl(total, all_reduce_sum(count, self.group)), (target, row_valid)
