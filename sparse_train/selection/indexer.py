"""Token-level block scores: the ``"token"`` selector (a learned indexer) and the ``"oracle"`` selector.

Token indexer, per KV head h with G query heads (the GQA group), E index heads and index dim S:

    u[r, e] = sum_g q'[h G + g, r] Wq[h, g, :, e]     (index queries, [E, S] per query row r)
    w[t]    = k'[h, t] Wk[h]                          (index key, [S] per key t)
    s[i, j] = exp(t_h) * scale * max over rows r of query block i, index heads e and keys t of key
              block j with t <= r (valid, same document) of  u[r, e] . w[t]   +   beta[h, bucket(d_ij)]

q', k' are the layer's q and k with RoPE undone (``set_rope``), so the scores compare content. A block
pair's score is decided by its single best (row, key) pair: the one key a question row needs ranks its
block high even when the other rows and keys of both blocks are unrelated, which block-pooled summaries
(:class:`~sparse_train.selection.scorer.BlockScorer`) average away. The max runs in one kernel over tiles
(:func:`~sparse_train.kernels.triton.index_scores.index_block_scores`) without an N x N tensor; its gradient reaches
the winning pair's index vectors, hence ``Wq`` and ``Wk``. With ``candidates`` (C), only the C dynamic key blocks of
each query block with the largest upper bound of their score are scored exactly, the others score
``EMPTY_BLOCK_SCORE`` (:mod:`~sparse_train.selection.candidates`); a sequence shorter than ``candidates_min_len``
tokens scores every pair exactly.

Initialisation: with E = G, index head e starts as query head e projected by a shared random projection
P ~ N(0, 1/S) and ``Wk = P``, so from step 0 the score approximates the largest raw logit
``max q_g[r] . k[t]`` of the pair (the parameter-free token-level score); with E < G, index head e starts from
the mean of the group heads g with g mod E = e. Parameters are stored divided by ``lr_multiplier`` (as the
pooled scorer: the selector learns that many times faster under one Adam-type optimizer).

Context parallelism (:mod:`sparse_train.parallel.context_parallel`): a rank pools its shard with ``query_blocks`` (the
global ids of its query blocks), so its queries address their rows by global block (:func:`held_rows`), scores them
against the un-rotated keys of the whole sequence (all-gathered by the caller), and
``token_distillation_loss(q_blocks=)`` sums the KL over the sampled rows it holds.

Oracle: :class:`OracleSelector` ranks key blocks by the dense attention mass the layer actually computes,
the maximum over the query block's rows and GQA heads (the distillation target,
:func:`~sparse_train.selection.distill.dense_block_mass`). Nothing to train; it computes dense attention
scores, O(N^2 D), chunked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import SparseAttentionConfig
from ..kernels import triton_kernels
from ..kernels.reference.index_queries import index_input, index_input_dtype, project_index_queries
from ..kernels.reference.index_scores import listed_positions, reference_index_block_scores
from ..kernels.reference.token_kl import reference_token_kl, token_kl_rows
from ..plan.device import triton_runs_on
from ..validation import check_choice, check_float, check_int
from .candidates import candidate_block_scores
from .distill import dense_block_mass
from .scorer import (
    DISTANCE_BUCKETS,
    EMPTY_BLOCK_SCORE,
    BlockScorer,
    SelectionGeometry,
    add_distance_bias,
    checked_rope,
    rescale_to_multiplier,
)

__all__ = ["IndexQueries", "TokenIndexer", "OracleSelector", "build_selector", "held_rows", "index_scores"]

UNROTATE_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes the indexer un-rotates and projects with the Triton kernels (``kernels/triton/unrotate.py``,
``kernels/triton/index_queries.py``) on CUDA, eager or compiled (custom ops); the others (float64) take the PyTorch
references."""
_PROJECTION_SEED = 20261203
"""Seed of the initial random projection (the same in every layer; layers differ by their q and k)."""


def _kernels_take(x: Tensor) -> bool:
    """Whether the indexer's input kernels run on ``x``: CUDA (eager, or compiled through their custom ops), a kernel
    dtype."""
    return x.dtype in UNROTATE_KERNEL_DTYPES and triton_runs_on(x)


