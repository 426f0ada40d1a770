"""``sparse_attention``: the functional entry point, and the one place that chooses between the Triton
kernels and their PyTorch references (``resolve_backend``; the selector's block-mass targets use the
same decision through :func:`choose_backend`). Also the dense causal path with the same masks
(:func:`dense_causal_attention`), which the module takes when a selection is full."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .arguments import check_attention_args, query_block_args, query_block_positions
from .index.block_index import BlockIndex, check_inputs
from .kernels import triton_kernels
from .kernels.reference.attention import reference_sparse_attention
from .options import KernelOptions, check_fused_dq_allowed, check_no_plan_with_query_blocks
from .validation import check_bool, check_choice, draw_dropout_seed

__all__ = [
    "BACKENDS",
    "BACKEND_REASONS",
    "dense_causal_attention",
    "finite_padded_queries",
    "choose_backend",
    "resolve_backend",
    "sparse_attention",
]

BACKENDS = ("auto", "triton", "reference")
"""Values of ``backend``: ``"auto"`` (Triton on supported CUDA input, the reference otherwise),
``"triton"`` (raises on input the kernels do not support), ``"reference"`` (PyTorch)."""

BACKEND_REASONS = (
    "requested",
    "supported",
    "cpu",
    "triton_unavailable",
    "unsupported_dtype",
    "unsupported_head_dim",
    "unsupported_block_size",
    "unsupported_device",
    "unsupported_other",
)
"""Why :func:`resolve_backend` chose its backend: fixed codes, usable as metric keys (the module
counts ``reference_<code>`` fallbacks), never free text to be matched."""


def finite_padded_queries(q: Tensor, seq_lens: Tensor, positions: Tensor | None = None) -> Tensor:
    """q ``[B, H, N, D]`` with the non-finite entries of rows at positions >= seq_lens[b] set to 0.

    Rows past seq_lens are padding and are computed like any other row (they attend the valid
    keys), but a NaN there would reach the keys' gradients through the backward's row sums
    (0 * NaN = NaN); finite padding is left as it is, so results on finite input do not change.
    ``positions``: int ``[L]``, the global position of each row of q when q holds only some rows
    (``query_blocks``); default ``0..N-1``."""
    pos = torch.arange(q.shape[2], device=q.device) if positions is None else positions
    real = pos.view(1, 1, -1, 1) < seq_lens.view(-1, 1, 1, 1)
    return torch.where(real | torch.isfinite(q), q, 0.0)


def dense_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seq_lens: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Dense causal SDPA with GQA and the same masks as the sparse path.

    q ``[B, HQ, N, D]``, k/v ``[B, HKV, N, D]``; ``scale`` default ``1 / sqrt(D)``; with ``seq_lens``
    keys at positions >= seq_lens[b] are masked, with ``document_ids`` (int ``[B, N]``, non-decreasing,
    :mod:`sparse_train.documents`) keys of another document than the query's (explicit boolean masks;
    rows without any valid key output zeros, as in the kernels). Dropout uses SDPA's own RNG, not the
    counter-based bits. Arguments are not validated here (the callers do: `check_inputs`)."""
    gqa = q.shape[1] != k.shape[1]
    if scale is not None and abs(scale) <= 2**-150:
        # a scale that rounds to 0 in float32, where PyTorch's causal SDPA returns NaN: every logit is 0 just the
        # same with q * 0 and scale 1 (and the gradient of q the 0 it rounds to)
        q, scale = q * 0.0, 1.0
    if seq_lens is None and document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    allowed = pos.view(1, 1, n) <= pos.view(1, n, 1)  # [1 or B, N, N]
    if seq_lens is not None:
        # Padding may hold anything (NaN included). A masked logit still multiplies its value by a zero
        # probability (0 * NaN = NaN), so padded keys and values are replaced, not masked.
        real = pos.view(1, 1, n, 1) < seq_lens.view(-1, 1, 1, 1)
        q = finite_padded_queries(q, seq_lens)
        k = torch.where(real, k, 0.0)
        v = torch.where(real, v, 0.0)
        allowed = allowed & (pos.view(1, 1, n) < seq_lens.view(-1, 1, 1))
    if document_ids is not None:
        allowed = allowed & (document_ids.view(-1, 1, n) == document_ids.view(-1, n, 1))
    allowed = allowed.expand(q.shape[0], n, n)
    # empty only when seq_lens[b] == 0, or for a padding row whose document starts at or past seq_lens[b]
    empty_row = ~allowed.any(dim=-1)
    # give empty rows one harmless key so SDPA has a finite softmax, then zero their output
    allowed = allowed | (empty_row.unsqueeze(-1) & (pos.view(1, 1, n) == 0))
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed.unsqueeze(1), dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return o.masked_fill(empty_row.view(q.shape[0], 1, n, 1), 0.0)


