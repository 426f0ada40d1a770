"""A small decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU) whose attention core is swappable.

The attention core is either ``st.SparseAttention`` (learned block-sparse, the product) or dense causal
SDPA (the A/B twin). Everything outside the core (projections, RoPE, norms, MLP) is identical between the
two, so a sparse and a dense model built from the same config share every parameter name except the
selector's, which lets a dense checkpoint initialise a sparse model (the fine-tuning pipeline).

Packed rows: ``Transformer.forward(tokens, document_ids=ids)`` (int ``[B, N]``, non-decreasing per row)
makes every token attend only its own document, in both cores, and restarts the RoPE positions at 0
for every document (the usual convention of packing with document masking), so a packed row computes
what each document alone would.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import sparse_train as st

from ..documents import document_positions
from ..functional import dense_causal_attention
from ..losses import DEFAULT_CHUNK_TOKENS, LMLoss, labelled_head_loss
from ..module.checkpointing import checkpoint_kwargs
from ..parallel import context_parallel as cpm
from ..tasks import IGNORE_INDEX
from ..validation import check_bool, check_choice, check_document_ids, check_float, check_int, check_keys

__all__ = ["LMLoss", "TransformerConfig", "Transformer", "RMSNorm"]


@dataclass
class TransformerConfig:
    """Shape and attention choice of :class:`Transformer`."""

    vocab_size: int = 256
    """Number of token ids the embedding accepts (must cover the data module's ``vocab_size``)."""
    d_model: int = 128
    """Residual stream width."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per block (HQ)."""
    n_kv_heads: int = 2
    """Key/value heads per block (HKV); must divide ``n_heads`` (grouped-query attention)."""
    head_dim: int | None = None
    """Per-head width D; ``None`` means ``d_model // n_heads``."""
    ffn_hidden: int | None = None
    """SwiGLU hidden width; ``None`` means 8/3 * d_model rounded up to a multiple of 64."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection (saves parameters at small scale)."""
    attention: Literal["sparse", "dense"] = "sparse"
    """Attention core: ``sparse`` = ``st.SparseAttention``; ``dense`` = causal SDPA (the A/B twin)."""
    sparse: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``st.SparseAttentionConfig`` (ignored when ``attention`` is ``dense``)."""
    selector_unrotates_rope: bool = True
    """Give the sparse selector this model's RoPE (``selector_rope_theta = rope_theta`` unless ``sparse``
    sets it), so it scores un-rotated q and k; False scores the rotated ones (the 16K ablation)."""
    activation_checkpointing: bool = False
    """Recompute each block in the backward (saves activation memory; the module replays selections)."""
    checkpoint_keeps_attention: bool = False
    """With ``activation_checkpointing``: keep each block's attention output from the first forward and recompute
    only the rest of the block (:mod:`sparse_train.module.checkpointing`; both cores). Costs ``B * N * HQ * (D * 2 +
    4)``
    bytes per block in bf16 (64K tokens, 32 heads of 64: 272 MB), saves an attention forward per block and step.
    Off by default: the sparse forward is cheap to recompute (the step gains little for a few GiB more), while
    a dense core gains much more."""
    compile_pointwise: bool | Literal["auto"] = "auto"
    """Run the elementwise parts of the model (RMSNorm, RoPE, the SwiGLU gate) as ``torch.compile``'d functions:
    each becomes one fused kernel forward and one backward instead of a chain of eager float32 elementwise
    kernels, which makes a long-context training step measurably faster, the sparse one most (its attention is
    a small share of the step). Matmuls and the attention core stay eager. ``"auto"`` (default): compiled
    when the activations are on a CUDA device and inductor has Triton there, eager elsewhere (on the CPU
    inductor would need a C++ compiler and gains little); True / False force it. The first step on the GPU
    pays the compilation (seconds)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Rows of logits alive at a time when ``forward`` gets ``labels`` (the training loss): the head's logits
    of at most this many labelled positions exist at once (8,192 x 32,000 float32 = 1 GiB), never all N."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads"):
            check_int(f"TransformerConfig.{name}", getattr(self, name), minimum=1)
        # Checked here rather than left to ``x or default``: 0 would silently mean "default".
        check_int("TransformerConfig.head_dim", self.head_dim, minimum=1, optional=True)
        check_int("TransformerConfig.ffn_hidden", self.ffn_hidden, minimum=1, optional=True)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"TransformerConfig.n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention)"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"TransformerConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set head_dim"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(
                f"TransformerConfig: the head dim must be even for RoPE (it rotates pairs), got "
                f"{self.resolved_head_dim} (head_dim={self.head_dim}, d_model={self.d_model}, "
                f"n_heads={self.n_heads})"
            )
        check_float("TransformerConfig.rope_theta", self.rope_theta, exclusive_minimum=0.0)
        check_float("TransformerConfig.norm_eps", self.norm_eps, exclusive_minimum=0.0)
        check_float("TransformerConfig.init_std", self.init_std, minimum=0.0)
        check_int("TransformerConfig.loss_chunk_tokens", self.loss_chunk_tokens, minimum=1)
        check_bool("TransformerConfig.tie_embeddings", self.tie_embeddings)
        check_bool("TransformerConfig.activation_checkpointing", self.activation_checkpointing)
        check_choice("TransformerConfig.compile_pointwise", self.compile_pointwise, (True, False, "auto"))
        check_bool("TransformerConfig.checkpoint_keeps_attention", self.checkpoint_keeps_attention)
        check_bool("TransformerConfig.selector_unrotates_rope", self.selector_unrotates_rope)
        check_choice("TransformerConfig.attention", self.attention, ("sparse", "dense"))
        if self.attention == "sparse":
            check_keys("TransformerConfig.sparse", self.sparse, st.SparseAttentionConfig.__dataclass_fields__)
            st.SparseAttentionConfig(**self.sparse)  # its own __post_init__ names a bad value

    @property
    def resolved_head_dim(self) -> int:
        """Per-head width D actually used: ``head_dim``, or ``d_model // n_heads`` when it is None."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads


# A Lightning checkpoint of SparseLMModule stores this config among its hyperparameters. torch.load's default
# weights-only unpickler (torch >= 2.6) refuses classes it does not know, so `load_from_checkpoint` failed on
# every checkpoint the recipes write; the config holds plain data only, so it may be rebuilt safely.
torch.serialization.add_safe_globals([TransformerConfig])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, cast to ``out_dtype`` when given."""
    # Normalise in fp32 so bf16 activations do not lose the small-variance tail.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = xf.type_as(x) * weight
    return out if out_dtype is None else out.to(out_dtype)


