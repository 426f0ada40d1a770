"""Activation checkpointing that keeps the attention: recompute a layer's cheap ops, not its attention.

Plain activation checkpointing (``torch.utils.checkpoint``) reruns a layer's whole forward inside the
backward. For a long-context layer with dense attention the attention dominates that rerun, while its
outputs are small: ``o`` ``[B, HQ, N, D]`` in the compute dtype and the float32 log-sum-exp ``[B, HQ, N]``.
Keeping them saves the dense step much of its recompute and the sparse step little (its attention forward is
cheap), for a few GiB of peak memory. Selective checkpointing (``context_fn`` of ``torch.utils.checkpoint``)
keeps the outputs of the attention ops from the first forward and hands them to the recompute, which then
reruns only projections, norms, RoPE, the MLP and the selector's scores.

Ops kept: the block-sparse kernel's forward (``sparse_train::sparse_attn_fwd``) and PyTorch's fused SDPA
kernels (flash, cuDNN, memory-efficient, CPU flash), so the dense twin gets the same policy. Memory:
per layer ``B * N * HQ * (D * itemsize + 4)`` bytes kept until that layer's backward (16 layers, HQ 32,
D 64, bf16, 64K tokens: 4.1 GiB).

Caveat of selective checkpointing in general: the recompute receives the kept outputs in call order, so
the checkpointed function must call the kept ops in the same order both times (a probe call made only on
the first forward would hand its output to the recompute's first real call). The sparse module replays its
first forward's path and selection, so it does.

Host time: selective checkpointing routes every op of the checkpointed forward through a Python dispatch mode
(the policy is asked once per op). The sparse module's selection, plan and distillation are hundreds of small
ops per layer that the policy never keeps, and through the mode their host time outruns the GPU (the GPU
idles for much of a long-context forward). The module runs those parts inside
:func:`outside_selective_checkpoint`, which takes the mode off while they run, in the first forward and in
the recompute alike, so the policy still sees every op it keeps, in the same order.

Exact: the kept tensors are the ones the first forward computed, and the recompute attends with the
selection the first forward made (:mod:`sparse_train.selection.replay`), so the backward sees the
forward's function as with plain checkpointing. Non-reentrant checkpointing only (``use_reentrant=False``,
which is what ``context_fn`` requires).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..kernels import triton_kernels

__all__ = [
    "attention_ops",
    "checkpoint_keeping_attention",
    "checkpoint_kwargs",
    "keep_attention_context",
    "outside_selective_checkpoint",
]

_SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


@functools.cache
def attention_ops() -> frozenset:
    """The op overloads whose outputs :func:`keep_attention_context` keeps (those this torch build has)."""
    triton_kernels()  # its op module defines torch.ops.sparse_train.*
    ops = {torch.ops.sparse_train.sparse_attn_fwd.default}
    ops.update(getattr(torch.ops.aten, name).default for name in _SDPA_OPS if hasattr(torch.ops.aten, name))
    return frozenset(ops)


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_context() -> tuple:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` (non-reentrant) that keeps the attention
    ops' outputs and recomputes every other op (pass the function itself: ``context_fn=keep_attention_context``,
    or in Hugging Face ``gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": ...}``)."""
    return create_selective_checkpoint_contexts(_keep_attention)


def checkpoint_kwargs(keep_attention: bool) -> dict[str, Any]:
    """The keyword arguments of ``torch.utils.checkpoint.checkpoint`` (or Hugging Face's
    ``gradient_checkpointing_kwargs``) for this project's policy: non-reentrant, and with ``keep_attention``
    the attention outputs kept (:func:`keep_attention_context`)."""
    return {"use_reentrant": False, **({"context_fn": keep_attention_context} if keep_attention else {})}


def checkpoint_keeping_attention(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)`` that keeps the attention
    (see the module docstring); ``kwargs`` go to ``function``."""
    return checkpoint(function, *args, **checkpoint_kwargs(True), **kwargs)


@functools.cache
def _selective_checkpoint_modes() -> tuple:
    """The dispatch-mode classes of ``torch.utils.checkpoint``'s selective checkpointing (first forward and
    recompute); empty when this torch build names them otherwise."""
    import torch.utils.checkpoint as ckpt

    return tuple(
        getattr(ckpt, name) for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode") if hasattr(ckpt, name)
    )


@contextlib.contextmanager
def outside_selective_checkpoint() -> Iterator[bool]:
    """Run the enclosed ops outside selective activation checkpointing's dispatch mode; yields whether it was
    taken off.

    Only when every active dispatch mode is selective checkpointing's (and no pre-dispatch mode is active): any
    other mode (a fake-tensor or tracing mode, a FLOP counter, a user's mode) leaves everything as it is, since
    taking it off would change what the ops compute or what that mode sees. Use it only around ops the
    checkpoint policy recomputes (never an op of :func:`attention_ops`), and around the same ops in the first
    forward and in the recompute, so the kept ops reach the policy in the same order both times; then the
    result is exactly that of running them under the mode, minus its per-op Python cost.
    """
    from torch.utils import _python_dispatch as dispatch

    sac_modes = _selective_checkpoint_modes()
    try:
        stack = dispatch._get_current_dispatch_mode_stack()
        from torch._ops import _len_torch_dispatch_stack_pre_dispatch

        pre_dispatch = _len_torch_dispatch_stack_pre_dispatch()
    except (AttributeError, ImportError):  # private API moved: keep the mode (slower, same result)
        yield False
        return
    if not stack or not sac_modes or pre_dispatch or not all(isinstance(mode, sac_modes) for mode in stack):
        yield False
        return
    with dispatch._disable_current_modes():
        yield True