def choose_backend(q: Tensor, block_q: int, block_k: int, backend: str = "auto") -> tuple[str, str]:
    """The backend decision from what it depends on (q's device, dtype, length and head dim; the block
    sizes): ``("triton" | "reference", code)`` with ``code`` in :data:`BACKEND_REASONS`. Attention goes
    through :func:`resolve_backend` (which validates the whole input first); the selector's block-mass
    targets call this directly."""
    check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return "reference", "requested"
    on_cpu = q.device.type == "cpu"
    if backend == "triton":
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before sparse_train's "
                "kernels are imported; use backend='reference' or move the tensors to CUDA"
            )
        support = triton_kernels().op.triton_supports(q, block_q, block_k)
        if not support.ok:
            raise ValueError(f"backend='triton' cannot run this input: {support.message}")
        return "triton", "requested"
    if on_cpu:
        return "reference", "cpu"
    if q.device.type != "cuda":
        return "reference", "unsupported_device"
    try:
        op = triton_kernels().op
    except ImportError:  # triton missing or broken on this machine
        return "reference", "triton_unavailable"
    support = op.triton_supports(q, block_q, block_k)
    return ("triton", "supported") if support.ok else ("reference", support.code)


def resolve_backend(
    q: Tensor, k: Tensor, v: Tensor, index: BlockIndex, backend: str = "auto", *, document_ids: Tensor | None = None
) -> tuple[str, str]:
    """Which backend ``sparse_attention`` will run, and why: ``("triton" | "reference", code)`` with
    ``code`` in :data:`BACKEND_REASONS`.

    ``"auto"`` picks Triton for CUDA tensors the kernels support and the reference otherwise (the
    code names what was unsupported). ``"triton"`` on CPU tensors requires ``TRITON_INTERPRET=1``.
    """
    check_choice("backend", backend, BACKENDS)
    check_inputs(q, k, v, index, seq_lens_values=False, document_ids=document_ids)
    return choose_backend(q, index.block_q, index.block_k, backend)


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: BlockIndex,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    seq_lens: Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
    kernel_options: dict | KernelOptions | None = None,
    document_ids: Tensor | None = None,
    check_values: bool = True,
    query_blocks: Tensor | None = None,
):
    """Exact softmax attention restricted to the blocks of ``index`` (plus causal, length and document masks).

    The named arguments are the semantics; ``kernel_options`` holds the performance choices, which
    never change the result beyond floating-point order.

    Extreme logits: the Triton backward recomputes each probability as ``exp(s - lse)`` from a recomputed
    fp32 logit s and the fp32 lse the forward stores, so the absolute rounding of numbers of size |lse|
    (about ``|lse| * 2**-24``, and the recomputed dot product's rounding, which grows as ``sqrt(D)``) becomes a
    relative error of the probabilities. The gradients then carry, beyond PyTorch's fp32 attention, a relative
    error below ``sqrt(D) * max|lse| * 2**-26``, max|lse| the largest |lse| of any row (measured on the Triton
    interpreter at |lse| 1e2 to 1e5, D 16 to 128: 0.35 to 0.6 of it). Negligible at the |lse| of trained
    models; at fp32 logits of 1e4, dV is off by 2e-4 to 7e-4 where PyTorch's fp32 SDPA, which keeps its
    normalised probabilities, is off by 1e-7; dQ and dK lose about as much in any fp32 implementation there
    (the logits themselves round at ``|s| * 2**-24``). The reference backend keeps its probabilities and has
    no such term.

    Args:
        q: ``[B, HQ, N, D]``; k, v: ``[B, HKV, N, D]`` with HQ a multiple of HKV (GQA). Any strides. HQ, HKV,
            N, D >= 1; B = 0 gives empty outputs and gradients on both backends.
        index: canonical :class:`~sparse_train.BlockIndex` for (B, HKV, N).
        scale: logit scale, default ``1 / sqrt(D)``.
        dropout_p: dropout on attention probabilities, in [0, 1). The softmax denominator excludes
            dropout; kept probabilities are scaled by ``1 / (1 - p)``.
        dropout_seed: seed of the counter-based keep bits, an int in ``[0, 2**64)`` (both backends
            give the same bits for every seed). ``None`` draws one from torch's global generator (so
            ``torch.manual_seed`` and checkpoint RNG replay reproduce it).
        seq_lens: optional int ``[B]`` (any strides), values in ``[0, N]``: keys at positions >=
            seq_lens[b] are masked (right padding); whatever they hold (even NaN/inf) never reaches
            an output or gradient of the keys before it. Query rows past it are computed like any
            row (finite padding) or from a zeroed query (non-finite padding).
        document_ids: optional int ``[B, N]`` (int32/int64, any strides), non-decreasing along N, values
            >= 0 (packed documents, :mod:`sparse_train.documents`): query i sees key j only when
            ``document_ids[b, j] == document_ids[b, i]`` (besides j <= i and j < seq_lens[b]). A row
            always sees itself, so this never empties a row. Selected blocks of other documents
            contribute nothing (they cost their loads only). Dropout bits stay those of the global
            positions.
        return_lse: also return the row log-sum-exp ``[B, HQ, N]`` (fp32, natural log, -inf on empty rows).
        deterministic: bitwise-reproducible gradients (every dK/dV block KV-centric). Also switched on
            by ``torch.use_deterministic_algorithms(True)``.
        backend: one of :data:`BACKENDS`: ``"auto"`` (Triton on supported CUDA inputs, reference
            otherwise), ``"triton"``, ``"reference"``.
        kernel_options: ``None``, a :class:`~sparse_train.options.KernelOptions`, or a dict with keys among
            :data:`sparse_train.options.KERNEL_OPTIONS` (the same checks for both forms), each None (default) or:
            ``plan`` a precomputed ``index.plan(r0)`` of this very index, to reuse across layers; ``r0`` the reuse
            threshold of the hybrid backward, >= 0 (default :data:`sparse_train.plan.plan.DEFAULT_R0`; must equal
            ``plan.r0`` when both are given); ``num_splits`` the forward's split-KV count (1..64);
            ``{fwd,dq,kv}_heads_per_program`` (a power of two dividing the GQA group), ``{fwd,dq,kv}_num_warps``
            (1, 2, 4, 8 or 16), ``{fwd,dq,kv}_num_stages`` (1..8) the tiles of the forward, dQ and KV-centric kernels;
            ``kv_chunk`` query blocks per KV-centric work item (>= 1); ``kv_tile_rows`` query rows the KV-centric
            kernel takes per step (a power of two >= 16); ``fused_dq`` (bool) one backward pass, dQ added by the
            KV-centric kernel with float32 atomics (not bitwise reproducible, so refused with ``deterministic``; off
            by default: measured slower, ``docs/kernel_tuning.md``); ``stored_ds`` (bool) the KV-centric kernel
            stores dS and the dQ kernel reads it instead of recomputing S and dP (deterministic; a buffer of
            B*HQ*NQB*K*BQ*BK elements in q's dtype; off by default: not faster than the default backward, for about
            8 GB more memory at 64K); ``{fwd,dq,kv}_tma`` (bool) TMA tensor-descriptor loads of the K/V tiles
            (forward, dQ) and of the q/dO slices (KV-centric) on Hopper and newer, where the tensors' layout allows
            a descriptor (the defaults follow the measurements in ``docs/kernel_tuning.md``); ``kv_gluon`` (bool)
            the KV-centric dK/dV kernel hand-scheduled in Gluon (default on a Hopper GPU, where it applies: no
            dropout or sequence lengths, N a multiple of the blocks; same gradients as the Triton kernel, a faster
            backward); ``dq_gluon`` (bool) the dQ kernel hand-scheduled in Gluon (default on a Hopper GPU where it
            applies, as ``kv_gluon`` and no cold block; dQ bitwise the Triton kernel's; a faster backward);
            ``fwd_gluon`` (bool) the forward hand-scheduled in Gluon (where it applies, also one split per row;
            outputs bitwise the Triton forward's; default on a Hopper GPU at head dim 64 over 64-key blocks, the one
            shape where it measured faster). Validated on both backends; only the Triton backend uses them.
        check_values: check the *values* of ``seq_lens`` and ``document_ids`` (default). These are the
            only checks that read device memory back to the host (a sync on CUDA); ``False`` skips
            them, for callers that must not sync (CUDA-graph capture, the ``SparseAttention`` module at
            ``index_check="none"``). Shapes, dtypes and devices are always checked. An unchecked bad
            value never makes a kernel read out of bounds (seq_lens are clamped to [0, N] on the device,
            document ids only decide masks) but gives a result for the clamped lengths / those masks.
            Skipped anyway while ``torch.compile`` traces.
        query_blocks: optional int ``[NQL]`` on q's device: distinct global query-block ids, in any order
            (the query-block map of context parallelism, :mod:`sparse_train.parallel.context_parallel`). q is then
            ``[B, HQ, L, D]`` with L = len(query_blocks) * BQ (less by the missing rows when the short last
            block of the sequence is listed): the rows of the listed blocks concatenated in the listed
            order. k, v, ``index``, ``seq_lens`` and ``document_ids`` stay global (``[B, HKV, N, D]``, the
            global index, ``[B]``, ``[B, N]``). Each row is computed exactly as in the full call: masks and
            dropout bits at global positions, so o and lse are the full call's rows, dq its rows, and dk,
            dv the ``[B, HKV, N, D]`` contributions of these rows (summed over the calls that cover every
            block, they are the full call's). Both backends; the Triton kernels take the map directly
            (rows of q by local block, positions by global block). The ids are checked (range,
            distinctness, q's length: one host read, skipped with ``check_values=False`` when N % BQ == 0,
            the ids then clamped into range); ``kernel_options.plan`` is refused with it (the call
            builds the plan of its own rows).

    Returns:
        ``o`` ``[B, HQ, N, D]`` (``[B, HQ, L, D]`` with ``query_blocks``) in q's dtype, or ``(o, lse)`` with
        ``return_lse=True`` (lse ``[B, HQ, N]`` or ``[B, HQ, L]``). Rows with no valid key give zeros (and
        ``lse = -inf``), never NaN. The Triton backend returns o as a view of ``[B, N, HQ, D]`` memory (the
        layout an output projection reads: ``o.transpose(1, 2).reshape(B, N, HQ * D)`` copies nothing); use
        ``reshape`` or ``contiguous()`` rather than ``view`` on it in the ``[B, HQ, N, D]`` order.

    Raises:
        ValueError: any argument outside its domain (see :mod:`sparse_train.validation`), naming it:
            shape/dtype/device mismatch between q, k, v, index, seq_lens and document_ids; seq_lens values outside
            [0, N]; document_ids negative or decreasing along N; dropout_p outside [0, 1); dropout_seed outside
            [0, 2**64); an unknown kernel_options key or a value of the wrong type or range (dict or KernelOptions
            alike), or one that does not fit the shapes (a heads per program not dividing the GQA group, a
            kv_tile_rows past the KV-centric tile); a plan of another index; unknown backend; ``backend="triton"``
            on input the kernels do not support; query_blocks not a 1-D integer tensor on q's device, empty, out of
            range, repeated, or q's length not that of the listed blocks; query_blocks with ``kernel_options.plan``.
    """
    # Everything but the seq_lens and document_ids values (host syncs) before choosing a backend; the
    # backend that runs validates again, values included (unless check_values=False), so the syncs
    # happen at most once per call.
    check_values = check_bool("check_values", check_values)
    blocks, q_global = query_block_args(q, k, index, query_blocks, check_values)
    args = check_attention_args(
        q_global,
        k,
        v,
        index,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        seq_lens=seq_lens,
        kernel_options=kernel_options,
        seq_lens_values=False,
        document_ids=document_ids,
    )
    dropout_p, dropout_seed = args.dropout_p, args.dropout_seed
    check_bool("deterministic", deterministic)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    check_fused_dq_allowed(args.kernel_options, deterministic)
    check_bool("return_lse", return_lse)
    if blocks is not None:
        check_no_plan_with_query_blocks(args.kernel_options)
    if dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed()
    if seq_lens is not None:
        positions = None if blocks is None else query_block_positions(blocks, index, q.shape[2])
        q = finite_padded_queries(q, seq_lens, positions)
    if blocks is None:
        chosen, _ = resolve_backend(q, k, v, index, backend, document_ids=document_ids)
    else:
        chosen, _ = choose_backend(q, index.block_q, index.block_k, backend)  # inputs checked above
    if chosen == "triton":
        o, lse = triton_kernels().op.triton_sparse_attention(
            q,
            k,
            v,
            index,
            scale=scale,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
            seq_lens=seq_lens,
            deterministic=deterministic,
            kernel_options=args.kernel_options,
            document_ids=document_ids,
            check_values=check_values,
            query_blocks=blocks,
        )
    else:
        o, lse = reference_sparse_attention(
            q,
            k,
            v,
            index,
            scale=scale,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
            seq_lens=seq_lens,
            document_ids=document_ids,
            check_values=check_values,
            query_blocks=blocks,
        )
    return (o, lse) if return_lse else o