def _token_kl_kernel_takes(u: Tensor, w: Tensor, k: Tensor, block_q: int) -> bool:
    """Whether the token-level distillation runs the streaming kernels (``kernels/triton/token_kl.py``): CUDA (eager,
    or compiled through their custom ops), and the kernels' dtypes and limits
    (:func:`~sparse_train.kernels.triton.token_kl.kernels_take`)."""
    return triton_runs_on(k) and triton_kernels().token_kl.kernels_take(u, w, k, block_q)


def held_rows(query_blocks: Tensor, held_blocks: Tensor, block_q: int) -> tuple[Tensor, Tensor]:
    """Where the rows of the query blocks ``query_blocks`` (int ``[R]``, global ids) sit in a shard of the sequence
    that holds the query blocks ``held_blocks`` (int ``[L]``, distinct global ids, its rows block by block: a
    context-parallel rank's). Returns int64 ``[R * BQ]``, the shard's row of each listed row block by block (row 0
    for a block the shard does not hold, a placeholder), and bool ``[R * BQ]``, whether the shard holds the row's
    block. Shapes depend on R and L only: no host read."""
    device = held_blocks.device
    listed = query_blocks.to(device, torch.int64).view(-1, 1)
    match = listed == held_blocks.to(torch.int64).view(1, -1)  # [R, L], at most one True per row
    local = (match.to(torch.int64) * torch.arange(match.shape[1], device=device)).sum(dim=-1)
    rows = listed_positions(local, block_q, device).view(-1)
    return rows, match.any(dim=-1).repeat_interleave(block_q)


@dataclass(frozen=True, eq=False)
class IndexQueries:
    """:meth:`TokenIndexer.pool`'s queries: the layer's q ``[B, HQ, N, D]`` (detached, RoPE still applied) with what
    undoes RoPE and which rows are valid. The selection's index queries take no gradient, so the indexer projects q
    in one kernel pass (``kernels/triton/index_queries.py``: the un-rotated q is never written); its gradients read
    the un-rotated rows, which :meth:`unrotated` and :meth:`rows` build.

    Fields: ``q``; ``inv_freq`` ``[R / 2]`` or None (nothing to undo); ``positions`` ``[N]`` / ``[B, N]`` or None
    (``0..N-1``); ``seq_lens`` int ``[B]`` or None (rows at or past it are read as 0: NaN padding stays out);
    ``style`` the RoPE convention; ``blocks`` int ``[L]`` or None: the global query blocks whose rows ``q`` holds,
    block by block (a context-parallel rank's shard; ``positions``, then required, and ``seq_lens`` describe those rows:
    their global RoPE positions and the count of valid rows, a prefix), None: ``q`` is the whole sequence."""

    q: Tensor
    inv_freq: Tensor | None
    positions: Tensor | None
    seq_lens: Tensor | None
    style: str
    blocks: Tensor | None = None

    def __post_init__(self) -> None:
        if self.blocks is not None and self.positions is None:
            raise ValueError("IndexQueries of a shard (blocks) need the GLOBAL positions of its rows (positions)")

    def unrotated(self) -> Tensor:
        """q with RoPE undone and the padded rows zero, ``[B, HQ, N, D]`` in the indexer's input dtype
        (:func:`~sparse_train.kernels.reference.index_queries.index_input`; one Triton pass on CUDA)."""
        if self.inv_freq is not None and _kernels_take(self.q):
            return triton_kernels().unrotate.triton_unrotate(
                self.q, self.inv_freq, self.positions, self.style, valid_len=self.seq_lens
            )
        return index_input(self.q, self.inv_freq, self.positions, self.style, self.seq_lens)

    def rows(self, query_blocks: Tensor, block_q: int) -> Tensor:
        """:meth:`unrotated`'s rows of ``query_blocks`` (int ``[R]``, global ids) block by block,
        ``[B, HQ, R * block_q, D]``, un-rotating only those rows (a partial last block repeats row N - 1). Of a shard
        (``blocks``), the rows of a listed block it does not hold are 0 (:func:`held_rows`: placeholders whose
        scores the caller masks out)."""
        device = self.q.device
        held = None
        if self.blocks is None:
            picked = listed_positions(query_blocks, block_q, device).view(-1).clamp(max=self.q.shape[2] - 1)
        else:
            picked, held = held_rows(query_blocks, self.blocks, block_q)
            held = held.view(1, 1, -1, 1)
        x = self.q.index_select(2, picked)  # [B, HQ, R * BQ, D]
        keep = held
        if self.seq_lens is not None:
            valid = picked.view(1, 1, -1, 1) < self.seq_lens.to(device).view(-1, 1, 1, 1)
            keep = valid if keep is None else keep & valid
        if keep is not None:
            x = torch.where(keep, x, 0.0)
        if self.inv_freq is None:
            return x.to(index_input_dtype(x.dtype))
        positions = picked if self.positions is None else self.positions.to(device).index_select(-1, picked)
        return index_input(x, self.inv_freq, positions, self.style)


