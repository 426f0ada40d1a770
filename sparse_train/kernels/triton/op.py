"""The autograd op and the public entry point of the Triton block-sparse attention kernels.

Math, per query row q of head h over the selected key blocks (forward.py / backward.py for the kernels):
    s_qk = scale <Q_q, K_k>, -inf unless k <= q, k < seq_len[b] and doc[b, k] == doc[b, q] (document_ids)
    lse_q = log sum_k exp(s_qk)
    O_q = sum_k keep_qk / (1 - p) exp(s_qk - lse_q) V_k;  dQ, dK, dV exact for this O and lse.

Notation: B batch, HQ/HKV heads, N length, D head dim, BQ/BK block sizes, r0 reuse threshold of the
hybrid backward (KV blocks selected by >= r0 query blocks are reduced KV-centric, the others by atomics).

Layers: the kernels (1) and their launchers (2) are in forward.py and backward.py; this file holds (3)
the autograd op (``sparse_train::sparse_attn_fwd`` / ``sparse_train::sparse_attn_bwd`` custom ops with
fake impls and ``register_autograd``, for torch.compile, export and dispatch modes such as selective
checkpointing; eager calls on plain tensors take ``_EagerSparseAttention``, the same launchers and backward
through a plain ``torch.autograd.Function``, which skips the custom op's Python dispatch) and (4) the public
functions ``triton_sparse_attention`` and ``triton_supports``. The launch schedule (plan, cold slots, split
count, tiles) is ``sparse_train.plan.launch.attention_schedule`` of the call's ``kernel_options``. With
``query_blocks`` (context parallelism) the op also carries the query-block map and the first row of each listed
block (``query_map``, ``query_row0``), the index rows of the listed blocks and the plan built from them.

Ownership of the index: ``indices``, ``counts``, ``seq_lens`` and ``document_ids`` are **copied** when
the forward runs, and the copy is what the backward reads, so a caller that mutates or reuses these
tensors after the forward cannot change the gradients (cost: 4 bytes per index slot, per sequence and per
token, small device copies). The
plan tensors (``BlockPlan.kv_indptr``, ``kv_qblocks``, ``kv_pairs``, ``hot``, ``reuse``) are referenced, not copied: a
plan is a derived, immutable view, checked against the index it is used with
(``sparse_train.plan.plan.check_plan``: a plan of another index would make the backward read past
its arrays).

Dropout seeds are ints in [0, 2**64) (validated once, for both backends, in sparse_train.validation);
the op's ``dropout_seed: int`` is an int64, so seeds >= 2**63 travel as their two's-complement value
and the launchers recover the unsigned Philox key (``reference.philox_key``).

Known limits: CUDA tensors in bf16/fp16 (fp32 only under TRITON_INTERPRET=1, for tests); head dims
16/32/64/128; BQ, BK in {16, 32, 64, 128}; N < 2^31. dropout_seed=None draws a seed from torch's
global CPU generator (a graph break under torch.compile: pass an int seed when compiling).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from ...arguments import check_attention_args, query_block_args, query_block_row0
from ...plan.launch import attention_schedule
from ...plan.tuning import BackwardConfig, ForwardConfig
from ...validation import check_bool, draw_dropout_seed
from ._launch import attention_output, direct_call
from .backward import sparse_attn_backward
from .forward import sparse_attn_forward

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_SUPPORTED_BLOCKS = (16, 32, 64, 128)


# ----------------------------------------------------------------------------------------------
# Layer 3: autograd op
# ----------------------------------------------------------------------------------------------
# The launch configurations travel as int lists (custom-op arguments): `launch_config` is the
# ForwardConfig followed by the BackwardConfig, both resolved by `plan.launch.attention_schedule`.
_FWD_FIELDS = len(ForwardConfig._fields)


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    counts: Tensor,
    kv_indptr: Tensor,
    kv_qblocks: Tensor,
    slots: Tensor,
    seq_lens: Tensor | None,
    cold_capacity: int,
    block_q: int,
    block_k: int,
    scale: float,
    dropout_p: float,
    dropout_seed: int,
    num_splits: int,
    launch_config: list[int],
    document_ids: Tensor | None = None,
    query_map: Tensor | None = None,
    query_row0: Tensor | None = None,
    kv_pairs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    # kv_indptr / kv_qblocks / kv_pairs / slots / cold_capacity and the backward half of launch_config are not read
    # here; they are inputs so that setup_context can save them (custom ops save only inputs and outputs).
    return sparse_attn_forward(
        q,
        k,
        v,
        indices,
        counts,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        seq_lens=seq_lens,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        num_splits=num_splits,
        config=ForwardConfig(*launch_config[:_FWD_FIELDS]),
        document_ids=document_ids,
        query_map=query_map,
        query_row0=query_row0,
    )


_sparse_attn_fwd = torch.library.custom_op("sparse_train::sparse_attn_fwd", mutates_args=())(_forward_impl)


@_sparse_attn_fwd.register_fake
def _(
    q,
    k,
    v,
    indices,
    counts,
    kv_indptr,
    kv_qblocks,
    slots,
    seq_lens,
    cold_capacity,
    block_q,
    block_k,
    scale,
    dropout_p,
    dropout_seed,
    num_splits,
    launch_config,
    document_ids=None,
    query_map=None,
    query_row0=None,
    kv_pairs=None,
):
    B, HQ, L, D = q.shape  # L = N, or the rows of the listed query blocks under a query-block map
    return attention_output(q), q.new_empty((B, HQ, L), dtype=torch.float32)


def _backward_impl(
    do: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    indices: Tensor,
    counts: Tensor,
    kv_indptr: Tensor,
    kv_qblocks: Tensor,
    slots: Tensor,
    seq_lens: Tensor | None,
    cold_capacity: int,
    block_q: int,
    block_k: int,
    scale: float,
    dropout_p: float,
    dropout_seed: int,
    backward_config: list[int],
    document_ids: Tensor | None = None,
    query_map: Tensor | None = None,
    query_row0: Tensor | None = None,
    kv_pairs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    return sparse_attn_backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        indices,
        counts,
        kv_indptr,
        kv_qblocks,
        slots,
        cold_capacity,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        seq_lens=seq_lens,
        dlse=dlse,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        config=BackwardConfig(*backward_config),
        document_ids=document_ids,
        query_map=query_map,
        query_row0=query_row0,
        kv_pairs=kv_pairs,
    )


_sparse_attn_bwd = torch.library.custom_op("sparse_train::sparse_attn_bwd", mutates_args=())(_backward_impl)


@_sparse_attn_bwd.register_fake
def _(
    do,
    dlse,
    q,
    k,
    v,
    o,
    lse,
    indices,
    counts,
    kv_indptr,
    kv_qblocks,
    slots,
    seq_lens,
    cold_capacity,
    block_q,
    block_k,
    scale,
    dropout_p,
    dropout_seed,
    backward_config,
    document_ids=None,
    query_map=None,
    query_row0=None,
    kv_pairs=None,
):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the launcher's layouts


def _setup_context(ctx, inputs, output):
    (
        q,
        k,
        v,
        indices,
        counts,
        kv_indptr,
        kv_qblocks,
        slots,
        seq_lens,
        cold_capacity,
        block_q,
        block_k,
        scale,
        dropout_p,
        dropout_seed,
        num_splits,
        launch_config,
        document_ids,
        query_map,
        query_row0,
        kv_pairs,
    ) = inputs
    o, lse = output
    ctx.save_for_backward(
        q,
        k,
        v,
        o,
        lse,
        indices,
        counts,
        kv_indptr,
        kv_qblocks,
        slots,
        seq_lens,
        document_ids,
        query_map,
        query_row0,
        kv_pairs,
    )
    ctx.meta = (cold_capacity, block_q, block_k, scale, dropout_p, dropout_seed, list(launch_config[_FWD_FIELDS:]))


def _backward_with(backward_op, ctx, do, dlse):
    (
        q,
        k,
        v,
        o,
        lse,
        indices,
        counts,
        kv_indptr,
        kv_qblocks,
        slots,
        seq_lens,
        document_ids,
        query_map,
        query_row0,
        kv_pairs,
    ) = ctx.saved_tensors
    cold_capacity, block_q, block_k, scale, dropout_p, dropout_seed, backward_config = ctx.meta
    if do is None:  # only lse was used
        do = torch.zeros_like(o)
    dq, dk, dv = backward_op(
        do,
        dlse,
        q,
        k,
        v,
        o,
        lse,
        indices,
        counts,
        kv_indptr,
        kv_qblocks,
        slots,
        seq_lens,
        cold_capacity,
        block_q,
        block_k,
        scale,
        dropout_p,
        dropout_seed,
        backward_config,
        document_ids,
        query_map,
        query_row0,
        kv_pairs,
    )
    return dq, dk, dv, *([None] * 18)


def _backward(ctx, do, dlse):
    return _backward_with(torch.ops.sparse_train.sparse_attn_bwd, ctx, do, dlse)


_sparse_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerSparseAttention(torch.autograd.Function):
    """The op's autograd without the dispatcher: the same launchers, saved tensors and backward as the
    custom op, called directly. A custom op's Python dispatch (schema defaults, alias checks, the autograd
    redispatch) cost more host time per call than the launch itself; eagerly it buys nothing, so the
    public function takes this path when nothing needs the op as a graph node (:func:`_direct_call`)."""

    @staticmethod
    def forward(ctx, *inputs):
        o, lse = _forward_impl(*inputs)
        _setup_context(ctx, inputs, (o, lse))
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None: the backward skips it
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        if do is None and dlse is None:
            return (None,) * 21
        return _backward_with(_backward_impl, ctx, do, dlse)


def _direct_call(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the call may bypass the custom op (:func:`~sparse_train.kernels.triton._launch.direct_call`): not
    while torch.compile / export traces, not under a TorchDispatchMode, only for plain tensors."""
    return direct_call(q, k, v)


