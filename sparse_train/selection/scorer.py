"""Learned, low-cost block scores and the top-k block selection.

For every (batch b, KV head h, query block i, key block j) the selector scores

    s[b, h, i, j] = exp(t_h) * scale * <qbar[b, h, i] W_q[h], kbar[b, h, j] W_k[h]> + beta[h, bucket(d_ij)]

where ``qbar`` is the mean of the queries of block i over its rows *and* over the G query heads of
the group (one selection per KV head, shared by the group; with ``query_pooling="mean_max"`` also the
element-wise max over the rows of the group's mean query), ``kbar`` the mean key of block j (and its max with
``key_pooling="mean_max"``),
``W_q[h], W_k[h]`` are ``[D, S]`` projections (S = ``selector_dim``), ``t_h`` a learned
log-temperature and ``beta[h]`` a learned bias per log2 bucket of the block distance ``d_ij`` (key
blocks between block j and the last key block query block i reaches; 0 for the diagonal block).
Cost: O(N D) for pooling plus O(NQB * NKB * S) for the scores, against the kernels' O(N * K * BK * D).

Initialisation: ``W_q = W_k = P`` with P ~ N(0, 1/S) (a Johnson-Lindenstrauss projection), so from
step 0 the score approximates the pooled logit ``scale * <qbar, kbar>``: a sensible selector before
any distillation. (Independent random projections would make the expected score 0.)

Selection: the window and sink blocks are always part of the index, so top-k picks the ``top_k``
best *other* causal blocks. Key blocks that hold no valid key (entirely past ``seq_lens``) get a
very low but finite score: they are picked only when nothing else is left, which keeps the number of
selected blocks per row a function of N alone (no device sync needed to know the density).

Packed documents (``document_ids``): candidates are restricted per batch row to key blocks that share
a document with the query block and are not already forced (window, per-document sinks), so nothing
is scored, picked or distilled across documents. Per-document sinks can make a row a few blocks
longer than without documents, so the index capacity is ``SelectionGeometry.document_capacity``.
Pooling stays per block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import KEY_POOLINGS, QUERY_POOLINGS
from ..functional import choose_backend
from ..index.block_index import capacity_tier, causal_last_block, document_sink_candidates, shares_document
from ..kernels import triton_kernels
from ..kernels.reference.index_scores import listed_positions
from ..kernels.reference.pool import ROPE_STYLES, block_max, block_mean, reference_block_pool, unrotate
from ..kernels.reference.scores import DISTANCE_BUCKETS, EMPTY_BLOCK_SCORE
from ..plan.device import triton_runs_eagerly_on, triton_runs_on
from ..validation import check_choice, check_float, check_integer_tensor

__all__ = [
    "SelectionGeometry",
    "selection_geometry",
    "BlockScorer",
    "rescale_to_multiplier",
    "block_pool",
    "block_mean",
    "block_max",
    "rope_inverse_frequencies",
    "unrotate",
    "block_distance_buckets",
    "DISTANCE_BUCKETS",
    "selection_candidates",
    "allowed_dynamic_blocks",
    "causal_block_mask",
    "reference_block_logits",
    "add_distance_bias",
    "checked_rope",
    "EMPTY_BLOCK_SCORE",
]

_PROJECTION_SEED = 20261130
"""Seed of the initial random projection (the same in every layer; layers differ by their q and k)."""


@dataclass(frozen=True)
class SelectionGeometry:
    """Everything about a selection that follows from (N, BQ, BK, top_k, window, sinks) alone."""

    seq_len: int
    block_q: int
    block_k: int
    num_q_blocks: int
    num_k_blocks: int
    dynamic_k: int
    """Columns requested from top-k: ``min(top_k, largest number of non-forced causal blocks)``."""
    capacity: int
    """K of the canonical index (power-of-two tier of the longest row, as ``BlockIndex`` uses)."""
    selected_blocks: int
    """Selected (query block, key block) pairs per (batch, KV head)."""
    causal_blocks: int
    """Causally reachable (query block, key block) pairs per (batch, KV head)."""
    is_full: bool
    """Every query block selects every causal block (the dense path computes the same function)."""
    document_capacity: int
    """K of the canonical index with packed documents: per-document sinks may add, besides the first
    ``sinks`` blocks of the query block's first document, sinks of documents that start inside the
    query block (among its own key blocks), so rows can be longer than without documents."""

    @property
    def block_density(self) -> float:
        """Selected fraction of the causal blocks; drives the dense/sparse hysteresis."""
        return self.selected_blocks / self.causal_blocks


@functools.lru_cache(maxsize=256)
def selection_geometry(
    seq_len: int, block_q: int, block_k: int, top_k: int, window: int, sinks: int
) -> SelectionGeometry:
    """Shape-level facts of the selection (cached; pure Python, no tensors, no device sync)."""
    num_q_blocks = math.ceil(seq_len / block_q)
    num_k_blocks = math.ceil(seq_len / block_k)
    selected = causal = longest = most_free = longest_documents = 0
    for i in range(num_q_blocks):
        last = (min((i + 1) * block_q, seq_len) - 1) // block_k
        reachable = last + 1
        window_lo = max(0, last - window + 1) if window > 0 else reachable
        sink_hi = min(sinks, reachable)
        # union of window [window_lo, last] and sinks [0, sink_hi)
        forced = (reachable - window_lo) + sink_hi - max(0, sink_hi - window_lo)
        row = min(reachable, forced + top_k)
        # documents: window and dynamic as before, the first document's sinks, and sinks among the
        # query block's own key blocks (those the window does not already hold)
        own_blocks = last - (i * block_q) // block_k + 1
        own_outside_window = max(0, own_blocks - window) if sinks > 0 else 0
        longest_documents = max(
            longest_documents, min(reachable, (reachable - window_lo) + sink_hi + own_outside_window + top_k)
        )
        selected += row
        causal += reachable
        longest = max(longest, row)
        most_free = max(most_free, reachable - forced)
    return SelectionGeometry(
        seq_len=seq_len,
        block_q=block_q,
        block_k=block_k,
        num_q_blocks=num_q_blocks,
        num_k_blocks=num_k_blocks,
        dynamic_k=min(top_k, most_free),
        capacity=capacity_tier(longest, num_k_blocks),
        selected_blocks=selected,
        causal_blocks=causal,
        is_full=selected == causal,
        document_capacity=capacity_tier(max(longest, longest_documents), num_k_blocks),
    )


def causal_block_mask(geometry: SelectionGeometry, device=None) -> Tensor:
    """bool ``[NQB, NKB]``: key block j is causally reachable from query block i."""
    last = causal_last_block(geometry.num_q_blocks, geometry.seq_len, geometry.block_q, geometry.block_k, device)
    j = torch.arange(geometry.num_k_blocks, device=device)
    return j.view(1, -1) <= last.view(-1, 1)


def allowed_dynamic_blocks(
    geometry: SelectionGeometry, window: int, sinks: int, device=None, document_ids: Tensor | None = None
) -> Tensor:
    """bool ``[NQB, NKB]``: causal blocks that neither the window nor the sinks already cover.

    With ``document_ids`` (int ``[B, N]``, non-decreasing; packed documents) a bool ``[B, NQB, NKB]``:
    besides, the key block shares a document with the query block (no score or target across
    documents) and is not one of the per-document sinks the index adds
    (:func:`~sparse_train.index.block_index.document_sink_candidates`)."""
    last = causal_last_block(geometry.num_q_blocks, geometry.seq_len, geometry.block_q, geometry.block_k, device).view(
        -1, 1
    )
    j = torch.arange(geometry.num_k_blocks, device=device).view(1, -1)
    causal = j <= last
    in_window = (j > last - window) if window > 0 else torch.zeros_like(causal)
    if document_ids is None:
        is_sink = j < sinks
        return causal & ~in_window & ~is_sink
    batch, nqb, nkb = document_ids.shape[0], geometry.num_q_blocks, geometry.num_k_blocks
    keys = j.expand(nqb, nkb).view(1, 1, nqb, nkb).expand(batch, 1, nqb, nkb)
    same = shares_document(document_ids, keys, block_q=geometry.block_q, block_k=geometry.block_k)[:, 0]
    allowed = causal & ~in_window & same
    if sinks > 0:
        sink = document_sink_candidates(
            document_ids, sinks, seq_len=geometry.seq_len, block_q=geometry.block_q, block_k=geometry.block_k
        )  # [B, NQB, S], -1 unused
        is_sink = torch.zeros(batch, nqb, nkb + 1, dtype=torch.bool, device=allowed.device)
        is_sink.scatter_(-1, torch.where(sink >= 0, sink, nkb), True)
        allowed = allowed & ~is_sink[..., :nkb]
    return allowed


def rope_inverse_frequencies(theta: float, rotary_dim: int, *, label: str = "rope_theta") -> Tensor:
    """float32 ``[rotary_dim // 2]``: the standard RoPE frequencies ``theta ** (-2i / rotary_dim)``. ValueError naming
    ``label`` (the caller's name of theta) for a theta that is not > 0, an odd or non-positive ``rotary_dim``, or a
    theta so small that the frequencies leave float32's range."""
    check_float(label, theta, exclusive_minimum=0.0)
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"{label}: RoPE needs a positive even rotary_dim (head dim), got {rotary_dim!r}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if not torch.isfinite(inv_freq).all():
        raise ValueError(
            f"{label}={theta!r} is too small: its RoPE frequencies theta ** (-2i / {rotary_dim}) leave float32's range"
        )
    return inv_freq


def checked_rope(
    inv_freq: Tensor | None, style: str | None, current_style: str, head_dim: int, device
) -> tuple[Tensor, str]:
    """A selector's RoPE state after ``set_rope(inv_freq, style)``: the float32 frequencies on ``device``
    (empty for ``None``) and the convention (``style``, or ``current_style`` when None). Raises ValueError for
    frequencies that are not a finite 1-D tensor of at most ``head_dim / 2`` values, or an unknown style."""
    style = current_style if style is None else style
    check_choice("rope style", style, ROPE_STYLES)
    if inv_freq is None:
        return torch.zeros(0, device=device), style
    if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or not 0 < 2 * inv_freq.shape[0] <= head_dim:
        raise ValueError(
            f"RoPE inv_freq must be a 1-D tensor of at most head_dim/2={head_dim // 2} "
            f"frequencies, got {getattr(inv_freq, 'shape', inv_freq)!r}"
        )
    if not torch.isfinite(inv_freq).all():
        raise ValueError("RoPE inv_freq must be finite")
    return inv_freq.detach().to(device, torch.float32), style


def block_distance_buckets(geometry: SelectionGeometry, device=None) -> Tensor:
    """int64 ``[NQB, NKB]``: log2 bucket of how many key blocks block j lies behind the last key
    block query block i reaches (0 on and past the causal edge, 1 for one block back, 2 for 2-3, ...)."""
    last = causal_last_block(geometry.num_q_blocks, geometry.seq_len, geometry.block_q, geometry.block_k, device)
    behind = (last.view(-1, 1) - torch.arange(geometry.num_k_blocks, device=device).view(1, -1)).clamp(min=0)
    edges = 2 ** torch.arange(DISTANCE_BUCKETS - 1, device=device)
    return torch.bucketize(behind, edges, right=True)


@torch.no_grad()
def block_pool(
    x: Tensor,
    block: int,
    group: int = 1,
    *,
    valid_len: Tensor | None = None,
    inv_freq: Tensor | None = None,
    positions: Tensor | None = None,
    with_max: bool = False,
    rope_style: str = "rotate_half",
) -> Tensor:
    """The selector's block pooling (:func:`~sparse_train.kernels.reference.pool.reference_block_pool`: arguments,
    returns): one Triton kernel (``kernels/triton/pool.py``) where the attention kernels run, the PyTorch reference
    otherwise. No gradient."""
    if choose_backend(x, block, block)[0] == "triton":
        return triton_kernels().pool.triton_block_pool(
            x,
            block,
            group,
            valid_len=valid_len,
            inv_freq=inv_freq,
            positions=positions,
            with_max=with_max,
            rope_style=rope_style,
        )
    return reference_block_pool(
        x,
        block,
        group,
        valid_len=valid_len,
        inv_freq=inv_freq,
        positions=positions,
        with_max=with_max,
        rope_style=rope_style,
    )


def rescale_to_multiplier(selector: nn.Module, state_dict: dict, prefix: str) -> None:
    """Rewrite, in ``state_dict``, the saved parameters of ``selector`` (a learned selector whose parameters are
    stored divided by its ``lr_multiplier`` buffer) for the multiplier ``selector`` was built with.

    The configured multiplier wins (it sets how fast the selector learns), and the effective weights
    (``lr_multiplier * parameter``, what the forward computes with) stay the saved ones bit for bit: each saved
    parameter is multiplied by ``saved / configured``, which is exact when that ratio is a power of two. Called
    by the selectors' ``_load_from_state_dict``; a state dict without ``lr_multiplier`` or with the configured
    one is left as it is.

    Raises:
        ValueError: the ratio is not a power of two (the rescaled parameters could not represent every saved
            effective weight), or a rescaled parameter leaves the range of its dtype.
    """
    key = prefix + "lr_multiplier"
    saved = state_dict.get(key)
    if not isinstance(saved, Tensor) or saved.numel() != 1:
        return
    configured = selector.lr_multiplier
    saved_value, configured_value = float(saved), float(configured)
    if saved_value == configured_value:
        return
    ratio = saved_value / configured_value
    where = f"{type(selector).__name__} at {prefix or '<root>'!r}"
    if not (math.isfinite(ratio) and ratio > 0 and math.frexp(ratio)[0] == 0.5):
        raise ValueError(
            f"{where}: the state dict's lr_multiplier {saved_value:g} and this module's {configured_value:g} "
            f"(SparseAttentionConfig.selector_lr_multiplier) have the ratio {ratio:g}, not a power of two, so the "
            f"saved selector weights cannot be rescaled to {configured_value:g} exactly; build the module with "
            f"selector_lr_multiplier={saved_value:g} to load this state dict"
        )
    saved_f32, configured_f32 = saved.detach().reshape(()).float().cpu(), configured.detach().float().cpu()
    for name, _ in selector.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if not isinstance(value, Tensor):
            continue
        rescaled = value * ratio
        want = value.detach().float().cpu() * saved_f32
        if not torch.equal(rescaled.detach().float().cpu() * configured_f32, want):
            raise ValueError(
                f"{where}: rescaling {name} from the state dict's lr_multiplier {saved_value:g} to this module's "
                f"{configured_value:g} (SparseAttentionConfig.selector_lr_multiplier) leaves the range of "
                f"{value.dtype}; build the module with selector_lr_multiplier={saved_value:g} to load this state dict"
            )
        state_dict[prefix + name] = rescaled
    state_dict[key] = configured.detach().clone()


class BlockScorer(nn.Module):
    """Per-KV-head learned projections of pooled queries and keys -> block logits.

    Parameters: ``query_proj`` ``[HKV, Pq*D, S]``, ``key_proj`` ``[HKV, P*D, S]`` (Pq, P = 1 for
    ``"mean"`` pooling, 2 for ``"mean_max"``) and ``log_temperature`` ``[HKV]``, all stored
    divided by ``lr_multiplier``: the effective weight is ``lr_multiplier * parameter``. Under Adam-type
    optimizers (update size ~ lr, whatever the gradient's scale) this makes the selector learn
    ``lr_multiplier`` times faster than the model it sits in, with one optimizer and one learning rate:
    the distillation target moves with the model, and a selector that learns at the model's pace lags
    behind it (measured: selector-only fit at lr 3e-3 reached needle recall 0.5, at 3e-2 0.99). Under
    plain SGD the factor is ``lr_multiplier**2``. The multiplier is a buffer saved in the state dict; a
    state dict saved with another multiplier loads rescaled to this scorer's (:func:`rescale_to_multiplier`):
    the effective weights are the saved ones bit for bit, and the scorer learns at its own multiplier's pace.

    ``distance_bias`` (``[HKV, DISTANCE_BUCKETS]``, zero at start, same multiplier) adds a learned
    preference per log2 bucket of block distance: what content scores cannot express, such as a
    head's recency, without tying scores to absolute positions. It applies when ``forward`` is
    given the selection geometry.

    With RoPE frequencies set (:meth:`set_rope`), queries and keys are un-rotated before pooling, so
    the scores compare what the model wrote into q and k, independent of where in the sequence the
    blocks sit (a free projection of rotated vectors cannot stay relative-position-invariant once the
    slowest rotary frequency turns by radians across the context). The window covers locality.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        selector_dim: int,
        lr_multiplier: float = 1.0,
        key_pooling: str = "mean",
        distance_bias: bool = False,
        query_pooling: str = "mean",
        rope_style: str = "rotate_half",
    ) -> None:
        super().__init__()
        check_choice("key_pooling", key_pooling, KEY_POOLINGS)
        check_choice("rope_style", rope_style, ROPE_STYLES)
        self.rope_style = rope_style
        check_choice("query_pooling", query_pooling, QUERY_POOLINGS)
        lr_multiplier = check_float("lr_multiplier", lr_multiplier, exclusive_minimum=0.0)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.selector_dim = selector_dim
        self.key_pooling = key_pooling
        self.query_pooling = query_pooling
        key_features = head_dim * (2 if key_pooling == "mean_max" else 1)
        query_features = head_dim * (2 if query_pooling == "mean_max" else 1)
        self.register_buffer("lr_multiplier", torch.tensor(float(lr_multiplier)))
        self.query_proj = nn.Parameter(torch.empty(num_kv_heads, query_features, selector_dim))
        self.key_proj = nn.Parameter(torch.empty(num_kv_heads, key_features, selector_dim))
        self.log_temperature = nn.Parameter(torch.zeros(num_kv_heads))
        self.distance_bias = nn.Parameter(torch.zeros(num_kv_heads, DISTANCE_BUCKETS)) if distance_bias else None
        # Not persistent: the frequencies are a property of the model the scorer sits in, set again by
        # whoever builds it (config.selector_rope_theta, the Hugging Face integration).
        self.register_buffer("rope_inv_freq", torch.zeros(0), persistent=False)
        self.reset_parameters()

    def set_rope(self, inv_freq: Tensor | None, style: str | None = None) -> None:
        """Un-rotate q and k by these RoPE frequencies (``[R/2]``, over the first R channels) before pooling;
        ``None`` pools the rotated q and k as given. ``style``: the RoPE convention (``"rotate_half"`` or
        ``"interleaved"``, :func:`unrotate`); ``None`` keeps the scorer's."""
        self.rope_inv_freq, self.rope_style = checked_rope(
            inv_freq, style, self.rope_style, self.head_dim, self.query_proj.device
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A selector saved before the distance bias existed scored without one, which is a zero bias:
        # load it as that instead of failing on the missing key.
        bias_key = prefix + "distance_bias"
        if self.distance_bias is not None and bias_key not in state_dict and prefix + "query_proj" in state_dict:
            state_dict[bias_key] = torch.zeros_like(self.distance_bias)
        # Likewise a selector saved with mean query pooling loaded into a mean_max one: its scores are
        # those of a zero max half, the initialisation of mean_max.
        query_key = prefix + "query_proj"
        saved = state_dict.get(query_key)
        if (
            isinstance(saved, Tensor)
            and self.query_pooling == "mean_max"
            and saved.dim() == 3
            and saved.shape[1] == self.head_dim
            and self.query_proj.shape[1] == 2 * self.head_dim
        ):
            state_dict[query_key] = torch.cat([saved, torch.zeros_like(saved)], dim=1)
        rescale_to_multiplier(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Shared JL projection for mean queries and mean keys (score ~ pooled logit), temperature 1;
        the max halves of ``query_proj`` and ``key_proj`` (``mean_max``) start at zero, so the initial
        scores are the same for every pooling."""
        # A private generator: building a selector must not advance the global RNG, so a model with
        # sparse attention gets exactly the weights of its dense twin built from the same seed.
        generator = torch.Generator().manual_seed(_PROJECTION_SEED)
        projection = torch.randn(self.num_kv_heads, self.head_dim, self.selector_dim, generator=generator)
        projection = projection.to(self.query_proj.device) / math.sqrt(self.selector_dim)
        multiplier = float(self.lr_multiplier)
        self.query_proj.zero_()
        self.query_proj[:, : self.head_dim].copy_(projection / multiplier)
        self.key_proj.zero_()
        self.key_proj[:, : self.head_dim].copy_(projection / multiplier)
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
    ) -> tuple[Tensor, Tensor]:
        """Detached pooled inputs: ``qbar`` float32 ``[B, HKV, NQB, Pq*D]``, ``kbar`` ``[B, HKV, NKB, P*D]``.
        ``positions`` (``[N]`` or ``[B, N]``): the RoPE positions of the tokens, for the un-rotation
        (:func:`unrotate`; default ``0..N-1``). ``query_blocks`` (int ``[L]``, global ids; context parallelism): q and
        k hold only the rows of these query blocks, block by block; each pooled block summarises its own rows, so it
        only sets the default ``positions`` (the listed blocks' rows); the scores take the map
        (:meth:`forward`'s ``query_blocks``)."""
        if query_blocks is not None and positions is None:
            positions = listed_positions(query_blocks, block_q, q.device).view(-1)
        group = self.num_heads // self.num_kv_heads
        inv_freq = self.rope_inv_freq if self.rope_inv_freq.numel() else None
        qbar = block_pool(
            q.detach(),
            block_q,
            group,
            valid_len=seq_lens,
            inv_freq=inv_freq,
            positions=positions,
            with_max=self.query_pooling == "mean_max",
            rope_style=self.rope_style,
        )
        kbar = block_pool(
            k.detach(),
            block_k,
            1,
            valid_len=seq_lens,
            inv_freq=inv_freq,
            positions=positions,
            with_max=self.key_pooling == "mean_max",
            rope_style=self.rope_style,
        )
        return qbar.float(), kbar.float()  # float32 also for float64 inputs, as the projections are

    def forward(
        self,
        qbar: Tensor,
        kbar: Tensor,
        scale: float,
        geometry: SelectionGeometry | None = None,
        query_blocks: Tensor | None = None,
        *,
        seq_lens: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Block logits float32 ``[B, HKV, NQB, NKB]`` (gradients reach only this module's parameters);
        the distance bias is added when ``geometry`` (of the pooled call) is given.

        ``query_blocks`` (optional int ``[S]``): the GLOBAL query-block ids of ``qbar``'s rows, when
        ``qbar`` holds only some query blocks (``[B, HKV, S, D]``; context parallelism: a rank's local
        blocks) and ``kbar`` all of them; the distance bias then uses those rows of the bucket table.
        Default: ``qbar`` holds every query block in order. ``seq_lens`` and ``document_ids`` are accepted for the
        selectors' common call and not needed here (the pooling leaves padded rows out; top-k masks documents).

        The logits are float32 also under autocast (a bfloat16 product would tie blocks the selector ranks), on
        the kernel path (eager CUDA) and the reference path (CPU, torch.compile) alike."""
        with torch.autocast(qbar.device.type, enabled=False):
            return self._logits(qbar.float(), kbar.float(), scale, geometry, query_blocks)

    def _logits(
        self, qbar: Tensor, kbar: Tensor, scale: float, geometry: SelectionGeometry | None, query_blocks: Tensor | None
    ) -> Tensor:
        multiplier = self.lr_multiplier.to(torch.float32)
        wq = self.query_proj.to(torch.float32) * multiplier
        wk = self.key_proj.to(torch.float32) * multiplier
        qs = torch.einsum("bhnd,hds->bhns", qbar, wq)
        ks = torch.einsum("bhmd,hds->bhms", kbar, wk)
        temperature = torch.exp(self.log_temperature.to(torch.float32) * multiplier) * scale
        bias = None
        if self.distance_bias is not None and geometry is not None:
            bias = self.distance_bias.to(torch.float32) * multiplier  # [HKV, DISTANCE_BUCKETS]
            if query_blocks is not None:
                query_blocks = _check_query_blocks(query_blocks, geometry, qbar.shape[2], qbar.device)
        else:
            query_blocks = None  # the rows' block ids only choose the bias's buckets
        # one kernel instead of ~10 and three float32 passes over the logits; a compiled graph keeps the reference,
        # whose matmul and elementwise ops inductor fuses itself
        if triton_runs_eagerly_on(qs):
            return triton_kernels().scores.triton_block_logits(qs, ks, temperature, bias, geometry, query_blocks)
        return reference_block_logits(qs, ks, temperature, bias, geometry, query_blocks)


def reference_block_logits(
    qs: Tensor,
    ks: Tensor,
    temperature: Tensor,
    bias: Tensor | None = None,
    geometry: SelectionGeometry | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """The selector's block logits (the reference of ``kernels/triton/scores.py``): ``temperature[h] * qs ks^T``
    (``qs [B, H, R, S]``, ``ks [B, H, NKB, S]``, ``temperature [H]``), plus ``bias[h, bucket(i, j)]`` when a
    ``bias`` ``[H, C]`` is given, the bucket of :func:`block_distance_buckets` for the rows' query blocks (all
    of them in order, or the global ids ``query_blocks``). Float32 ``[B, H, R, NKB]``; float64 inputs stay
    float64 (the oracle of the tests)."""
    logits = torch.matmul(qs, ks.transpose(-1, -2)) * temperature.view(1, -1, 1, 1)
    if bias is None:
        return logits
    return add_distance_bias(logits, bias, geometry, query_blocks)


def add_distance_bias(
    logits: Tensor, bias: Tensor, geometry: SelectionGeometry, query_blocks: Tensor | None = None
) -> Tensor:
    """``logits [B, H, R, NKB] + bias[h, bucket(i, j)]`` (``bias [H, C]``; the buckets of
    :func:`block_distance_buckets` for the rows' query blocks: all of them in order, or the global ids
    ``query_blocks``), with a backward that sums the gradient per bucket."""
    buckets = block_distance_buckets(geometry, logits.device)
    if query_blocks is not None:
        buckets = buckets.index_select(0, query_blocks.to(logits.device, torch.int64))
    return logits + _BucketLookup.apply(bias, buckets).unsqueeze(0)


class _BucketLookup(torch.autograd.Function):
    """``table[:, buckets]`` (``table [H, C]``, int ``buckets [NQB, NKB]`` -> ``[H, NQB, NKB]``) whose
    backward sums the gradient per bucket with one masked reduction per bucket. Autograd's own backward
    of this indexing (a deterministic sort-based scatter of NQB * NKB values into C = 16 buckets) costs
    more than the attention it serves at 64K; C reductions over the gradient are a few
    passes over memory, deterministic, and need no host read."""

    @staticmethod
    def forward(ctx, table: Tensor, buckets: Tensor) -> Tensor:
        ctx.save_for_backward(buckets)
        ctx.num_buckets = table.shape[1]
        return table[:, buckets]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (buckets,) = ctx.saved_tensors
        per_bucket = [torch.where(buckets == c, grad, 0.0).sum(dim=(-2, -1)) for c in range(ctx.num_buckets)]
        return torch.stack(per_bucket, dim=-1), None


def _check_query_blocks(query_blocks, geometry: SelectionGeometry, rows: int, device) -> Tensor:
    """``query_blocks`` as int64 on ``device`` after checking it names ``rows`` global query blocks (the type
    check is the attention API's, ``validation.check_integer_tensor``; the attention's own
    ``arguments.check_query_blocks`` also checks the values, which here would be a host read per call)."""
    check_integer_tensor("query_blocks", query_blocks, dim=1)
    if query_blocks.shape[0] != rows:
        raise ValueError(f"query_blocks lists {query_blocks.shape[0]} query blocks but the scores hold {rows} rows")
    # values are not checked here: that would be a host read on every call (the callers build the ids)
    return query_blocks.to(device=device, dtype=torch.int64)


def _topk_kernel_runs(scores: Tensor, geometry: SelectionGeometry) -> bool:
    """The top-k kernel (``kernels/triton/topk.py``) takes CUDA score rows it can hold, where Triton imports."""
    if not triton_runs_on(scores):
        return False
    return geometry.num_k_blocks <= triton_kernels().topk.MAX_KEY_BLOCKS


def _past_top_p(masked: Tensor, values: Tensor, top_p: float) -> Tensor:
    """True where a pick of ``values`` (the sorted top-k of ``masked``, the row's scores with -inf outside the
    allowed blocks) falls past the ``top_p`` budget: the unnormalised softmax mass of the better picks before it
    already reaches ``top_p`` times the row's total over every allowed block.

    In float64 from the scores as given, and the comparison allows for the rounding of both sums (at most
    ``terms * 2**-53`` relative each): a pick whose exact mass before it is short of ``top_p`` is never cut, so
    the kept set always reaches ``top_p``; at worst one pick within that rounding of the boundary is kept
    beyond the exact set. (Summed in float32, the mass of a confident row reaches 1 by rounding while the exact
    mass is still short of it, which would cut blocks the budget needs.)"""
    scores = masked.double()
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=EMPTY_BLOCK_SCORE)
    total = torch.exp(scores - row_max).sum(dim=-1, keepdim=True)
    weights = torch.exp(values.double() - row_max)
    before = torch.cat([torch.zeros_like(weights[..., :1]), torch.cumsum(weights, dim=-1)[..., :-1]], dim=-1)
    slack = (scores.shape[-1] + values.shape[-1] + 4) * 2.0**-52
    return before >= top_p * total * (1.0 + slack)


def selection_candidates(
    scores: Tensor,
    geometry: SelectionGeometry,
    *,
    window: int,
    sinks: int,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
    top_p: float | None = None,
    query_blocks: Tensor | None = None,
) -> Tensor:
    """Top-k dynamic key blocks per query block, for ``BlockIndex.from_selection``. On CUDA without documents and
    ``top_p`` (or with ``top_p=1.0``): one Triton kernel (``kernels/triton/topk.py``: ties go to the lower block;
    ``torch.topk`` here ranks ties in no fixed order), else this PyTorch path.

    Args:
        scores: block logits ``[B, HKV, NQB, NKB]`` (detached here: the hard top-k carries no gradient).
        geometry: :func:`selection_geometry` of this call.
        window, sinks: the forced blocks, excluded from top-k because the index adds them anyway.
        seq_lens: optional int ``[B]``; key blocks past it rank below every other block.
        document_ids: optional int ``[B, N]`` (packed documents): key blocks sharing no document with
            the query block are never picked, nor are the per-document sinks
            (:func:`allowed_dynamic_blocks`).
        top_p: adaptive budget. ``None`` keeps all ``dynamic_k`` best blocks. A float in (0, 1] keeps,
            per row, the fewest of them (best first) whose predicted mass reaches ``top_p``: the
            predicted mass is the softmax of the row's scores over the blocks top-k chooses from,
            the distribution the distillation fits to the attention mass, so a row whose mass sits in
            one block keeps one and a row with spread mass keeps up to ``dynamic_k``. ``1.0`` keeps
            what ``None`` keeps (the whole mass needs every candidate). The mass is summed in float64
            and the cut errs toward keeping a block within rounding of the boundary, never toward
            dropping one the budget needs. Shapes do not change and nothing is read back to the host.
        query_blocks: optional int ``[S]``, the GLOBAL query-block ids of the rows of ``scores``
            (``[B, HKV, S, NKB]``), when it holds only some query blocks (context parallelism: a rank's
            local blocks). Each row is picked exactly as the row of that block in a full call.

    Returns:
        int64 ``[B, HKV, NQB, dynamic_k]`` block ids (``[B, HKV, S, dynamic_k]`` with ``query_blocks``),
        -1 where a row has fewer candidates (or needs fewer under ``top_p``).
    """
    batch, kv_heads, rows = scores.shape[:3]
    k = geometry.dynamic_k
    top_p = check_float("top_p", top_p, exclusive_minimum=0.0, maximum=1.0, optional=True)
    if top_p == 1.0:
        top_p = None  # the whole mass needs every candidate: no cut, the same path and picks as None
    if query_blocks is not None:
        query_blocks = _check_query_blocks(query_blocks, geometry, rows, scores.device)
    if k == 0:
        return torch.empty(batch, kv_heads, rows, 0, dtype=torch.int64, device=scores.device)
    if document_ids is None and top_p is None and _topk_kernel_runs(scores, geometry):
        return triton_kernels().topk.triton_selection_candidates(
            scores, geometry, window=window, sinks=sinks, seq_lens=seq_lens, query_blocks=query_blocks
        )
    allowed = allowed_dynamic_blocks(geometry, window, sinks, scores.device, document_ids)
    if query_blocks is not None:
        allowed = allowed.index_select(allowed.dim() - 2, query_blocks)
    if allowed.dim() == 3:
        allowed = allowed.unsqueeze(1)  # [B, 1, NQB, NKB]
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    if seq_lens is not None:
        block_start = torch.arange(geometry.num_k_blocks, device=scores.device) * geometry.block_k
        empty = block_start.view(1, -1) >= seq_lens.view(-1, 1)  # [B, NKB]
        low = empty[:, None, None, :] & allowed
        masked = torch.where(low, torch.full_like(masked, EMPTY_BLOCK_SCORE), masked)
    values, picked = torch.topk(masked, k, dim=-1, sorted=top_p is not None)
    unused = torch.isneginf(values)
    if top_p is not None:
        unused = unused | _past_top_p(masked, values, top_p)
    return torch.where(unused, torch.full_like(picked, -1), picked)