def index_scores(u: Tensor, w: Tensor, **kwargs) -> Tensor:
    """The token-level block scores of :func:`~sparse_train.kernels.triton.index_scores.index_block_scores` (one
    Triton kernel; a custom op under torch.compile) where the Triton kernels run (CUDA), its PyTorch reference
    otherwise (CPU); arguments and returns as theirs."""
    if triton_runs_on(u):
        return triton_kernels().index_scores.index_block_scores(u, w, **kwargs)
    return reference_index_block_scores(u, w, **kwargs)


class TokenIndexer(nn.Module):
    """Learned token-level index projections of q and k -> block scores (see module docstring).

    Args:
        num_heads: HQ. num_kv_heads: HKV. head_dim: D.
        index_dim: S, the width of index queries and keys. index_heads: E, index queries per row.
        lr_multiplier: the selector's learning-rate multiplier (a buffer in the state dict; a state dict saved with
            another one loads rescaled to this one, :func:`~sparse_train.selection.scorer.rescale_to_multiplier`).
        distance_bias: add a learned bias per KV head and log2 bucket of block distance.
        rope_style: the RoPE convention :meth:`set_rope` undoes.
        candidates: ``None`` scores every block pair exactly; C scores exactly only the C dynamic key blocks of
            each query block with the largest upper bound (``SparseAttentionConfig.selector_candidates``), the
            others ``EMPTY_BLOCK_SCORE``. ``window`` and ``sinks`` (the layer's) say which blocks are not dynamic.
        candidates_min_len: sequences shorter than this many tokens score every pair exactly, candidates or not
            (``SparseAttentionConfig.resolved_selector_candidates_min_len``).

    Parameters: ``query_proj`` ``[HKV, G * D, E * S]``, ``key_proj`` ``[HKV, D, S]``, ``log_temperature``
    ``[HKV]`` and ``distance_bias`` ``[HKV, DISTANCE_BUCKETS]`` (optional), all stored divided by
    ``lr_multiplier``.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        index_dim: int,
        index_heads: int = 1,
        lr_multiplier: float = 1.0,
        distance_bias: bool = False,
        rope_style: str = "rotate_half",
        candidates: int | None = None,
        window: int = 0,
        sinks: int = 0,
        candidates_min_len: int = 0,
    ) -> None:
        super().__init__()
        lr_multiplier = check_float("lr_multiplier", lr_multiplier, exclusive_minimum=0.0)
        self.candidates = check_int("candidates", candidates, minimum=1, optional=True)
        self.candidates_min_len = check_int("candidates_min_len", candidates_min_len, minimum=0)
        self.window = check_int("window", window, minimum=0)
        self.sinks = check_int("sinks", sinks, minimum=0)
        for name, value in (("index_dim", index_dim), ("index_heads", index_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.index_dim = index_dim
        self.index_heads = index_heads
        self.group = num_heads // num_kv_heads
        check_choice("rope_style", rope_style, ("rotate_half", "interleaved"))
        self.rope_style = rope_style
        self.register_buffer("lr_multiplier", torch.tensor(float(lr_multiplier)))
        self.query_proj = nn.Parameter(torch.empty(num_kv_heads, self.group * head_dim, index_heads * index_dim))
        self.key_proj = nn.Parameter(torch.empty(num_kv_heads, head_dim, index_dim))
        self.log_temperature = nn.Parameter(torch.zeros(num_kv_heads))
        self.distance_bias = nn.Parameter(torch.zeros(num_kv_heads, DISTANCE_BUCKETS)) if distance_bias else None
        # Not persistent: the frequencies are a property of the model the indexer sits in, set again by whoever
        # builds it (config.selector_rope_theta, the Hugging Face integration).
        self.register_buffer("rope_inv_freq", torch.zeros(0), persistent=False)
        self.reset_parameters()

    def set_rope(self, inv_freq: Tensor | None, style: str | None = None) -> None:
        """Un-rotate q and k by these RoPE frequencies (``[R/2]``, over the first R channels) before indexing;
        ``None`` indexes the rotated q and k as given. ``style``: the RoPE convention (``"rotate_half"`` or
        ``"interleaved"``); ``None`` keeps the indexer's."""
        self.rope_inv_freq, self.rope_style = checked_rope(
            inv_freq, style, self.rope_style, self.head_dim, self.query_proj.device
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # saved with another lr_multiplier: rescaled to this indexer's, the effective weights kept exactly
        rescale_to_multiplier(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Index head e = the mean of group heads g = e (mod E), projected by a shared JL projection P, and the
        index key = the key projected by P: the initial score approximates the pair's largest raw logit."""
        # A private generator: building a selector must not advance the global RNG (a sparse model gets the
        # weights of its dense twin built from the same seed).
        generator = torch.Generator().manual_seed(_PROJECTION_SEED)
        dim, size = self.head_dim, self.index_dim
        projection = torch.randn(self.num_kv_heads, dim, size, generator=generator) / math.sqrt(size)
        projection = projection.to(self.query_proj.device) / float(self.lr_multiplier)
        heads = self.index_heads
        query = torch.zeros(self.num_kv_heads, self.group, dim, heads, size, device=self.query_proj.device)
        for g in range(self.group):
            members = len(range(g % heads, self.group, heads))
            query[:, g, :, g % heads, :] = projection / members
        self.query_proj.copy_(query.reshape(self.query_proj.shape))
        self.key_proj.copy_(projection)
        self.log_temperature.zero_()
        if self.distance_bias is not None:
            self.distance_bias.zero_()

    def pool(
        self,
        q: Tensor,
        k: Tensor,
        block_q: int,
        block_k: int,
        seq_lens: Tensor | None = None,
        positions: Tensor | None = None,
        query_blocks: Tensor | None = None,
    ) -> tuple[IndexQueries, Tensor]:
        """The indexer's detached inputs: the queries as :class:`IndexQueries` (projected later, in one pass with
        their un-rotation) and k ``[B, HKV, N, D]`` with RoPE undone (when set; on CUDA by one Triton kernel) and the
        rows past ``seq_lens`` zero, in the indexer's input dtype (k's; float32 for float32 and below). Blocks are not
        pooled: the name is the selectors' common call. ``positions``: the RoPE positions (``[N]`` or ``[B, N]``;
        default 0..N-1).

        ``query_blocks`` (int ``[L]``, global ids; context parallelism): q and k hold only the rows of these query
        blocks, block by block (a rank's shard); ``seq_lens`` is then the count of valid rows here (a prefix) and
        ``positions`` the rows' GLOBAL positions (default: those of the listed blocks). The queries remember the
        blocks (:attr:`IndexQueries.blocks`), so the scores and :meth:`query_rows` address them by global id."""
        if query_blocks is not None:
            if not isinstance(query_blocks, Tensor) or query_blocks.dim() != 1 or query_blocks.is_floating_point():
                raise ValueError(
                    f"query_blocks must be a 1-D integer tensor, got {getattr(query_blocks, 'shape', query_blocks)!r}"
                )
            if query_blocks.numel() * block_q != q.shape[2]:
                raise ValueError(
                    f"query_blocks lists {query_blocks.numel()} blocks of {block_q} rows, but q holds {q.shape[2]} rows"
                )
            if positions is None:
                positions = listed_positions(query_blocks, block_q, q.device).view(-1)
        inv_freq = self.rope_inv_freq if self.rope_inv_freq.numel() else None
        queries = IndexQueries(q.detach(), inv_freq, positions, seq_lens, self.rope_style, query_blocks)
        k = k.detach()
        if inv_freq is not None and _kernels_take(k):
            # one pass: the un-rotation, the zeroed rows and the cast in one kernel
            unrotated = triton_kernels().unrotate.triton_unrotate(
                k, inv_freq, positions, self.rope_style, valid_len=seq_lens
            )
            return queries, unrotated
        return queries, index_input(k, inv_freq, positions, self.rope_style, seq_lens)

    @staticmethod
    def query_rows(q: IndexQueries | Tensor, query_blocks: Tensor, block_q: int) -> Tensor:
        """The un-rotated rows of ``query_blocks`` (int ``[R]``) of :meth:`pool`'s queries (or of an already
        un-rotated q ``[B, HQ, N, D]``), block by block: ``[B, HQ, R * block_q, D]`` (the positions past N of a
        partial last block repeat row N - 1; the scores ignore them), the layout :meth:`forward` takes with
        ``query_blocks``."""
        if isinstance(q, IndexQueries):
            return q.rows(query_blocks, block_q)
        positions = listed_positions(query_blocks, block_q, q.device).view(-1)
        return q.index_select(2, positions.clamp(max=q.shape[2] - 1))

    def forward(
        self,
        q: IndexQueries | Tensor,
        k: Tensor,
        scale: float,
        geometry: SelectionGeometry | None = None,
        query_blocks: Tensor | None = None,
        *,
        seq_lens: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Block scores float32 ``[B, HKV, R, NKB]`` from :meth:`pool`'s outputs; gradients reach only this
        module's parameters. ``geometry`` (of the call) is required: it gives the block sizes and the distance
        buckets. ``query_blocks`` (int ``[R]``, global ids): score only these query blocks; a tensor ``q`` then holds
        only their rows, ``[B, HQ, R * BQ, D]`` block by block (:meth:`query_rows`; a partial last block padded);
        default: every query block. ``q``: :meth:`pool`'s :class:`IndexQueries`, or already un-rotated rows. Queries
        of a shard (``pool(query_blocks=)``, context parallelism) need ``query_blocks``: given the very tensor they
        were pooled with they are scored as they stand, any other list through :meth:`IndexQueries.rows`. ``k``: the
        keys of the whole sequence. ``seq_lens`` (int ``[B]``) and ``document_ids`` (int ``[B, N]``), of the whole
        sequence, mask (row, key) pairs as the attention does. Pairs with no valid (row, key) score
        ``EMPTY_BLOCK_SCORE``."""
        if geometry is None:
            raise ValueError("TokenIndexer needs the selection geometry of the call")
        if isinstance(q, IndexQueries):
            if q.blocks is not None and query_blocks is None:
                raise ValueError(
                    "TokenIndexer: the queries hold the rows of some query blocks only (pool(query_blocks=), a "
                    "context-parallel shard); pass the query_blocks to score"
                )
            # queries pooled for exactly these blocks (the same tensor) are scored as they stand
            if query_blocks is not None and query_blocks is not q.blocks:
                q = q.rows(query_blocks, geometry.block_q)
        shape = tuple((q.q if isinstance(q, IndexQueries) else q).shape)
        _, heads, _, dim = shape
        if heads != self.num_heads or k.shape[1] != self.num_kv_heads or dim != self.head_dim:
            raise ValueError(
                f"TokenIndexer expects q [B, {self.num_heads}, M, {self.head_dim}] and k "
                f"[B, {self.num_kv_heads}, N, {self.head_dim}], got {shape} and {tuple(k.shape)}"
            )
        multiplier = self.lr_multiplier.to(torch.float32)
        with torch.autocast(k.device.type, enabled=False):
            u, w = self._index_vectors(q, k)
            blocks = dict(block_q=geometry.block_q, block_k=geometry.block_k)
            masks = dict(seq_lens=seq_lens, document_ids=document_ids, query_blocks=query_blocks)
            exact = (
                self.candidates is None
                or self.candidates >= geometry.num_k_blocks
                or geometry.seq_len < self.candidates_min_len
            )
            if exact:
                raw = index_scores(u, w, **blocks, **masks)  # [B, HKV, R, NKB]
            else:  # the exact scores of each row's best-bounded dynamic blocks, -inf elsewhere
                raw, _ = candidate_block_scores(
                    u, w, geometry, self.candidates, window=self.window, sinks=self.sinks, **masks
                )
            # an empty pair (-inf) takes no part in the products (its gradient would be NaN) and scores
            # EMPTY_BLOCK_SCORE: finite for the KL and the top-k, below every real score
            filled = torch.isfinite(raw)
            scores = torch.where(filled, raw.float(), 0.0) * self._temperature(scale).view(1, -1, 1, 1)
            if self.distance_bias is not None:
                scores = add_distance_bias(
                    scores, self.distance_bias.to(torch.float32) * multiplier, geometry, query_blocks
                )
            return torch.where(filled, scores, EMPTY_BLOCK_SCORE)

    def _index_vectors(self, q: IndexQueries | Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Index queries ``u [B, HKV, M, E, S]`` of q (:class:`IndexQueries` or un-rotated rows ``[B, HQ, M, D]``) and
        index keys ``w [B, HKV, N, S]`` of k, in the inputs' dtype."""
        return self._index_queries(q), self._index_keys(k)

    def _index_queries(self, q: IndexQueries | Tensor) -> Tensor:
        weight = self.query_proj.to(torch.float32) * self.lr_multiplier.to(torch.float32)  # [HKV, G * D, E * S]
        if isinstance(q, IndexQueries):
            if not (torch.is_grad_enabled() and self.query_proj.requires_grad) and _kernels_take(q.q):
                # no gradient to carry: un-rotation and projection in one pass over q
                u = triton_kernels().index_queries.triton_index_queries(
                    q.q, weight, q.inv_freq, q.positions, q.style, valid_len=q.seq_lens
                )
            else:
                u = project_index_queries(q.unrotated(), weight)
        else:
            u = project_index_queries(q, weight)
        batch, _, rows, _ = u.shape
        return u.reshape(batch, self.num_kv_heads, rows, self.index_heads, self.index_dim)

    def _index_keys(self, k: Tensor) -> Tensor:
        wk = (self.key_proj.to(torch.float32) * self.lr_multiplier.to(torch.float32)).to(k.dtype)
        return torch.einsum("bhnd,hds->bhns", k, wk)

    def _temperature(self, scale: float) -> Tensor:
        """float32 ``[HKV]``: the learned temperature times the logit scale."""
        return torch.exp(self.log_temperature.to(torch.float32) * self.lr_multiplier.to(torch.float32)) * scale

    def token_distillation_loss(
        self,
        q_index_rows: Tensor,
        k_index: Tensor,
        q: Tensor,
        k: Tensor,
        query_blocks: Tensor,
        scale: float,
        block_q: int,
        *,
        seq_lens: Tensor | None = None,
        document_ids: Tensor | None = None,
        stats: object | None = None,
        q_blocks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, object | None]:
        """Token-level distillation (``selector_distill="token"``) on the rows of ``query_blocks``: per row r, the KL
        from the row's dense attention over keys (softmax of ``scale q_g[r] . k[t]`` over the causal, valid,
        same-document keys, max over the GQA heads g, renormalised) to the softmax over the same keys of the index
        logits ``temperature * max_e u[r, e] . w[t]``
        (:func:`~sparse_train.kernels.reference.token_kl.reference_token_kl`). Returns the KL summed over the valid
        rows and their count (float32 scalars, float64 for float64 inputs), and the forward statistics of the
        streaming kernels (``kernels/triton/token_kl.py``, CUDA, eager or compiled; None on the PyTorch path): a
        recompute of the same call (activation checkpointing) passes them back as ``stats`` and skips the kernels'
        forward. Gradients reach only this module's parameters.

        ``q_index_rows``: :meth:`pool`'s queries at the rows of ``query_blocks`` (:meth:`query_rows`: ``[B, HQ, R * BQ,
        D]`` block by block); ``k_index``: :meth:`pool`'s keys; ``q`` ``[B, HQ, N, D]`` / ``k`` ``[B, HKV, N, D]``: the
        attention's own (detached here). Memory O(HQ BQ N) on the PyTorch path (one query block at a time), O(HQ R BQ)
        in the kernels.

        ``q_blocks`` (int ``[L]``, global ids; context parallelism): ``q`` holds only the rows of these query blocks,
        block by block (a rank's shard), while ``k_index`` and ``k`` are the whole sequence's. The KL is then summed
        over the rows of the listed blocks held here (the others are computed on zero placeholder rows and left
        out, :func:`held_rows`), and the count stays that of every listed block's valid rows: each listed block is
        held by exactly one rank, so the ranks' sums over this one count add up to the single-process mean, with no
        collective (the count depends only on the listed blocks, N and ``seq_lens``)."""
        batch = q.shape[0]
        seq_len = k.shape[2]
        blocks = query_blocks.to(q.device, torch.int64)
        held = None
        if q_blocks is None:
            positions = listed_positions(blocks, block_q, q.device).view(-1).clamp(max=seq_len - 1)
        else:
            positions, held = held_rows(blocks, q_blocks, block_q)
        q_rows = q.index_select(2, positions)  # [B, HQ, R * BQ, D]
        if held is not None:
            q_rows = torch.where(held.view(1, 1, -1, 1), q_rows, 0.0)
        with torch.autocast(q.device.type, enabled=False):
            u, w = self._index_queries(q_index_rows), self._index_keys(k_index)
            arguments = (u, w, q_rows, k, self._temperature(scale), blocks)
            masks = dict(block_q=block_q, scale=scale, seq_lens=seq_lens, document_ids=document_ids)
            if _token_kl_kernel_takes(u, w, k, block_q):
                kl, stats = triton_kernels().token_kl.token_kl(*arguments, **masks, stats=stats, with_stats=True)
            else:
                kl, stats = reference_token_kl(*arguments, **masks), None  # [B, HKV, R * BQ]
        if held is not None:
            kl = torch.where(held.view(1, 1, -1), kl, 0.0)
        total = kl.sum()
        count = token_kl_rows(blocks, block_q, seq_len, seq_lens, batch).sum().float() * self.num_kv_heads
        return total, count, stats


class OracleSelector(nn.Module):
    """Block scores from the true dense attention mass (see module docstring); no parameters.

    Args:
        num_heads, num_kv_heads, head_dim: the layer's shapes. chunk_mb: memory budget (MiB) of one chunk of
        float32 logits.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, chunk_mb: int = 1024) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.chunk_mb = chunk_mb
        self.rope_style = "rotate_half"
        self.register_buffer("rope_inv_freq", torch.zeros(0), persistent=False)

    def set_rope(self, inv_freq: Tensor | None, style: str | None = None) -> None:
        """Accepted for the selectors' common call; the oracle scores the attention's own (rotated) q and k."""
        self.rope_inv_freq, self.rope_style = checked_rope(
            inv_freq, style, self.rope_style, self.head_dim, self.rope_inv_freq.device
        )

    def pool(
        self,
        q: Tensor,
        k: Tensor,
        block_q: int,
        block_k: int,
        seq_lens: Tensor | None = None,
        positions: Tensor | None = None,
        query_blocks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The attention's q and k, detached (nothing is pooled or un-rotated; the other arguments are the
        selectors' common call)."""
        return q.detach(), k.detach()

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        scale: float,
        geometry: SelectionGeometry | None = None,
        query_blocks: Tensor | None = None,
        *,
        seq_lens: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """float32 ``[B, HKV, NQB, NKB]``: log of each key block's dense attention mass, max over the query
        block's rows and GQA heads, renormalised per query block; ``EMPTY_BLOCK_SCORE`` where the mass is 0."""
        if geometry is None:
            raise ValueError("OracleSelector needs the selection geometry of the call")
        if query_blocks is not None:
            raise ValueError("the oracle selector scores every query block of a full sequence (no query_blocks)")
        with torch.no_grad():
            mass, _ = dense_block_mass(
                q,
                k,
                block_q=geometry.block_q,
                block_k=geometry.block_k,
                scale=scale,
                seq_lens=seq_lens,
                row_pool="max",
                chunk_mb=self.chunk_mb,
                document_ids=document_ids,
            )
            return torch.log(mass.float()).clamp(min=EMPTY_BLOCK_SCORE)


def build_selector(config: SparseAttentionConfig, num_heads: int, num_kv_heads: int, head_dim: int) -> nn.Module:
    """The block scorer ``config.selector`` names: :class:`BlockScorer` (``"pooled"``), :class:`TokenIndexer`
    (``"token"``) or :class:`OracleSelector` (``"oracle"``). All three share the call
    ``scores = selector(*selector.pool(q, k, BQ, BK, seq_lens, positions, query_blocks), scale, geometry,
    query_blocks, seq_lens=..., document_ids=...)`` and ``set_rope(inv_freq, style)``."""
    if config.selector == "oracle":
        return OracleSelector(num_heads, num_kv_heads, head_dim, chunk_mb=config.distill_chunk_mb)
    if config.selector == "token":
        return TokenIndexer(
            num_heads,
            num_kv_heads,
            head_dim,
            config.selector_dim,
            config.selector_index_heads,
            lr_multiplier=config.selector_lr_multiplier,
            distance_bias=config.resolved_selector_distance_bias,
            rope_style=config.selector_rope_style,
            candidates=config.resolved_selector_candidates,
            candidates_min_len=config.resolved_selector_candidates_min_len,
            window=config.window,
            sinks=config.sinks,
        )
    return BlockScorer(
        num_heads,
        num_kv_heads,
        head_dim,
        config.selector_dim,
        lr_multiplier=config.selector_lr_multiplier,
        key_pooling=config.key_pooling,
        distance_bias=config.selector_distance_bias,
        query_pooling=config.query_pooling,
        rope_style=config.selector_rope_style,
    )