# ----------------------------------------------------------------------------------------------
# Layer 4: public functions
# ----------------------------------------------------------------------------------------------
def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class Support(NamedTuple):
    """Answer of :func:`triton_supports`: ``code`` is one of
    :data:`sparse_train.functional.BACKEND_REASONS` (a stable key for metrics), ``message`` the
    human-readable detail for errors."""

    ok: bool
    code: str
    message: str


def triton_supports(q: Tensor, block_q: int, block_k: int) -> Support:
    """Whether the Triton kernels handle q ``[B, HQ, N, D]`` (device, dtype, head dim, length) with
    blocks of ``block_q`` x ``block_k`` (the caller takes the reference path when not).  Shape
    mismatches are not checked here: they are errors, raised by `triton_sparse_attention`."""
    if q.device.type == "cuda":
        if q.dtype not in (torch.float16, torch.bfloat16):
            return Support(
                False, "unsupported_dtype", f"dtype {q.dtype} on CUDA (kernels support bfloat16 and float16)"
            )
    elif q.device.type == "cpu":
        if not _interpreter():
            return Support(False, "cpu", "CPU tensors need TRITON_INTERPRET=1 for the Triton kernels")
        if q.dtype not in (torch.float16, torch.float32):
            return Support(
                False,
                "unsupported_dtype",
                f"dtype {q.dtype} under the Triton interpreter (float16/float32 only: bf16 math is wrong there)",
            )
    else:
        return Support(False, "unsupported_device", f"device type {q.device.type} (CUDA only)")
    d = q.shape[-1]
    if d not in _SUPPORTED_HEAD_DIMS:
        return Support(False, "unsupported_head_dim", f"head dim {d} (supported: {_SUPPORTED_HEAD_DIMS})")
    if block_q not in _SUPPORTED_BLOCKS or block_k not in _SUPPORTED_BLOCKS:
        return Support(
            False, "unsupported_block_size", f"block sizes BQ={block_q}, BK={block_k} (supported: {_SUPPORTED_BLOCKS})"
        )
    if q.shape[2] >= 2**31:
        return Support(False, "unsupported_other", "sequence length >= 2^31")
    return Support(True, "supported", "ok")