def add_rms_norm(
    x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + update, rms_norm(x + update))``: a residual add and the norm that reads its sum (one kernel each
    way when compiled, instead of an add, a norm and, in the backward, the sum of the two gradients)."""
    total = x + update
    return total, rms_norm(total, weight, eps, out_dtype)


def swiglu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


_COMPILED: dict[Any, Any] = {}


@functools.cache
def inductor_has_triton() -> bool:
    """Whether inductor can generate Triton kernels here (a CUDA device Triton supports, Triton installed)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # a torch build without the helper: no inductor GPU backend to rely on
        return False
    return bool(has_triton())


def compiles_pointwise(setting: bool | str, device: torch.device) -> bool:
    """Whether ``TransformerConfig.compile_pointwise`` = ``setting`` compiles for activations on ``device``:
    True / False as given; ``"auto"`` on a CUDA device where inductor has Triton (:func:`inductor_has_triton`;
    without it "auto" stays eager instead of failing at the first step)."""
    if setting == "auto":
        return device.type == "cuda" and inductor_has_triton()
    return setting


def pointwise(fn, compiled: bool | str, like: torch.Tensor):
    """``fn``, or its ``torch.compile(fullgraph=True)`` version (one per function, shared by every module: the
    compiled code and its guards are built once) when :func:`compiles_pointwise` says so for ``like``'s device
    (``like``: an input of the call). Inside a graph ``torch.compile`` is already tracing (the user compiled the
    whole model) ``fn`` itself: the outer compilation fuses it."""
    if not compiles_pointwise(compiled, like.device) or torch.compiler.is_compiling():
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True)
    return _COMPILED[fn]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5, compiled: bool | str = False) -> None:
        super().__init__()
        self.eps = eps
        self.compiled = compiled
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, update: torch.Tensor | None = None):
        """The norm of ``x``; with ``update`` the pair ``(x + update, norm of x + update)`` (a pre-norm block's
        residual add fused with the next norm).

        Under autocast the norm is in the autocast dtype: every consumer is a matmul that would cast it (the
        attention's q/k/v projections, the MLP's gate and up, the LM head), and one cast here replaces one
        per consumer in the forward and their float32 gradients and sums in the backward (1.1B model at 64K:
        20 float32 [N, d_model] casts per block and step). The values the matmuls see are unchanged; the
        consumers' input gradients are summed in the autocast dtype."""
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        if update is None:
            return pointwise(rms_norm, self.compiled, x)(x, self.weight, self.eps, out_dtype)
        return pointwise(add_rms_norm, self.compiled, x)(x, update, self.weight, self.eps, out_dtype)


