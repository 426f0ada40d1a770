"""``SparseAttentionConfig``: every knob of :class:`sparse_train.SparseAttention` in one typed dataclass.

Each field carries an attribute docstring (shown by IDEs and ``help()``); ``__post_init__`` rejects
bad values with a ``ValueError`` that names the field, so a typo in a YAML recipe fails at start-up
rather than deep inside a training step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from .functional import BACKENDS
from .index.block_index import INDEX_CHECKS
from .kernels.reference.block_mass import ROW_POOLS as DISTILL_ROW_POOLS
from .kernels.reference.index_scores import BLOCK_SIZES as TOKEN_BLOCK_SIZES
from .kernels.reference.pool import ROPE_STYLES
from .options import KernelOptions, config_kernel_options
from .validation import check_bool, check_choice, check_float, check_int

__all__ = [
    "SparseAttentionConfig",
    "BACKENDS",
    "DISTILL_MODES",
    "DISTILL_ROW_POOLS",
    "DISTILL_SUPPORTS",
    "INDEX_CHECKS",
    "KEY_POOLINGS",
    "QUERY_POOLINGS",
    "ROPE_STYLES",
    "SELECTORS",
    "SELECTOR_DISTILLS",
    "TOKEN_BLOCK_SIZES",
]

DISTILL_MODES = ("sparse", "sampled", "dense", "off")
DISTILL_SUPPORTS = ("dynamic", "causal")
KEY_POOLINGS = ("mean", "mean_max")
QUERY_POOLINGS = ("mean", "mean_max")
SELECTORS = ("pooled", "token", "oracle")
SELECTOR_DISTILLS = ("block", "token")
CANDIDATES_PER_TOP_K = 2
"""``selector_candidates="auto"``: this many candidate key blocks per learned block (``top_k``)."""
CANDIDATES_MIN_SEQ_LEN = 8192
"""``selector_candidates="auto"``: sequences shorter than this score every block pair exactly. There the exact token
scores cost little next to the attention, and over eight seeds at 2K they keep more accuracy than candidates
(docs/benchmarks/selector_heldout, "Eight seeds at 2K")."""


# One line per field in __post_init__: the label is the field's qualified name, the value its attribute.
def _check_int(cfg: Any, name: str, **bounds: Any) -> None:
    check_int(f"SparseAttentionConfig.{name}", getattr(cfg, name), **bounds)


def _check_float(cfg: Any, name: str, **bounds: Any) -> None:
    check_float(f"SparseAttentionConfig.{name}", getattr(cfg, name), **bounds)


def _check_bool(cfg: Any, name: str) -> None:
    check_bool(f"SparseAttentionConfig.{name}", getattr(cfg, name))


def _check_choice(cfg: Any, name: str, choices: tuple[str, ...]) -> None:
    check_choice(f"SparseAttentionConfig.{name}", getattr(cfg, name), choices)


@dataclass
class SparseAttentionConfig:
    """Configuration of one learned block-sparse attention layer (selector, kernels, fallbacks)."""

    block_q: int = 64
    """Query block size BQ: queries are grouped in blocks of this many rows; one selection per block."""

    block_k: int = 64
    """Key block size BK: the unit the selector scores and the kernels load."""

    top_k: int = 16
    """Learned (dynamic) key blocks per query block, chosen among the causal blocks that the window and
    sinks do not already cover; the selection holds at most ``top_k + window + sinks`` blocks."""

    top_p: float | None = None
    """Adaptive budget: ``None`` = every query block takes its ``top_k`` best dynamic blocks. A float in
    (0, 1] = each query block takes the fewest of its ``top_k`` best blocks whose mass *predicted by
    the selector* (softmax of its scores over the blocks it chooses from) reaches ``top_p``; ``top_k``
    is then the cap, so the index keeps its capacity and density can only drop. Rows with one
    dominant block stop early, rows with spread attention take up to the cap. ``1.0`` selects what
    ``None`` selects."""

    window: int = 8
    """Local window in key blocks: the block holding the query block's last query and the
    ``window - 1`` blocks before it are always selected."""

    sinks: int = 1
    """Attention-sink blocks: key blocks ``0 .. sinks-1`` are always selected (clipped to causal)."""

    selector: str = "token"
    """How key blocks are scored for the top-k:

    - ``"token"`` (the default): a token-level indexer. Every query row and every key gets small learned index
      vectors (``selector_index_heads`` heads of width ``selector_dim`` per query row, one of width ``selector_dim``
      per key); a (query block, key block) pair scores the largest index logit over its causal (row, key) pairs, so
      a single key that matters to a single row decides the block's rank. Cost O(N^2 E S / 2) in one fused kernel,
      no N x N tensor, or less with ``selector_candidates``. Its blocks ``block_q`` and ``block_k`` are 16, 32, 64
      or 128 (:data:`TOKEN_BLOCK_SIZES`); other block sizes take ``"pooled"``.
    - ``"pooled"``: learned projections of block summaries (mean and max of each block's queries and keys,
      ``query_pooling`` / ``key_pooling``); cost O(N D + NQB NKB S), any block size. It is the cheaper selector and
      keeps less of the oracle's accuracy on held-out retrieval tasks (docs/benchmarks/selector_heldout).
    - ``"oracle"``: the true dense attention mass of each key block, max over the query block's rows and GQA heads
      (the distillation target itself), same budget. Diagnostic: it computes dense attention scores (O(N^2 D)) and
      has nothing to train; comparing a model's accuracy under ``"oracle"`` and under a learned selector tells
      whether a gap is the selector's. The oracle ranks by attention mass, which need not be what an answer reads:
      it can fall below a learned selector (README, "Selector").

    The learned selectors' weights differ in kind: a state dict of one does not load into the other (the error
    names the selector to pass)."""

    selector_dim: int = 32
    """Width S of the selector's per-KV-head projections: of the pooled queries and keys (``"pooled"``), or of
    each index head and index key (``"token"``)."""

    selector_index_heads: int = 1
    """Index heads E per KV head of the ``"token"`` selector: each query row gets E index vectors, projected from
    the concatenated queries of its GQA group; a block pair scores the max over rows, index heads and keys."""

    selector_distill: str = "token"
    """What the ``"token"`` selector's distillation compares under ``distill="sampled"``: ``"token"`` (the default) =
    for every row of the sampled query blocks, the softmax over keys of its index logits (max over index heads)
    against the row's dense attention over keys (max over the GQA group's heads, renormalised), a KL per row;
    ``"block"`` = its block scores against the row-max block mass, as every selector. The token-level loss reaches
    every key's index vector, where the block loss reaches only each block pair's winning (row, key). Every other
    case trains by the block-level KL whatever this field says: the ``"pooled"`` selector, and the token selector
    under ``distill="dense"`` or ``"sparse"`` (on every path, warm-up included); the ``"oracle"`` trains nothing
    (:attr:`resolved_selector_distill`)."""

    selector_candidates: int | None | Literal["auto"] = "auto"
    """Candidate key blocks per query block of the ``"token"`` selector. ``"auto"`` (the default) =
    ``2 * top_k`` (:data:`CANDIDATES_PER_TOP_K`) on sequences of at least :data:`CANDIDATES_MIN_SEQ_LEN` tokens
    where candidates apply (``selector="token"``, ``selector_distill="token"``, ``distill`` ``"sampled"`` or
    ``"off"``, ``top_k`` >= 1), else ``None``; :meth:`selector_candidates_at` (from
    :attr:`resolved_selector_candidates` and :attr:`resolved_selector_candidates_min_len`) is what applies to a
    sequence. ``None``: every causal block pair gets its exact token score. An int C >= ``top_k`` (only where
    candidates apply; elsewhere a ``ValueError``), at every length: each query block ranks its dynamic key blocks
    (causal, neither window nor sink) by an upper bound of their token score (per row, the index query against the
    element-wise max and min of the block's index keys: BQ products of width 2S per pair instead of BQ x BK of width
    S), and only the C best bounded get their exact score; top-k picks among those
    (:mod:`sparse_train.selection.candidates`; Triton kernels on CUDA, their PyTorch references elsewhere). A
    sequence with at most C key blocks scores every pair exactly. The block-level KLs need every pair's score, hence
    the requirements. The accuracy and cost of candidates against exact scores: docs/benchmarks/selector_heldout."""

    selector_rope_style: str = "rotate_half"
    """RoPE convention of the q and k this layer receives, for the selector's un-rotation
    (``selector_rope_theta`` or ``SparseAttention.set_rope``): ``"rotate_half"`` turns channel pairs
    ``(i, i + R/2)`` (Hugging Face Llama / Qwen / Mistral, this package's ``Transformer``); ``"interleaved"`` turns
    pairs ``(2i, 2i + 1)`` (torchtune, Meta's reference Llama, GPT-J). Un-rotating with the wrong convention
    does not fail: it silently scrambles the content the selector compares."""

    key_pooling: str = "mean_max"
    """Key-block summary the selector scores: ``"mean_max"`` = the block's mean key and its
    element-wise max (a single key that stands out survives the max, while the mean dilutes it 1/BK;
    measured on 4K retrieval: needle-task accuracy 1.00 vs 0.76 with the mean alone), or ``"mean"``."""

    query_pooling: str = "mean_max"
    """Query-block summary the selector scores: ``"mean_max"`` = the mean query of the block's rows (and
    of the GQA group's heads) and the element-wise max over the block's rows of the group's mean query;
    ``"mean"`` = the mean alone. The few rows that need a distant block (the question of a retrieval task) are 1/BQ of
    the mean but can set the max. Measured on 16K hard retrieval (H200, 4 seeds, sparse and dense
    continuations branched from one checkpoint per seed): sparse reached 0.991x the dense branch with
    ``"mean_max"`` against 0.927x with ``"mean"`` (docs/benchmarks/selector_quality.md)."""

    selector_rope_theta: float | None = None
    """RoPE base of the q and k this layer receives (over the whole head dim, in the ``selector_rope_style``
    convention).
    When set, the selector un-rotates q and k before pooling, so its block scores compare content and
    do not depend on absolute position. ``None`` = pool the rotated q and k as given. The Hugging Face
    integration sets the model's exact frequencies itself (``SparseAttention.set_rope``)."""

    selector_distance_bias: bool = True
    """Add a learned bias per KV head and log2 bucket of block distance to the selector's scores
    (starts at zero): lets content-only scores (``selector_rope_theta``) keep a head's recency. The block-level KL
    trains it; the token selector trained by the token-level KL alone (``selector_distill="token"`` with
    ``distill`` ``"sampled"`` or ``"off"``, the defaults) has none, since that loss compares index logits over keys
    and never reads it (:attr:`resolved_selector_distance_bias`)."""

    selector_lr_multiplier: float = 10.0
    """The selector learns this many times faster than the model under one Adam-type optimizer and
    one learning rate: its weights are stored divided by the multiplier and multiplied back in the
    forward (a reparametrisation; under plain SGD the factor is squared). 10x was measured to be
    needed for the selector to keep up with the model's moving attention; 1.0 = the model's pace.
    A state dict saved with another multiplier loads at this one, its selector weights rescaled to
    the same effective weights bit for bit; a ratio that is not a power of two raises ValueError.
    In [2**-100, 2**100]: the float32 weights stored divided by it and their gradients multiplied by it
    stay inside float32's range (at the extremes of (0, inf) they become 0, inf or NaN)."""

    dense_warmup_steps: int = 500
    """Run dense causal attention for the first this-many training forwards while the selector
    distills from it (its target then covers every causal block), then switch to sparse attention and
    keep distilling. Measured on the 4K retrieval demo (480 steps): no warm-up reaches 0.86 of the
    dense twin's accuracy, a 400-step warm-up 0.98-1.0; a selector that has never seen where the
    trained attention looks cannot pick it. The count is a buffer in the state dict
    (``selector_steps``), so a resumed run continues where it stopped; eval forwards during the
    warm-up are dense too. 0 = sparse from the first step (a selector loaded from a checkpoint)."""

    dropout_p: float = 0.0
    """Dropout on attention probabilities during training, in [0, 1) (ignored in eval mode). The bits
    come from counters over (seed, batch, head, query, key), also on the dense path (warm-up, full
    selection), which then runs the kernels on the full causal index instead of SDPA: switching paths
    never changes which probabilities drop."""

    scale: float | None = None
    """Logit scale; ``None`` = ``1 / sqrt(head_dim)``. Also scales the selector logits."""

    backend: str = "auto"
    """Kernel backend: ``"auto"`` (Triton on supported CUDA input, reference otherwise),
    ``"triton"`` or ``"reference"``."""

    deterministic: bool = False
    """Bitwise-reproducible gradients (every dK/dV block KV-centric, no atomics)."""

    kernel_options: KernelOptions | None = None
    """The kernels' performance choices: a :class:`~sparse_train.KernelOptions`, or a dict of its fields (a YAML
    recipe's mapping), as ``kernel_options`` of :func:`sparse_train.sparse_attention`; ``None`` = every kernel's
    default. Among them the reuse threshold ``r0`` of the hybrid backward, tiles, warps and stages, TMA loads,
    the Gluon kernels (``fwd_gluon`` / ``dq_gluon`` / ``kv_gluon``) and the fused or stored-dS backward
    (``fused_dq`` / ``stored_ds``). They never change a result beyond floating-point order. ``plan`` is refused
    here: the module builds each step's plan from that step's index."""

    distill: str = "sampled"
    """Selector training target: ``"sampled"`` = dense attention mass on all causal blocks for
    ``distill_query_blocks`` randomly sampled query blocks per step (exact for those rows, cost linear
    in N; it pulls up blocks the selector currently misses); ``"sparse"`` = mass on the *selected*
    blocks only (renormalised over them, from the kernel's lse, no dense attention at all; it can
    only re-rank what is already selected, never find a missed block); ``"dense"`` = every query
    block on every causal block (exact, chunked N x N; for converting a dense model at short N);
    ``"off"``. On the dense path (warm-up, full selection) "sparse" uses the sampled target."""

    distill_row_pool: str = "max"
    """How the rows (and GQA heads) of a query block are pooled into its target: ``"max"`` = each key
    block's largest single-row attention mass, renormalised (a block one row needs ranks high);
    ``"mean"`` = the block's average mass (buries the few rows that do the work)."""

    distill_support: str = "dynamic"
    """Blocks the KL is taken over: ``"dynamic"`` = only the causal blocks top-k chooses from (not
    the window and sink blocks, which are always selected; the target is renormalised over the rest),
    so the selector spends its capacity on the ranking that matters; ``"causal"`` = every causal block."""

    distill_weight: float = 1.0
    """Multiplier of the KL distillation loss reported as ``selector_loss``."""

    distill_every: int = 1
    """Compute the distillation loss on every n-th training forward (1 = every step)."""

    distill_query_rows: int | None = None
    """Query rows per query block used for the distillation target: ``None`` = all BQ rows (exact
    pooled mass); an int takes that many evenly spaced rows (an unbiased, cheaper estimate)."""

    distill_query_blocks: int = 8
    """Query blocks sampled per step by ``distill="sampled"`` (fresh random blocks every step)."""

    distill_chunk_mb: int = 1024
    """Memory budget (MiB) of one chunk of fp32 logits while computing distillation targets."""

    replay: bool = True
    """Reuse the first forward's selection (index, plan, path, dropout seed) when activation
    checkpointing recomputes the forward, so the backward sees exactly the forward's function."""

    dense_fallback: bool = True
    """Run dense causal SDPA instead of the sparse kernels when the selection is (nearly) full;
    see ``dense_enter_density`` / ``dense_exit_density``."""

    dense_enter_density: float = 0.9
    """Hysteresis: switch to the dense path when the selected fraction of causal blocks is >= this.
    A full selection (fraction 1.0) always takes the dense path when ``dense_fallback`` is on."""

    dense_exit_density: float = 0.8
    """Hysteresis: leave the dense path only once the selected fraction drops to <= this.
    Set both thresholds to 1.0 to take the dense path for full selections only (always exact)."""

    index_check: str = "none"
    """Validation level passed to ``BlockIndex.from_selection`` for the selector's own candidates:
    ``"none"`` (they are valid by construction and checks cost a device sync), ``"cheap"``, ``"full"``.
    On CUDA it also decides whether the *values* of ``seq_lens`` / ``document_ids`` are checked
    (``"none"``: not, so a training step never waits on the device; CPU tensors are always checked)."""

    metrics_every: int = 0
    """Every n-th training forward, measure the attention-mass recall (per query row, the share of
    its dense attention inside the selected blocks; mean and 5th percentile over rows) on sampled
    query blocks; 0 = never."""

    metrics_query_blocks: int = 8
    """Number of query blocks sampled per metrics measurement."""

    profile: bool = False
    """Time selector, plan, attention forward and backward of the last step (CUDA events on GPU,
    ``perf_counter`` on CPU); reported by ``stats()`` under ``time/...``. Under activation checkpointing the
    recompute's phases are reported apart, as ``time/<phase>_recompute_ms``."""

    def __post_init__(self) -> None:
        for name in (
            "block_q",
            "block_k",
            "selector_dim",
            "selector_index_heads",
            "distill_every",
            "distill_query_blocks",
            "distill_chunk_mb",
            "metrics_query_blocks",
        ):
            _check_int(self, name, minimum=1)
        for name in ("top_k", "window", "sinks", "metrics_every", "dense_warmup_steps"):
            _check_int(self, name, minimum=0)
        if self.top_k + self.window + self.sinks == 0:
            raise ValueError("SparseAttentionConfig: top_k + window + sinks must be > 0 (nothing would be selected)")
        _check_int(self, "distill_query_rows", minimum=1, optional=True)
        if self.distill_query_rows is not None and self.distill_query_rows > self.block_q:
            raise ValueError(
                f"SparseAttentionConfig.distill_query_rows={self.distill_query_rows} exceeds block_q={self.block_q}"
            )
        _check_float(self, "dropout_p", minimum=0.0, exclusive_maximum=1.0)
        _check_float(self, "scale", exclusive_minimum=0.0, optional=True)
        _check_float(self, "selector_rope_theta", exclusive_minimum=0.0, optional=True)
        _check_float(self, "top_p", exclusive_minimum=0.0, maximum=1.0, optional=True)
        _check_float(self, "distill_weight", minimum=0.0)
        _check_float(self, "selector_lr_multiplier", minimum=2.0**-100, maximum=2.0**100)
        _check_choice(self, "backend", BACKENDS)
        _check_choice(self, "distill", DISTILL_MODES)
        _check_choice(self, "distill_row_pool", DISTILL_ROW_POOLS)
        _check_choice(self, "distill_support", DISTILL_SUPPORTS)
        _check_choice(self, "selector", SELECTORS)
        if self.selector == "token":
            for name in ("block_q", "block_k"):
                if getattr(self, name) not in TOKEN_BLOCK_SIZES:
                    raise ValueError(
                        f"SparseAttentionConfig.{name} must be one of {TOKEN_BLOCK_SIZES} with selector='token' (the "
                        f"default; the token indexer's kernels), got {getattr(self, name)!r}; pass selector='pooled' "
                        "for other block sizes"
                    )
        _check_choice(self, "selector_rope_style", ROPE_STYLES)
        _check_choice(self, "selector_distill", SELECTOR_DISTILLS)
        _check_choice(self, "key_pooling", KEY_POOLINGS)
        _check_choice(self, "query_pooling", QUERY_POOLINGS)
        _check_choice(self, "index_check", INDEX_CHECKS)
        candidates = self.selector_candidates
        auto = isinstance(candidates, str) and candidates == "auto"
        if not auto:
            try:
                _check_int(self, "selector_candidates", minimum=1, optional=True)
            except ValueError:
                raise ValueError(
                    "SparseAttentionConfig.selector_candidates must be a positive int, None or 'auto', got "
                    f"{candidates!r}"
                ) from None
        if not auto and candidates is not None:
            if not self._token_kl_only:
                raise ValueError(
                    "SparseAttentionConfig.selector_candidates needs selector='token', selector_distill='token' and "
                    "distill 'sampled' or 'off' (the block-level KLs score every pair), got "
                    f"selector={self.selector!r}, selector_distill={self.selector_distill!r}, "
                    f"distill={self.distill!r}; pass selector_candidates='auto' or None for exact scores"
                )
            if self.selector_candidates < self.top_k:
                raise ValueError(
                    f"SparseAttentionConfig.selector_candidates={self.selector_candidates} must be >= "
                    f"top_k={self.top_k} (top-k picks among the candidates)"
                )
        _check_float(self, "dense_enter_density", minimum=0.0, maximum=1.0)
        _check_float(self, "dense_exit_density", minimum=0.0, maximum=1.0)
        lo, hi = self.dense_exit_density, self.dense_enter_density
        if not lo <= hi:
            raise ValueError(
                "SparseAttentionConfig needs 0 <= dense_exit_density <= dense_enter_density <= 1 "
                f"(hysteresis band), got exit={lo!r}, enter={hi!r}"
            )
        for name in (
            "replay",
            "dense_fallback",
            "profile",
            "deterministic",
            "selector_distance_bias",
        ):
            _check_bool(self, name)
        self.kernel_options = config_kernel_options(self.kernel_options, self.deterministic)

    @property
    def _token_kl_only(self) -> bool:
        """Whether the token selector trains by the token-level KL alone (or not at all): no block-level KL then
        reads the scores of every pair (so candidates may stand for them) or the distance bias."""
        return self.selector == "token" and self.selector_distill == "token" and self.distill in ("sampled", "off")

    @property
    def resolved_selector_distill(self) -> str:
        """The selector's distillation loss: ``"token"`` (the token-level KL) for the token selector with
        ``selector_distill="token"`` and ``distill`` ``"sampled"`` or ``"off"``, ``"block"`` (the block-level KL)
        for every other config; the module reads this, not ``selector_distill``."""
        return "token" if self._token_kl_only else "block"

    @property
    def resolved_selector_distance_bias(self) -> bool:
        """Whether the selector has the distance bias: ``selector_distance_bias``, except for the token selector
        trained by the token-level KL alone, which that loss never reads (a parameter nothing trains, and one DDP
        without ``find_unused_parameters`` would report)."""
        return self.selector_distance_bias and not self._token_kl_only

    @property
    def resolved_selector_candidates(self) -> int | None:
        """The candidate blocks per query block that ``selector_candidates`` stands for: the int as given,
        ``None`` (exact scores) as given, and ``"auto"`` resolved (the shortest sequence they apply to:
        :attr:`resolved_selector_candidates_min_len`). With :attr:`resolved_selector_candidates_min_len`, the only
        reader of ``"auto"``.

        ================================================================  =================
        ``selector`` / ``selector_distill`` / ``distill`` / ``top_k``     ``"auto"`` gives
        ================================================================  =================
        ``"token"`` / ``"token"`` / ``"sampled"`` or ``"off"`` / >= 1      ``2 * top_k``
        ``"token"`` / ``"token"`` / ``"sparse"`` or ``"dense"`` / any      ``None``
        ``"token"`` / ``"block"`` / any / any                              ``None``
        ``"pooled"`` or ``"oracle"`` / any / any / any                     ``None``
        any / any / any / 0                                                ``None``
        ================================================================  =================
        """
        value = self.selector_candidates
        if isinstance(value, str):  # "auto", the one string __post_init__ lets through
            return CANDIDATES_PER_TOP_K * self.top_k if self._token_kl_only and self.top_k >= 1 else None
        return value

    @property
    def resolved_selector_candidates_min_len(self) -> int:
        """The shortest sequence (tokens) on which :attr:`resolved_selector_candidates` applies; shorter ones score
        every pair exactly. :data:`CANDIDATES_MIN_SEQ_LEN` for ``"auto"``, 0 for a count given (and for ``None``,
        where nothing applies)."""
        return CANDIDATES_MIN_SEQ_LEN if isinstance(self.selector_candidates, str) else 0

    def selector_candidates_at(self, seq_len: int) -> int | None:
        """The candidate blocks per query block on a sequence of ``seq_len`` tokens: ``None`` (exact scores) below
        :attr:`resolved_selector_candidates_min_len`, else :attr:`resolved_selector_candidates`."""
        return None if seq_len < self.resolved_selector_candidates_min_len else self.resolved_selector_candidates

    @property
    def capacity(self) -> int:
        """Most blocks one query block can select: ``top_k + window + sinks``."""
        return self.top_k + self.window + self.sinks

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for logging / hparams; ``kernel_options`` as a dict of its set fields, so
        ``SparseAttentionConfig(**config.to_dict())`` is the same config)."""
        out = asdict(self)
        out["kernel_options"] = {k: v for k, v in out["kernel_options"].items() if v is not None} or None
        return out