def triton_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    seq_lens: Tensor | None = None,
    deterministic: bool = False,
    kernel_options=None,
    document_ids: Tensor | None = None,
    check_values: bool = True,
    query_blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact block-sparse causal attention through the Triton kernels, differentiable (eager and
    torch.compile).

    Args:
        q: ``[B, HQ, N, D]``; k, v: ``[B, HKV, N, D]`` with HQ a multiple of HKV (query head h reads
            KV head h // (HQ/HKV)).  Any strides.  bf16/fp16 on CUDA (fp32/fp16 on CPU under
            ``TRITON_INTERPRET=1``).  D in {16, 32, 64, 128}.
        index: canonical ``BlockIndex`` for (B, HKV, N) with BQ, BK in {16, 32, 64, 128}.
        scale: logit scale, default ``1/sqrt(D)``.
        dropout_p: dropout on attention probabilities, in [0, 1).  The keep bit of (b, h, q, k) is
            ``philox(seed, ((b*HQ+h)*N+q)*N+k) >= floor(p*2^32)``, the same bits as the reference;
            the softmax denominator (and lse) excludes dropout; kept weights are scaled by 1/(1-p).
        dropout_seed: int seed in ``[0, 2**64)``; default (None with dropout_p > 0): drawn from torch's
            CPU generator.
        seq_lens: optional int ``[B]`` (any strides), values in ``[0, N]``: keys at positions >=
            seq_lens[b] are masked (never loaded).
        deterministic: every dK/dV block through the KV-centric kernel in fixed order (no atomics),
            bitwise-identical gradients run to run.  Switched on automatically when
            ``torch.are_deterministic_algorithms_enabled()``.
        kernel_options: performance choices (see ``sparse_train.sparse_attention`` and
            ``sparse_train.options.KERNEL_OPTIONS``): ``plan`` (built by ``index.plan(r0)`` from this very
            index; default: that call, cached on the index), ``r0``, ``num_splits`` (default: the
            rule ``plan.tuning.choose_num_splits``) and the tiles of each kernel.  They change results only
            up to floating-point order.
        document_ids: optional int ``[B, N]`` (int32/int64, any strides), non-decreasing along N
            (packed documents, ``sparse_train.documents``): key k is masked for query q unless
            ``document_ids[b, k] == document_ids[b, q]``.  Blocks whose queries and keys all lie in
            one document skip the check; selected blocks of other documents contribute nothing.
        check_values: check the values of ``seq_lens`` and ``document_ids`` (host syncs; see
            ``sparse_train.sparse_attention``). Nothing else here reads the device: the plan and the
            launch schedule have shapes fixed by the index's shape, so a call is CUDA-graph capturable
            with ``check_values=False`` and an int ``dropout_seed``.
        query_blocks: optional int ``[NQL]`` on q's device, distinct global query-block ids in any order
            (the query-block map of context parallelism, ``sparse_train.parallel.context_parallel``): q is then
            ``[B, HQ, L, D]``, the rows of these blocks concatenated in the listed order (L = NQL * BQ, less
            when the short last block of the sequence is listed), while k, v, ``index``, ``seq_lens`` and
            ``document_ids`` stay global. Every row is computed as in the full call (global positions for
            the masks and the dropout counters); the kernels read the index rows of the listed blocks
            and the plan of those rows (built per call: ``kernel_options.plan`` is refused). dK/dV are the
            full ``[B, HKV, N, D]`` gradients of these query rows. Checked by
            ``arguments.check_query_blocks`` (a host read of the ids unless ``check_values=False``
            and N % BQ == 0).

    Returns:
        ``(o, lse)``: o ``[B, HQ, N, D]`` in q's dtype (a view of ``[B, N, HQ, D]`` memory, so that
        ``o.transpose(1, 2).reshape(B, N, HQ * D)`` costs no copy), lse ``[B, HQ, N]`` float32 natural log
        (``[B, HQ, L, D]`` / ``[B, HQ, L]`` with ``query_blocks``); rows with no valid key give o = 0,
        lse = -inf and zero gradients.  Both are differentiable.

    The index tensors are copied at forward time, so mutating them afterwards does not change the
    gradients (see the module docstring).

    Raises:
        ValueError: unsupported dtype/device/head dim/block size (reason from ``triton_supports``);
            any argument outside its domain (``sparse_train.arguments.check_attention_args``):
            shape/batch/head/length mismatch with the index, bad seq_lens or document_ids, dropout_p outside [0, 1),
            dropout_seed outside [0, 2**64), a bad ``kernel_options`` key or value, a plan of another
            index, heads per program that do not divide the GQA group; a bad ``query_blocks`` (see
            ``arguments.check_query_blocks``) or one with ``kernel_options.plan``.
    """
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
        document_ids=document_ids,
        seq_lens_values=check_values,
    )
    support = triton_supports(q, index.block_q, index.block_k)
    if not support.ok:
        raise ValueError(f"triton_sparse_attention does not support this input: {support.message}")
    scale, dropout_p, dropout_seed = args.scale, args.dropout_p, args.dropout_seed
    if dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = draw_dropout_seed()
    seed = dropout_seed if dropout_p > 0.0 else 0
    # the op's int is an int64: seeds >= 2**63 travel as their two's complement (same 64 bits)
    seed = seed - (1 << 64) if seed >= 1 << 63 else seed
    deterministic = check_bool("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    schedule = attention_schedule(
        index, q.shape[1] // k.shape[1], q.shape[-1], q.device, args.kernel_options, deterministic, query_blocks=blocks
    )
    plan = schedule.plan
    # copies: the backward must see the forward's selection and lengths whatever the caller does afterwards
    if blocks is None:
        indices = index.indices.clone()
        counts = index.counts.clone()
        query_map = query_row0 = None
    else:  # the rows of the listed blocks (index_select copies), row i for local query block i
        indices = index.indices.index_select(2, blocks)
        counts = index.counts.index_select(2, blocks)
        query_map = blocks.to(torch.int32)
        query_row0 = query_block_row0(blocks, index)
    if seq_lens is not None:
        seq_lens = seq_lens.to(torch.int32, copy=True)
    if document_ids is not None:
        document_ids = document_ids.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    inputs = (
        q,
        k,
        v,
        indices,
        counts,
        plan.kv_indptr,
        plan.kv_qblocks,
        schedule.slots,
        seq_lens,
        schedule.cold_capacity,
        index.block_q,
        index.block_k,
        scale,
        dropout_p,
        seed,
        schedule.num_splits,
        [*schedule.forward, *schedule.backward],
        document_ids,
        query_map,
        query_row0,
        plan.kv_pairs,
    )
    if not _direct_call(q, k, v):
        return torch.ops.sparse_train.sparse_attn_fwd(*inputs)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerSparseAttention.apply(*inputs)
    return _forward_impl(*inputs)
