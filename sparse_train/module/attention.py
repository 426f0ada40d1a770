"""``SparseAttention``: learned block selection -> ``BlockIndex`` -> plan -> ``sparse_attention``.

The module is the attention *core* (no projections): it takes post-RoPE ``q [B, HQ, N, D]`` and
``k, v [B, HKV, N, D]`` and returns ``o [B, HQ, N, D]``, like causal SDPA.

Per call:

1. **Path.** Dense during the warm-up (``dense_warmup_steps``). Otherwise, from N alone (no device
   sync) the selection geometry says how many blocks each query block will select. A full selection (every causal block;
   short sequences) takes dense causal SDPA,
   which computes the same function faster. Near-full selections use hysteresis: the dense path is
   entered when the selected fraction of causal blocks reaches ``dense_enter_density`` and left only
   when it falls to ``dense_exit_density``, so sequence lengths wobbling around the crossover do not
   flip the path (and re-plan) every step.
2. **Selection.** The scorer ``config.selector`` names (:func:`~sparse_train.selection.build_selector`) -> block logits
->
   top-k among causal blocks not covered by window/sinks -> ``BlockIndex.from_selection`` (adds window
   and sinks, dedups, canonical form). The top-k is hard and integer: the attention output has no
   gradient path into the selector.
3. **Backend.** Triton on CUDA when the kernels support dtype/head dim/block size, the PyTorch
   reference otherwise; every non-Triton run is counted with its reason.
4. **Distillation** (training): KL from a target built from the main attention (detached q/k) to
   the selector's distribution over the blocks top-k chooses from. The target is, per key block, the
   largest attention mass any single row of the query block gives it (``distill_row_pool="max"``),
   on every causal block of a few sampled query blocks (``distill="sampled"``), so blocks the
   selector misses are supervised too. The loss is in ``selector_loss`` and only reaches the
   selector's parameters, which learn ``selector_lr_multiplier`` times faster than the model under
   the same optimizer; ``dense_warmup_steps`` runs dense attention while the selector first learns.
5. **Replay.** Under activation checkpointing the recompute reuses the first forward's decisions
   (:mod:`sparse_train.selection.replay`). Under reentrant checkpointing (``use_reentrant=True``) the first
   forward runs under ``torch.no_grad``; the module recognises it and computes the distillation loss there
   with autograd on for the selector alone, so ``selector_loss`` trains the selector as without checkpointing.

The steps that depend on where the call's rows sit in the sequence (input checks, the rows the selector
pools, the all-gather of keys and selections, the attention call, the distillation's reductions) are the
module's ``layout`` (:mod:`sparse_train.module.layout`): the whole sequence by default, one rank's shard
under context parallelism (:class:`~sparse_train.parallel.context_parallel.ContextParallelLayout`, set by
``enable_context_parallel``). There is one forward for both.

Packed documents (``document_ids`` ``[B, N]``, :mod:`sparse_train.documents`): each token attends only
its own document on every path. The index drops key blocks that share no document with the query
block (window and sinks per document), top-k never picks them, the distillation target and the
quality metrics are computed with the document mask, and the dense paths mask by document too.

Host synchronisation: none on the sparse training path at the defaults (``index_check="none"``,
``metrics_every=0``, ``profile=False``, ``dropout_p=0``). The path decision is Python on shapes; the
index capacity follows from (N, block sizes, top_k, window, sinks, documents or not); the plan and the
kernel schedules have shapes fixed by the index's shape; the distillation sample is drawn on the device
from a counter buffer; fallback counts live in a tensor buffer. Checks of *values* that need a device
-> host read (seq_lens in [0, N], document ids non-decreasing, the selector's candidates) run on CUDA
only with ``index_check="cheap"`` or ``"full"``; on CPU tensors they always run (no device is waited
on). Unchecked values are safe for memory (kernels clamp seq_lens, document ids only decide masks).
Metrics (``metrics_every``), profiling, ``stats()`` and ``dropout_p > 0`` without a fixed seed (the
seed is drawn on the host) read the host by design.

torch.compile: the sparse training path, distillation included, traces into one graph
(``fullgraph=True``; the Triton kernels are ``torch.library`` custom ops); replay, metrics and
profiling are skipped while compiling.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..config import SparseAttentionConfig
from ..documents import document_positions
from ..functional import BACKEND_REASONS, dense_causal_attention
from ..index.block_index import BlockIndex
from ..options import check_kernel_option_shapes, kernel_options_dict
from ..selection.distill import block_kl_sum, dense_block_mass, renormalise, sparse_block_mass
from ..selection.indexer import build_selector
from ..selection.metrics import draw_query_blocks, sample_query_blocks, selection_quality
from ..selection.replay import SelectionRecord, SelectionReplay, in_backward_pass, reentrant_checkpoint_node
from ..selection.scorer import (
    allowed_dynamic_blocks,
    causal_block_mask,
    rope_inverse_frequencies,
    selection_candidates,
    selection_geometry,
)
from ..selection.state import check_selector_state
from ..timing import PhaseTimer
from ..validation import (
    check_document_ids,
    check_dropout_p,
    check_float,
    check_qkv,
    check_seq_lens,
    draw_dropout_seed,
)
from .checkpointing import outside_selective_checkpoint
from .layout import SequenceLayout

__all__ = ["FALLBACK_REASONS", "RESUME_STATE", "SparseAttention"]

FALLBACK_REASONS = ("dense_warmup", "dense_full_selection", "dense_hysteresis", "decode") + tuple(
    f"reference_{code}" for code in BACKEND_REASONS if code not in ("requested", "supported")
)
"""Every reason a call leaves the Triton sparse path; ``fallback_counts`` and ``stats()`` use these names
(the reference ones are ``resolve_backend``'s codes, so a new code cannot be miscounted)."""

RESUME_STATE = ("distill_draws", "dense_mode", "dropout_base", "dropout_draws")
"""The state-dict buffers of a ``SparseAttention``, besides ``selector_steps``, that decide the numbers of later
calls: the distillation sample's draw number, the dense/sparse hysteresis, and the dropout seeds' base and draw
number. A state dict without them loads them at their initial values (zero, sparse, no base yet, zero), also under
``strict=True``."""
_NO_DROPOUT_BASE = -1
"""``dropout_base`` before the first dropout call draws it."""


def _mixed_seed(base: int, draw: int) -> int:
    """The dropout seed of draw number ``draw`` from ``base``: the base itself for draw 0 (a module's first seed is
    the one :func:`~sparse_train.validation.draw_dropout_seed` returns), then a splitmix64 finalizer of
    ``base + draw * golden``, in [0, 2**62) (it fits a signed int64, as the base does)."""
    if draw == 0:
        return base
    mask = 2**64 - 1
    z = (base + draw * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 2


_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class SparseAttention(nn.Module):
    """Learned block-sparse causal attention core (see module docstring).

    Args:
        config: :class:`~sparse_train.SparseAttentionConfig`.
        num_heads: HQ. num_kv_heads: HKV (HQ must be a multiple). head_dim: D.

    Attributes:
        scorer: the block scorer ``config.selector`` names (:func:`~sparse_train.selection.build_selector`: the
            learned :class:`~sparse_train.selection.BlockScorer` or :class:`~sparse_train.selection.TokenIndexer`,
            or the parameter-free :class:`~sparse_train.selection.OracleSelector`); its parameters are the
            selector's and appear in ``state_dict`` under ``scorer.``.
        selector_steps, distill_draws, dense_mode, dropout_base, dropout_draws: buffers in ``state_dict`` holding
            the training-forward count (warm-up, ``distill_every``, ``metrics_every``), the distillation sample's
            draw number, the dense/sparse hysteresis and the dropout seeds' base and draw number: with them a run
            resumed from ``state_dict`` continues exactly (the quality metrics' sample is drawn from the
            training-forward count too). ``fallback_counts``, the replay counts and the timings are statistics of
            the module object and are not saved.
        selector_loss: the last training forward's distillation loss (scalar, gradients only into
            ``scorer``), or None.
        fallback_counts: dict reason -> number of calls that took that fallback.
    """

    def __init__(self, config: SparseAttentionConfig, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if not isinstance(config, SparseAttentionConfig):
            raise ValueError(f"config must be a SparseAttentionConfig, got {type(config).__name__}")
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        # the kernel options that depend on the shapes are checked here rather than at the first call
        check_kernel_option_shapes(config.kernel_options, num_heads // num_kv_heads, config.block_q)
        self.config = config
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = config.scale if config.scale is not None else 1.0 / math.sqrt(head_dim)
        self.scorer = build_selector(config, num_heads, num_kv_heads, head_dim)
        if config.selector_rope_theta is not None:
            self.scorer.set_rope(
                rope_inverse_frequencies(
                    config.selector_rope_theta, head_dim, label="SparseAttentionConfig.selector_rope_theta"
                )
            )
        # The state that decides a later call's numbers is in the state dict (selector_steps and RESUME_STATE),
        # so a run resumed from a checkpoint computes what the uninterrupted run computes.
        # Training forwards seen so far (drives the dense warm-up, distill_every and metrics_every). The
        # Python int is the source of truth (reading a CUDA buffer would sync every call); the buffer
        # advances beside it on the device (an in-graph add under torch.compile).
        self.register_buffer("selector_steps", torch.zeros((), dtype=torch.int64))
        # Draw number of the distillation's query-block sample (draw_query_blocks), advanced on the
        # device: no generator object (torch.compile cannot trace one) and no host read.
        self.register_buffer("distill_draws", torch.zeros((), dtype=torch.int64))
        # The dense/sparse hysteresis: True while the dense path holds. The Python bool is the source of
        # truth (the path is decided on the host); the buffer mirrors it.
        self.register_buffer("dense_mode", torch.zeros((), dtype=torch.bool))
        # Dropout seeds: the base, drawn from torch's global generator at the first call with dropout (not here:
        # building the module leaves the global stream to the model's weights), and the draw number; each call's
        # seed is mixed from the two on the host (the Python ints are the source of truth, the buffers mirror them).
        self.register_buffer("dropout_base", torch.full((), _NO_DROPOUT_BASE, dtype=torch.int64))
        self.register_buffer("dropout_draws", torch.zeros((), dtype=torch.int64))
        # A tensor (not a dict of ints) so counting inside a compiled graph is an in-graph add, not a
        # Python side effect that would guard and recompile on every call. A statistic of this module
        # object (like the replay counts and timings), not saved.
        self.register_buffer(
            "fallback_counter", torch.zeros(len(FALLBACK_REASONS), dtype=torch.int64), persistent=False
        )
        self.selector_loss: Tensor | None = None
        self._dense_mode = False
        self._dropout_base = _NO_DROPOUT_BASE
        self._dropout_draws = 0
        self._training_calls = 0
        self._last_distilled = False
        self._last_index: BlockIndex | None = None
        self._last_path = "sparse"
        self._last_quality: dict[str, Tensor] = {}
        self._replay = SelectionReplay()
        self._timings = PhaseTimer()
        # Where the rows of a call sit in the sequence: the whole sequence here, or under context parallelism
        # (set from outside by sparse_train.parallel.context_parallel.enable_context_parallel) one rank's
        # zig-zag shard of it.
        self.layout: SequenceLayout = SequenceLayout()

    # ------------------------------------------------------------------------------------ public
    @property
    def fallback_counts(self) -> dict[str, int]:
        """reason -> calls that took it (only reasons that occurred)."""
        counts = self.fallback_counter.tolist()
        return {reason: int(n) for reason, n in zip(FALLBACK_REASONS, counts) if n}

    @property
    def last_selection(self) -> BlockIndex | None:
        """The ``BlockIndex`` the last forward attended with, or None when it ran dense."""
        return self._last_index if self._last_path == "sparse" else None

    def reset_stats(self) -> None:
        """Zero fallback counts, replay counters and the last measurements."""
        self.fallback_counter.zero_()
        self._replay.hits = self._replay.misses = self._replay.ambiguous = 0
        self._last_quality = {}
        self._timings = PhaseTimer()

    def stats(self) -> dict[str, float]:
        """Floats for logging: ``density`` (fraction of the causal area the last call attended),
        ``dense_path``, ``selector_loss``, ``mass_recall_mean`` / ``mass_recall_p5`` (attention-mass
        recall per query row, when measured) and ``oracle_mass_recall_*`` (the same for the best
        selection of that size), ``oracle_density_r90`` (the density a perfect selector needs for a mean
        recall of 0.90), ``warmup`` (1 while the dense warm-up runs),
        ``fallbacks/<reason>`` for every reason, ``replay/*`` and, with ``profile``, ``time/*_ms``.
        Reading it synchronises the device (call it once per logged step, not per layer call)."""
        out: dict[str, float] = {}
        if self._last_path == "dense":
            out["density"] = 1.0
        elif self._last_index is not None:
            out["density"] = self._last_index.density()
        out["dense_path"] = 1.0 if self._last_path == "dense" else 0.0
        out["warmup"] = 1.0 if self.warming_up else 0.0
        if self._last_index is not None:
            out["selection_density"] = self._last_index.density()
        out["selector_loss"] = float(self.selector_loss.detach()) if self.selector_loss is not None else float("nan")
        for name, value in self._last_quality.items():
            out[name] = float(value)
        counts = self.fallback_counter.tolist()
        for reason, n in zip(FALLBACK_REASONS, counts):
            out[f"fallbacks/{reason}"] = float(n)
        out.update(self._replay.stats())
        if self.config.profile:
            out.update(self._timings.elapsed_ms())
        return out

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"block_q={c.block_q}, block_k={c.block_k}, top_k={c.top_k}, window={c.window}, sinks={c.sinks}, "
            f"distill={c.distill!r}, backend={c.backend!r}"
        )

    # ------------------------------------------------------------------------------------ checks
    def _check_inputs(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_lens: Tensor | None,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> None:
        """The shared API rules (:mod:`sparse_train.validation`), then what this module was built for.
        The seq_lens and document_ids *values* are checked by the path that runs, when
        :meth:`_checks_values` says so."""
        if isinstance(q, Tensor) and q.dim() == 4 and q.shape[1] != self.num_heads:
            raise ValueError(
                f"q has {q.shape[1]} heads in dim 1, this module was built for "
                f"num_heads={self.num_heads} (expected q [B, HQ, N, D])"
            )
        batch, _, hkv, n, d = check_qkv(q, k, v)
        if q.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"q has dtype {q.dtype}; supported: {', '.join(map(str, _SUPPORTED_DTYPES))}")
        if d != self.head_dim:
            raise ValueError(f"q has head dim {d}, this module was built for head_dim={self.head_dim}")
        if hkv != self.num_kv_heads:
            raise ValueError(
                f"k/v must have shape [B={batch}, HKV={self.num_kv_heads}, N={n}, D={d}], got {tuple(k.shape)}"
            )
        if n == 0:
            raise ValueError("sequence length N must be > 0")
        check_seq_lens(seq_lens, batch, n, q.device, values=False)
        check_document_ids(document_ids, batch, n, q.device, values=False)
        if position_ids is not None:
            if not isinstance(position_ids, Tensor) or tuple(position_ids.shape) not in ((n,), (batch, n)):
                raise ValueError(
                    f"position_ids must be a tensor [B, N] = [{batch}, {n}] or [N], got "
                    f"{getattr(position_ids, 'shape', type(position_ids).__name__)}"
                )
            if position_ids.device != q.device:
                raise ValueError(f"position_ids is on {position_ids.device} but q is on {q.device}")

    # ------------------------------------------------------------------------------------ policy
    @property
    def warming_up(self) -> bool:
        """True while the dense warm-up (``dense_warmup_steps``) runs: attention is dense and the
        selector distills from it."""
        return self._training_calls < self.config.dense_warmup_steps

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A state dict of this module written without some of RESUME_STATE loads them at their initial
        # values (strict loads included). A state dict without the module's keys at all (a dense model's)
        # still reports every key missing.
        # The weights of the other learned selector (pooled <-> token) fail here with a message naming
        # SparseAttentionConfig.selector, not as a size mismatch of scorer.query_proj.
        check_selector_state(self.scorer, state_dict, prefix + "scorer.")
        # A token selector trained by the token-level KL alone has no distance bias (nothing trains it); one saved
        # with a bias that stayed zero scored as without it and loads as that.
        bias_key = prefix + "scorer.distance_bias"
        saved_bias = state_dict.get(bias_key)
        if getattr(self.scorer, "distance_bias", 0) is None and isinstance(saved_bias, Tensor) and not saved_bias.any():
            del state_dict[bias_key]
        if prefix + "selector_steps" in state_dict:
            for name in RESUME_STATE:
                initial = _NO_DROPOUT_BASE if name == "dropout_base" else 0
                state_dict.setdefault(prefix + name, torch.full_like(getattr(self, name), initial))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._training_calls = int(self.selector_steps)
        self._dense_mode = bool(self.dense_mode)
        self._dropout_base = int(self.dropout_base)
        self._dropout_draws = int(self.dropout_draws)

    def _draw_dropout_seed(self) -> int:
        """The next dropout seed: mixed from the base (drawn from torch's global generator on the first call, so
        ``torch.manual_seed`` makes runs reproducible) and the draw number, both in the state dict, so a resumed run
        drops what the uninterrupted one drops."""
        if self._dropout_base == _NO_DROPOUT_BASE:
            self._dropout_base = draw_dropout_seed()
            self.dropout_base.fill_(self._dropout_base)
        seed = _mixed_seed(self._dropout_base, self._dropout_draws)
        self._dropout_draws += 1
        self.dropout_draws.add_(1)
        return seed

    def _choose_path(self, geometry, update_state: bool) -> tuple[str, str | None]:
        """``("dense" | "sparse", fallback reason)`` from shapes, the warm-up and the hysteresis state."""
        cfg = self.config
        if self.warming_up:
            return "dense", "dense_warmup"
        if not cfg.dense_fallback:
            return "sparse", None
        density = geometry.block_density
        dense_mode = self._dense_mode
        if dense_mode and density <= cfg.dense_exit_density and not geometry.is_full:
            dense_mode = False
        elif not dense_mode and (density >= cfg.dense_enter_density or geometry.is_full):
            dense_mode = True
        if update_state and dense_mode != self._dense_mode:
            self._dense_mode = dense_mode
            self.dense_mode.fill_(dense_mode)
        if geometry.is_full:
            return "dense", "dense_full_selection"
        return ("dense", "dense_hysteresis") if dense_mode else ("sparse", None)

    def _checks_values(self, device: torch.device) -> bool:
        """Whether this call checks the *values* of seq_lens and document_ids: always on CPU tensors (a
        host read there waits on no device), on an accelerator only with ``index_check`` "cheap" or
        "full" (each check is a device -> host sync). The module docstring states the rule."""
        return device.type == "cpu" or self.config.index_check != "none"

    def _count(self, reason: str | None) -> None:
        if reason is not None:
            self.fallback_counter[FALLBACK_REASONS.index(reason)] += 1

    def decode(
        self, q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Tensor | None = None, scale: float | None = None
    ) -> Tensor:
        """Attention of the last ``Nq`` positions over ``Nk >= Nq`` keys (KV-cache decoding, chunked
        prefill): dense causal attention aligned at the end (query i sits at position Nk - Nq + i),
        counted as the fallback ``"decode"``. No selection is made: with a handful of queries the
        dense read of the cache is what a selection would cost anyway, and the result is exact.

        Args:
            q: ``[B, HQ, Nq, D]``; k, v: ``[B, HKV, Nk, D]`` (the whole cache, this step included).
            key_padding_mask: optional ``[B, Nk]``, nonzero/True = a real key (any padding pattern).
            scale: logit scale; ``None`` = the module's.

        Raises:
            ValueError: shapes, dtypes or devices that do not fit, Nq > Nk, or a query row left with
                no real key.
        """
        if self.layout.splits_sequence:
            raise ValueError(
                "decode: not supported under context parallelism (decoding reads one cache on one "
                "rank); call sparse_train.parallel.context_parallel.disable_context_parallel(model) first"
            )
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise ValueError(
                    f"decode: {name} must be a 4-D tensor [B, H, N, D], got {getattr(t, 'shape', type(t).__name__)}"
                )
        batch, heads, num_queries, dim = q.shape
        num_keys = k.shape[2]
        if heads != self.num_heads or dim != self.head_dim:
            raise ValueError(f"decode: q must be [B, HQ={self.num_heads}, Nq, D={self.head_dim}], got {tuple(q.shape)}")
        expected = (batch, self.num_kv_heads, num_keys, dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(
                f"decode: k and v must both be [B, HKV, Nk, D] = {expected}, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if not 0 < num_queries <= num_keys:
            raise ValueError(f"decode: needs 0 < Nq <= Nk, got Nq={num_queries}, Nk={num_keys}")
        if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
            raise ValueError(
                f"decode: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                f"on {q.device}/{k.device}/{v.device}"
            )
        scale = self.scale if scale is None else check_float("scale", scale, exclusive_minimum=0.0)
        query_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)
        allowed = torch.arange(num_keys, device=q.device).view(1, -1) <= query_pos.view(-1, 1)  # [Nq, Nk]
        allowed = allowed.view(1, 1, num_queries, num_keys)
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor) or tuple(key_padding_mask.shape) != (batch, num_keys):
                raise ValueError(
                    f"decode: key_padding_mask must be [B, Nk] = {(batch, num_keys)}, got "
                    f"{getattr(key_padding_mask, 'shape', type(key_padding_mask).__name__)}"
                )
            allowed = allowed & key_padding_mask.to(device=q.device, dtype=torch.bool).view(batch, 1, 1, num_keys)
            if not torch.compiler.is_compiling() and not bool(allowed.any(dim=-1).all()):
                raise ValueError("decode: a query row has no real key to attend (check key_padding_mask)")
        self._count("decode")
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=self.num_heads != self.num_kv_heads
        )

    # ------------------------------------------------------------------------------------ forward
    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_lens: Tensor | None = None,
        *,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        scale: float | None = None,
        dropout_p: float | None = None,
    ) -> Tensor:
        """q ``[B, HQ, N, D]`` (post-RoPE), k/v ``[B, HKV, N, D]``, seq_lens optional int ``[B]``
        (right padding: keys at positions >= seq_lens[b] are masked) -> o ``[B, HQ, N, D]``.

        ``document_ids`` (optional int ``[B, N]`` on q's device, non-decreasing along N, values >= 0):
        packed documents; query i sees key j only when ``document_ids[b, j] == document_ids[b, i]``
        (besides j <= i), on the sparse and the dense paths, in the selection and in the selector's
        distillation target. ``position_ids`` (optional ``[B, N]`` or ``[N]``): the RoPE positions of
        the tokens, used only to un-rotate q and k for the selector (``selector_rope_theta``); the
        default is ``0..N-1``, restarting at 0 at every document start when ``document_ids`` is given
        (the usual packing convention).

        ``scale`` / ``dropout_p`` override the config for this call (the Hugging Face integration
        passes the model's own values). Under autocast q, k and v are cast to the autocast dtype first,
        as ``F.scaled_dot_product_attention`` does.

        Raises:
            ValueError: q/k/v, seq_lens, document_ids or position_ids of the wrong shape, dtype or
                device; seq_lens values outside [0, N]; document_ids negative or decreasing (values: on
                CPU tensors always, on CUDA with ``index_check`` "cheap"/"full", see the module docstring)."""
        if isinstance(q, Tensor) and torch.is_autocast_enabled(q.device.type):
            # as F.scaled_dot_product_attention under autocast: one compute dtype for q, k and v (a
            # model's RoPE in fp32 hands over fp32 q and k beside a bf16 v); non-tensors are left for
            # _check_inputs to name
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = (t.to(dtype) if isinstance(t, Tensor) else t for t in (q, k, v))
        layout = self.layout
        seq_len = layout.check_inputs(self, q, k, v, seq_lens, document_ids, position_ids)
        cfg = self.config
        batch = q.shape[0]
        check_values = self._checks_values(q.device)
        scale = self.scale if scale is None else check_float("scale", scale, exclusive_minimum=0.0)
        dropout_p = cfg.dropout_p if dropout_p is None else check_dropout_p(dropout_p)
        dropout_p = dropout_p if self.training else 0.0
        compiling = torch.compiler.is_compiling()
        recomputing = not compiling and in_backward_pass()
        first_pass = not recomputing
        # The first forward of a reentrant activation checkpoint runs under torch.no_grad, and its backward
        # recomputes this call with autograd on: the selector's loss is computed here, with autograd on for the
        # selector alone, and the record for the recompute hangs on the checkpoint's backward node.
        checkpoint_node = (
            reentrant_checkpoint_node() if first_pass and not compiling and not torch.is_grad_enabled() else None
        )
        profile = cfg.profile and not compiling
        # a checkpoint's recompute of this call is timed as phases of its own (``time/attn_fwd_recompute_ms``, ...)
        phase_suffix = "" if first_pass else "_recompute"
        device = q.device
        # lru_cache is opaque to dynamo: trace the plain function while compiling (once per shape)
        geometry_of = selection_geometry.__wrapped__ if compiling else selection_geometry
        geometry = geometry_of(seq_len, cfg.block_q, cfg.block_k, cfg.top_k, cfg.window, cfg.sinks)

        if position_ids is None and document_ids is not None and self.scorer.rope_inv_freq.numel():
            position_ids = document_positions(document_ids)
        capacity = geometry.capacity if document_ids is None else geometry.document_capacity
        # the rows here: all of them, or under context parallelism this rank's query blocks
        query_blocks = layout.query_blocks(seq_len, cfg.block_q, device)

        record = self._replay.lookup(batch, seq_len) if (recomputing and cfg.replay) else None
        if record is not None:
            path, reason, index, plan = record.path, record.reason, record.index, record.plan
            backend, dropout_seed, distill_now = record.backend, record.dropout_seed, record.distilled
            distill_blocks, distill_target = record.distill_blocks, record.distill_target
            document_ids, pooled, distill_queries = record.document_ids, record.pooled, record.distill_queries
        else:
            path, reason = self._choose_path(geometry, update_state=first_pass)
            index = plan = backend = pooled = None
            dropout_seed = distill_blocks = distill_target = distill_queries = None
            distill_now = self._distills_now(first_pass, reentrant=checkpoint_node is not None)
        metrics_now = (
            first_pass
            and not compiling
            and self.training
            and cfg.metrics_every > 0
            and self._training_calls % cfg.metrics_every == 0
        )
        if first_pass and self.training:
            self._training_calls += 1
            self.selector_steps.add_(1)

        # ---- selector: scores (with grad when distilling) and, unless replayed, the selection
        need_selection = index is None and (
            path == "sparse" or (distill_now and self._distill_mode(path) == "sparse") or metrics_now
        )
        scores = None
        # the selection, the plan, the distillation and the metrics are many small ops that an activation
        # checkpoint keeping the attention would route one by one through its Python dispatch mode; they run
        # outside it (in the recompute too), the attention call below stays inside (see checkpointing.py)
        host_ops = contextlib.nullcontext if compiling else outside_selective_checkpoint
        # autograd for the selector's loss: the caller's, or on in a reentrant checkpoint's first forward
        selector_autograd = (
            torch.enable_grad if (checkpoint_node is not None and distill_now) else contextlib.nullcontext
        )
        if profile:
            self._timings.mark("selector" + phase_suffix, 0, device)
        with host_ops(), selector_autograd():
            if need_selection or distill_now:
                if pooled is None:
                    pool_lens, pool_positions = layout.pooling_rows(seq_len, seq_lens, position_ids, device)
                    qbar, kbar = self.scorer.pool(
                        q, k, cfg.block_q, cfg.block_k, pool_lens, pool_positions, query_blocks=query_blocks
                    )
                    pooled = qbar, layout.gather(kbar, 2)  # the keys of the whole sequence
                qbar, kbar = pooled
                # the token indexer's sampled distillation scores its few query blocks apart (with gradients);
                # the selection's scores over every block then need none (the winners' bookkeeping costs more
                # than the scores), and a call that does not select (a checkpoint recompute replaying its
                # selection) none at all
                scores_apart = distill_now and cfg.selector == "token" and self._distill_mode(path) == "sampled"
                if need_selection or not scores_apart:
                    with torch.set_grad_enabled(torch.is_grad_enabled() and distill_now and not scores_apart):
                        scores = self.scorer(
                            qbar,
                            kbar,
                            scale,
                            geometry,
                            query_blocks=query_blocks,
                            seq_lens=seq_lens,
                            document_ids=document_ids,
                        )
            if need_selection:
                candidates = selection_candidates(
                    scores,
                    geometry,
                    window=cfg.window,
                    sinks=cfg.sinks,
                    seq_lens=seq_lens,
                    document_ids=document_ids,
                    top_p=cfg.top_p,
                    query_blocks=query_blocks,
                )
                index = BlockIndex.from_selection(
                    layout.gather(candidates, 2),
                    seq_len=seq_len,
                    block_q=cfg.block_q,
                    block_k=cfg.block_k,
                    window=cfg.window,
                    sinks=cfg.sinks,
                    capacity=capacity,
                    check=cfg.index_check,
                    document_ids=document_ids,
                )
        if profile:
            self._timings.mark("selector" + phase_suffix, 1, device)

        # ---- what the kernels attend: the selection, or on the dense path with dropout (and under context
        # parallelism) the full causal index, so the dropout bits come from the same counters on both paths
        # (switching paths never changes which probabilities drop); dense without dropout stays with SDPA.
        with host_ops():
            if path == "sparse":
                attend_index = index
            elif dropout_p > 0.0 or layout.splits_sequence:
                attend_index = BlockIndex.full(
                    batch,
                    self.num_kv_heads,
                    seq_len,
                    cfg.block_q,
                    cfg.block_k,
                    device=device,
                    document_ids=document_ids,
                    check="cheap" if check_values else "none",
                )
            else:
                attend_index = None

            # ---- backend and plan
            if attend_index is not None and record is None:
                backend, backend_reason = layout.backend(self, q, k, v, attend_index, document_ids)
                if path == "sparse" and backend == "reference" and backend_reason != "requested":
                    reason = f"reference_{backend_reason}"
            if profile:
                self._timings.mark("plan" + phase_suffix, 0, device)
            if attend_index is not None and backend == "triton" and plan is None:
                plan = layout.plan(attend_index, cfg.kernel_options.r0)
            if profile:
                self._timings.mark("plan" + phase_suffix, 1, device)
            if attend_index is not None and dropout_p > 0.0 and dropout_seed is None:
                dropout_seed = layout.dropout_seed(self._draw_dropout_seed)

        # ---- attention
        if profile:
            self._timings.mark("attn_fwd" + phase_suffix, 0, device)
            if first_pass and torch.is_grad_enabled():
                # the attention reads views of its inputs, on which the end of its backward is hooked: torch refuses
                # a multi-grad hook on leaf tensors under torch.autograd.grad (_hook_backward_timing)
                q, k, v = (t.view_as(t) if t.requires_grad else t for t in (q, k, v))
        lse = None
        if attend_index is None:
            # the kernel path checks these values inside sparse_attention
            check_seq_lens(seq_lens, batch, seq_len, q.device, values=check_values)
            check_document_ids(document_ids, batch, seq_len, q.device, values=check_values)
            o = dense_causal_attention(q, k, v, scale=scale, seq_lens=seq_lens, document_ids=document_ids)
        else:
            o, kernel_lse = layout.attention(
                self,
                q,
                k,
                v,
                attend_index,
                selected=path == "sparse",
                plan=plan,
                backend=backend,
                scale=scale,
                dropout_p=dropout_p,
                dropout_seed=dropout_seed,
                seq_lens=seq_lens,
                document_ids=document_ids,
                check_values=check_values,
            )
            lse = kernel_lse if path == "sparse" else None  # the sparse target reads the selection's lse
        if profile:
            self._timings.mark("attn_fwd" + phase_suffix, 1, device)
            if first_pass:  # the recomputed output gets no gradient of its own
                self._hook_backward_timing(q, k, v, o)

        # ---- distillation (selector-only gradients)
        loss = None
        if distill_now:
            mode = self._distill_mode(path)
            with host_ops(), selector_autograd():
                if mode == "sampled" and distill_blocks is None:
                    # drawn from the module's draw counter: under context parallelism the same global blocks
                    # on every rank
                    distill_blocks = self._draw_distill_blocks(geometry, device)
                row_scores = None
                if cfg.selector == "token" and mode == "sampled" and distill_queries is None:
                    # the indexer's query inputs of the sampled blocks: all its loss reads of the queries, and all
                    # a checkpoint record keeps of them
                    distill_queries = self.scorer.query_rows(pooled[0], distill_blocks.to(device), cfg.block_q)
                if cfg.selector == "token" and mode == "sampled" and cfg.resolved_selector_distill == "token":
                    # a checkpoint recompute passes back its first pass's forward statistics (distill_target); the
                    # rows here (query_blocks) against the keys of the whole sequence, and the count of every
                    # sampled block's rows (under context parallelism those of all ranks)
                    total, count, distill_target = self.scorer.token_distillation_loss(
                        distill_queries,
                        pooled[1],
                        q,
                        layout.gather(k.detach(), 2),
                        distill_blocks.to(device),
                        scale,
                        cfg.block_q,
                        seq_lens=seq_lens,
                        document_ids=document_ids,
                        stats=distill_target,
                        q_blocks=query_blocks,
                    )
                    loss = self._mean_kl(total, count)
                elif cfg.selector == "token" and mode == "sampled":

                    def row_scores(rows: Tensor) -> Tensor:
                        return self.scorer(
                            distill_queries,
                            pooled[1],
                            scale,
                            geometry,
                            rows,
                            seq_lens=seq_lens,
                            document_ids=document_ids,
                        )

                if loss is None:
                    loss, distill_target = layout.distillation_loss(
                        self,
                        q,
                        k,
                        scores,
                        index,
                        lse,
                        seq_lens,
                        scale,
                        geometry,
                        mode,
                        distill_blocks,
                        document_ids,
                        check_values,
                        distill_target,
                        row_scores,
                    )

        # ---- bookkeeping of the first pass only (a recompute must not count twice)
        if first_pass:
            self._count(reason)
            self._last_path = path
            self._last_index = index
            self.selector_loss = loss
            if metrics_now and index is not None:
                # drawn from the training-forward count: the same blocks at the same step, resumed or not
                generator = torch.Generator().manual_seed(self._training_calls)
                picks = sample_query_blocks(index.num_q_blocks, cfg.metrics_query_blocks, generator)
                with host_ops():
                    self._last_quality = selection_quality(
                        q, k, index, scale=scale, query_blocks=picks, seq_lens=seq_lens, document_ids=document_ids
                    )
            in_graph = torch.is_grad_enabled() and o.requires_grad
            if cfg.replay and not compiling and (in_graph or checkpoint_node is not None):
                # a reentrant recompute only attends: this forward's loss is already outside the checkpoint
                redistill = distill_now and checkpoint_node is None
                self._replay.remember(
                    SelectionRecord(
                        batch=batch,
                        seq_len=seq_len,
                        path=path,
                        reason=reason,
                        index=index,
                        plan=plan,
                        backend=backend,
                        dropout_seed=dropout_seed,
                        distilled=redistill,
                        distill_blocks=distill_blocks if redistill else None,
                        distill_target=distill_target if redistill else None,
                        # the token selector's sampled distillation reads the queries of its blocks only
                        pooled=(pooled if distill_queries is None else (None, pooled[1])) if redistill else None,
                        distill_queries=distill_queries if redistill else None,
                        document_ids=document_ids,
                    ),
                    anchors=[o, scores] if in_graph else [],
                    checkpoint_node=checkpoint_node,
                )
        return o

    def _kernel_options(self) -> dict:
        """The config's performance choices (``SparseAttentionConfig.kernel_options``) in the dict form of
        :func:`sparse_train.sparse_attention`'s ``kernel_options`` (both paths)."""
        return kernel_options_dict(self.config.kernel_options)

    def _distills_now(self, first_pass: bool, reentrant: bool = False) -> bool:
        """Whether this call computes the distillation loss (training with grad or in a reentrant checkpoint's
        first forward, ``distill`` on, every ``distill_every``-th training forward). A checkpoint recompute
        without a record repeats its first pass's answer, except after a reentrant first pass (``reentrant``),
        whose loss lies outside the checkpoint: its recompute does not distill."""
        if not first_pass:
            return self._last_distilled
        cfg = self.config
        distills = (
            cfg.distill != "off"
            and cfg.selector != "oracle"
            and self.training
            and (torch.is_grad_enabled() or reentrant)
            and self._training_calls % cfg.distill_every == 0
        )
        self._last_distilled = distills and not reentrant
        return distills

    def _draw_distill_blocks(self, geometry, device) -> Tensor:
        """This call's ``distill_query_blocks`` sampled query blocks: drawn on the device from the draw
        counter (no host read), which then advances."""
        draws = self.distill_draws
        blocks = draw_query_blocks(geometry.num_q_blocks, self.config.distill_query_blocks, draws.to(device))
        draws.add_(1)
        return blocks

    def _distill_mode(self, path: str) -> str:
        """The target this call distills from: ``"sparse"`` needs the sparse kernels' selection and
        lse, so on the dense path (warm-up, full selection) it becomes ``"sampled"``."""
        mode = self.config.distill
        return "sampled" if (mode == "sparse" and path == "dense") else mode

    def _distillation_loss(
        self,
        q,
        k,
        scores,
        index,
        lse,
        seq_lens,
        scale,
        geometry,
        mode,
        distill_blocks,
        document_ids=None,
        check_values=True,
        target=None,
        row_scores=None,
    ) -> tuple[Tensor, tuple]:
        """KL from the row-pooled attention-mass target to the selector's distribution, and the target
        (``(target, row_valid)``). ``target``: the first forward's, which a checkpoint recompute reuses (the
        target is detached and a function of the same q and k, so computing it again would only cost time).
        ``row_scores`` (optional): query block ids -> the selector's scores of those blocks with gradients, for
        a selector whose full ``scores`` were computed without them (``"sampled"`` only).

        ``distill_support="dynamic"`` restricts both to the blocks top-k chooses from (window and
        sinks are always selected, so ranking them teaches the selector nothing it uses). With packed
        documents the support is per batch row and excludes blocks of other documents, and the
        target is computed with the document mask."""
        support = self._distill_support(geometry, q.device, document_ids)
        if mode in ("dense", "sampled"):
            rows = None if mode == "dense" else distill_blocks.to(q.device)
            if target is None:
                target = self._dense_target(
                    q, k, rows, scale, seq_lens, document_ids, check_values
                )  # [B, HKV, S, NKB] twice
            if rows is not None:
                support = support.index_select(2, rows)
                scores = scores.index_select(2, rows) if row_scores is None else row_scores(rows)
            allowed = support
        else:
            if target is None:
                target = self._sparse_target(
                    q, k, index, lse, scale, seq_lens, document_ids, check_values
                )  # [B, HKV, NQB, K] twice
            scores, allowed = self._slot_scores(scores, index.indices, support)
        mass, row_valid = target
        return self._mean_kl(*self._kl_parts(mass, scores, allowed, row_valid)), target

    def _distill_support(self, geometry, device, document_ids) -> Tensor:
        """bool ``[1 or B, 1, NQB, NKB]``: the blocks the distillation KL is taken over
        (``distill_support``; per batch row with packed documents)."""
        cfg = self.config
        if cfg.distill_support == "dynamic":
            support = allowed_dynamic_blocks(geometry, cfg.window, cfg.sinks, device, document_ids)
        else:
            support = causal_block_mask(geometry, device)
            if document_ids is not None:
                support = support & allowed_dynamic_blocks(geometry, 0, 0, device, document_ids)
        return support.view(1, 1, *support.shape) if support.dim() == 2 else support.unsqueeze(1)

    def _dense_target(self, q, k, query_blocks, scale, seq_lens, document_ids, check_values):
        """The config's dense-attention target of ``query_blocks`` (None: every query block)."""
        cfg = self.config
        return dense_block_mass(
            q,
            k,
            block_q=cfg.block_q,
            block_k=cfg.block_k,
            scale=scale,
            seq_lens=seq_lens,
            rows_per_block=cfg.distill_query_rows,
            query_blocks=query_blocks,
            row_pool=cfg.distill_row_pool,
            chunk_mb=cfg.distill_chunk_mb,
            document_ids=document_ids,
            check_values=check_values,
        )

    def _sparse_target(self, q, k, index, lse, scale, seq_lens, document_ids, check_values):
        """The config's target over the slots of ``index`` (normalised by the main attention's ``lse``)."""
        cfg = self.config
        return sparse_block_mass(
            q,
            k,
            index,
            scale=scale,
            lse=lse,
            seq_lens=seq_lens,
            rows_per_block=cfg.distill_query_rows,
            row_pool=cfg.distill_row_pool,
            chunk_mb=cfg.distill_chunk_mb,
            document_ids=document_ids,
            check_values=check_values,
        )

    @staticmethod
    def _slot_scores(scores: Tensor, slot_blocks: Tensor, support: Tensor) -> tuple[Tensor, Tensor]:
        """The ``sparse`` target is per index slot: the selector's scores ``[B, HKV, R, NKB]`` at the slots'
        key blocks ``slot_blocks`` ``[B, HKV, R, K]`` (-1 = empty), and which slots the KL is taken over
        (filled and inside ``support`` ``[1 or B, 1, R, NKB]``)."""
        slots = slot_blocks.to(torch.int64).clamp(min=0)
        slot_support = support.expand(*slot_blocks.shape[:2], -1, -1).gather(-1, slots)
        return scores.gather(-1, slots), (slot_blocks >= 0) & slot_support

    def _mean_kl(self, total: Tensor, count: Tensor) -> Tensor:
        """The distillation loss: the KL sum over the valid rows divided by their count (under context
        parallelism the count of all ranks), weighted by ``distill_weight``."""
        return total / count.clamp(min=1).to(total.dtype) * self.config.distill_weight

    @staticmethod
    def _kl_parts(target, scores, allowed, row_valid) -> tuple[Tensor, Tensor]:
        """The KL sum and the valid-row count (:func:`block_kl_sum`) of the target renormalised over
        ``allowed``; rows whose target has no mass there are left out."""
        target = renormalise(torch.where(allowed, target, 0.0))
        row_valid = row_valid & (target.sum(dim=-1) > 0)
        return block_kl_sum(target, scores, allowed, row_valid)

    def _hook_backward_timing(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor) -> None:
        inputs = [t for t in (q, k, v) if t.requires_grad]
        if not o.requires_grad or not inputs:
            return
        device = o.device
        timings = self._timings

        def started(grad: Tensor) -> None:
            timings.mark("attn_bwd", 0, device)

        def finished(grads) -> None:
            timings.mark("attn_bwd", 1, device)

        o.register_hook(started)
        torch.autograd.graph.register_multi_grad_hook(inputs, finished, mode="all")