def _rope_tables(seq_len: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos(), freqs.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate-half convention (as in Llama): pairs are (i, i + D/2).
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2].float(), x[..., d2:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Multi-head attention with GQA and RoPE; the score/softmax/value core is sparse or dense."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.resolved_head_dim
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.compiled = cfg.compile_pointwise
        self.core: nn.Module | None = None
        if cfg.attention == "sparse":
            self.core = st.SparseAttention(
                st.SparseAttentionConfig(**self._sparse_kwargs(cfg)),
                num_heads=self.n_heads,
                num_kv_heads=self.n_kv_heads,
                head_dim=self.head_dim,
            )
        elif cfg.attention != "dense":  # a config mutated after its checks ran
            raise ValueError(f"attention must be 'sparse' or 'dense', got {cfg.attention!r}")
        # Context parallelism of the dense core (sparse_train.parallel.context_parallel.enable_context_parallel; the
        # sparse core has its own): None = the whole sequence is here.
        self.context_parallel_group = None
        self.context_parallel_backend: str | None = None

    @staticmethod
    def _sparse_kwargs(cfg: TransformerConfig) -> dict[str, Any]:
        own_rope = {"selector_rope_theta": cfg.rope_theta} if cfg.selector_unrotates_rope else {}
        return {**own_rope, **cfg.sparse}

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``cos``/``sin`` ``[N, D/2]`` or ``[B, 1, N, D/2]`` (per-row positions); ``positions`` the
        RoPE positions they were built from (for the selector's un-rotation), None = ``0..N-1``."""
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rope = pointwise(_apply_rope, self.compiled, q)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.core is not None:
            o = self.core(q, k, v, seq_lens=seq_lens, document_ids=document_ids, position_ids=positions)
        elif self.context_parallel_group is not None:
            o = self._dense_context_parallel(q, k, v, document_ids)
        else:
            # Right padding needs no key mask here: padded keys sit after every real query.
            o = dense_causal_attention(q, k, v, scale=self.head_dim**-0.5, document_ids=document_ids)
        return self.wo(o.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))

    def _dense_context_parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The dense core under context parallelism: exact dense causal attention of the local rows over the
        all-gathered keys (:func:`~sparse_train.parallel.context_parallel.context_parallel_dense_attention`), on
        blocks of ``gcd(N / (2W), 64)`` rows (whole chunks of the zig-zag layout)."""
        group = self.context_parallel_group
        _, world = cpm.context_parallel_rank(group)
        block = math.gcd(q.shape[2] // 2, 64) if q.shape[2] % 2 == 0 else 1
        return cpm.context_parallel_dense_attention(
            q,
            k,
            v,
            block_q=block,
            block_k=block,
            group=group,
            scale=self.head_dim**-0.5,
            document_ids=document_ids,
            backend=self.context_parallel_backend or "reference",
        )


class SwiGLU(nn.Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, hidden: int, compiled: bool | str = False) -> None:
        super().__init__()
        self.compiled = compiled
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(pointwise(swiglu_gate, self.compiled, x)(self.gate(x), self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_hidden if cfg.ffn_hidden is not None else 64 * math.ceil(cfg.d_model * 8 / 3 / 64)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.compile_pointwise)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.compile_pointwise)
        self.mlp = SwiGLU(cfg.d_model, hidden, cfg.compile_pointwise)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        update = self.attn(self.attn_norm(x), cos, sin, seq_lens, document_ids, positions)
        x, normed = self.mlp_norm(x, update)
        return x + self.mlp(normed)


class Transformer(nn.Module):
    """Decoder-only language model returning logits ``[B, N, vocab]``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(cfg, TransformerConfig):
            raise ValueError(
                f"Transformer needs a TransformerConfig, got {type(cfg).__name__} "
                "(build one with TransformerConfig(**mapping))"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.compile_pointwise)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope_cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None
        # Context parallelism (sparse_train.parallel.context_parallel.enable_context_parallel): tokens are this rank's
        # zig-zag shard and RoPE turns them at their global positions. None = the whole sequence is here.
        self.context_parallel_group = None
        self.context_parallel_backend: str | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2 or ".core." in name:
                continue  # norms keep gain 1; the selector owns its own init
            # Residual-output projections are scaled down with depth so the stream does not grow.
            scale = 1.0 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "down.weight")) else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)

    def rope(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached RoPE cos/sin tables for positions ``0..n-1``."""
        head_dim = self.cfg.resolved_head_dim
        c = self._rope_cache
        if c is None or c[0] < n or c[1] != device:
            cos, sin = _rope_tables(max(n, c[0] if c else 0), head_dim, self.cfg.rope_theta, device)
            self._rope_cache = c = (cos.shape[0], device, cos, sin)
        return c[2][:n], c[3][:n]

    def sparse_cores(self) -> list[nn.Module]:
        """The ``st.SparseAttention`` modules (empty for a dense model)."""
        return [b.attn.core for b in self.blocks if b.attn.core is not None]

    def forward(
        self,
        tokens: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | LMLoss:
        """tokens int ``[B, N]`` -> logits ``[B, N, vocab]``, or with ``labels`` the loss without the logits.

        Args:
            seq_lens: optional int ``[B]`` (right padding: keys past it are masked).
            document_ids: optional int ``[B, N]`` on the tokens' device, non-decreasing along N, values
                >= 0 (packed documents): each token attends only tokens of its own document, and RoPE
                positions restart at 0 at every document start.
            labels: optional int ``[B, N]``, the target of each position or ``IGNORE_INDEX`` (-100). Then the
                return is :class:`~sparse_train.losses.LMLoss` (summed cross-entropy, correct argmax predictions,
                labelled count) from :func:`~sparse_train.losses.linear_cross_entropy` over the labelled positions only:
                ``cfg.loss_chunk_tokens`` rows of logits at a time, never ``[B, N, vocab]`` (at 196K tokens
                and a 32K vocabulary their float32 copy alone is 23.4 GiB). Computed inside ``forward`` so
                that wrappers which gather parameters around it (FSDP) hold the head's weight.

        Under context parallelism (:func:`~sparse_train.parallel.context_parallel.enable_context_parallel`) ``tokens``
        are this rank's zig-zag shard ``[B, N/W]`` (:func:`~sparse_train.parallel.context_parallel.shard_sequence`),
        ``seq_lens`` and ``document_ids`` stay GLOBAL (``[B]``, ``[B, N]``), RoPE turns each local row at its
        global position, and the logits are this rank's rows of the single-process logits.

        Raises:
            ValueError: ``document_ids`` of the wrong shape, dtype or device, negative or decreasing; under
                context parallelism, N not a multiple of ``2 * W`` (times the block sizes of the attention).
        """
        x = self.embed(tokens)
        if self.context_parallel_group is not None:
            cos, sin, positions = self._context_parallel_rope(tokens, document_ids)
        else:
            cos, sin = self.rope(tokens.shape[1], tokens.device)
            positions = None
            if document_ids is not None:
                check_document_ids(document_ids, tokens.shape[0], tokens.shape[1], tokens.device)
                positions = document_positions(document_ids)
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, N, D/2]
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(
                    block,
                    x,
                    cos,
                    sin,
                    seq_lens,
                    document_ids,
                    positions,
                    **checkpoint_kwargs(self.cfg.checkpoint_keeps_attention),
                )
            else:
                x = block(x, cos, sin, seq_lens, document_ids, positions)
        x = self.norm(x)
        if labels is None:
            return self.lm_head(x)
        return labelled_head_loss(
            x, self.lm_head.weight, labels, ignore_index=IGNORE_INDEX, chunk_tokens=self.cfg.loss_chunk_tokens
        )

    def _context_parallel_rope(self, tokens: torch.Tensor, document_ids: torch.Tensor | None):
        """RoPE tables of the local rows at their global positions, and the positions the attention cores
        get (GLOBAL: ``[B, N]`` per-document positions with documents, None = ``0..N-1`` otherwise)."""
        rank, world = cpm.context_parallel_rank(self.context_parallel_group)
        seq_len = tokens.shape[1] * world
        cpm.check_layout(seq_len, world)
        cos, sin = self.rope(seq_len, tokens.device)
        if document_ids is None:
            local = cpm.zigzag_positions(seq_len, rank, world, device=tokens.device)
            return cos[local], sin[local], None
        check_document_ids(document_ids, tokens.shape[0], seq_len, tokens.device)
        positions = document_positions(document_ids)  # [B, N], global
        local = cpm.shard_sequence(positions, 1, rank, world)
        return cos[local].unsqueeze(1), sin[local].unsqueeze(1), positions

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights counted once)."""
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen or (exclude_embeddings and name.startswith("embed")):
                continue
            seen.add(id(p))
            total += p.numel()
        return total
