"""The language-model loss without the ``[T, vocab]`` logits: cross-entropy of a linear head, chunk by chunk.

    logits[t] = W h[t]                       (W the head ``[V, d]``, h[t] the final hidden state ``[d]``)
    loss      = sum over labelled t of logsumexp(logits[t]) - logits[t, y[t]]
    dL/dh[t]  = (softmax(logits[t]) - onehot(y[t]))^T W,   dL/dW = sum_t (softmax(logits[t]) - onehot(y[t])) h[t]^T

Why: at long context the logits are the largest tensor of a step. At 196,608 tokens and a 32,000-token
vocabulary their float32 copy is 23.4 GiB (the allocation that ran out of memory in the context-parallel
sweep, ``docs/context_parallel.md``), and autograd keeps the logits and their gradient besides. Here only one
chunk of ``chunk_tokens`` rows of logits exists at a time (8,192 x 32,000 float32 = 1 GiB): the gradients are
computed in the forward, chunk by chunk, and the backward only scales them by the incoming gradient (so
``backward`` may run once per forward, as for any loss).

Notation: T rows (tokens), d model width, V vocabulary size, C = ``chunk_tokens``. Numerics: the logits are
computed as the plain path computes them (a matmul in the compute dtype, e.g. bf16 under autocast, then
float32), the softmax and loss in float32 (float64 inputs stay float64); the head's gradient is accumulated
over the chunks in that precision.

Under ``torch.compile`` the loss takes a second path with the same result, :func:`_checkpointed_chunks`:
plain differentiable chunks, each under activation checkpointing (its logits recomputed in the backward,
never stored). The autograd function above cannot be traced: with torch 2.11 (CPU and CUDA alike) the
compiled graph of a ``torch.autograd.Function`` that computes its gradients in the forward
returns zero gradients, silently; torch 2.13 traces it correctly.

Known limits: no label smoothing, no logit soft-capping, no bias; the gradients of hidden and head are held
from the forward to the backward (``[T, d]`` and ``[V, d]``, small beside ``[T, V]``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .validation import check_int, check_integer_tensor

__all__ = ["DEFAULT_CHUNK_TOKENS", "LMLoss", "labelled_head_loss", "labelled_logits_loss", "linear_cross_entropy"]

DEFAULT_CHUNK_TOKENS = 8192
"""Rows of logits alive at a time: 8,192 x 32,000 float32 = 1 GiB, large enough that the matmuls stay
efficient on a GPU, small beside a long-context step's activations."""


class LMLoss(NamedTuple):
    """A language model's loss over the labelled positions of a batch (what the models' ``forward`` returns
    when given ``labels``)."""

    loss_sum: Tensor
    """float32 scalar (float64 for a float64 model): the cross-entropy summed over the labelled positions."""
    correct: Tensor
    """int64 scalar: labelled positions whose argmax prediction is the label."""
    count: Tensor
    """int64 scalar: labelled positions."""


def _logits_loss(logits: Tensor, y: Tensor, ignore_index: int):
    """Of one chunk's logits ``[C, V]`` and labels ``[C]``: the summed loss, the correct count, and for the
    gradient the row logsumexp ``[C]``, the labelled mask ``[C]`` and the gather index ``[C, 1]``."""
    labelled = y != ignore_index
    target = torch.where(labelled, y, 0).unsqueeze(1)  # [C, 1]
    lse = torch.logsumexp(logits, dim=1)  # [C]
    loss = torch.where(labelled, lse - logits.gather(1, target).squeeze(1), 0.0).sum()
    correct = ((logits.argmax(dim=1) == y) & labelled).sum()
    return loss, correct, lse, labelled, target


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        chunk_tokens: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows = hidden.shape[0]
        exact = torch.promote_types(compute_dtype, torch.float32)  # softmax and sums: float32, float64 kept
        loss = torch.zeros((), dtype=exact, device=hidden.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=exact, device=weight.device) if needs_weight else None
        head = weight.to(compute_dtype)  # [V, d]
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, chunk_tokens):
                stop = min(start + chunk_tokens, rows)
                h = hidden[start:stop].to(compute_dtype)  # [C, d]
                logits = (h @ head.t()).to(exact)  # [C, V]
                chunk_loss, chunk_correct, lse, labelled, target = _logits_loss(
                    logits, labels[start:stop], ignore_index
                )
                loss += chunk_loss
                correct += chunk_correct
                if needs_hidden or needs_weight:
                    dlogits = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the logits
                    dlogits.scatter_add_(1, target, torch.full_like(lse, -1.0).unsqueeze(1))
                    dlogits.mul_(labelled.unsqueeze(1))
                    dlogits = dlogits.to(compute_dtype)
                    if needs_hidden:
                        grad_hidden[start:stop] = (dlogits @ head).to(hidden.dtype)
                    if needs_weight:
                        grad_weight += (dlogits.t() @ h).to(exact)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_correct: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(torch.promote_types(grad_loss.dtype, torch.float32))
        dh = None if grad_hidden is None else (grad_hidden.to(scale.dtype) * scale).to(grad_hidden.dtype)
        dw = None if grad_weight is None else (grad_weight * scale).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None


def _chunk_loss(h: Tensor, head: Tensor, y: Tensor, ignore_index: int, exact: torch.dtype) -> tuple[Tensor, Tensor]:
    """Summed loss and correct count of one chunk (rows ``h`` ``[C, d]``, head in the compute dtype)."""
    loss, correct, *_ = _logits_loss((h @ head.t()).to(exact), y, ignore_index)
    return loss, correct


def _checkpointed_chunks(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, ignore_index: int, compute_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """What :class:`_LinearCrossEntropy` computes, with autograd: each chunk's logits are recomputed in the
    backward (``checkpoint``) instead of held. The path taken while ``torch.compile`` traces (module
    docstring)."""
    exact = torch.promote_types(compute_dtype, torch.float32)
    head = weight.to(compute_dtype)  # [V, d]
    loss = torch.zeros((), dtype=exact, device=hidden.device)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = min(start + chunk_tokens, hidden.shape[0])
            part, hits = checkpoint(
                _chunk_loss,
                hidden[start:stop].to(compute_dtype),
                head,
                labels[start:stop],
                ignore_index,
                exact,
                use_reentrant=False,
            )
            loss, correct = loss + part, correct + hits
    return loss, correct


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels``, never holding more than
    ``chunk_tokens`` rows of logits.

    Equals ``F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=ignore_index,
    reduction="sum")`` (under autocast, the linear in the autocast dtype, as the plain path computes it), and
    its gradients to ``hidden`` and ``weight``, up to float32 summation order.

    Args:
        hidden: ``[T, d]`` floating point (any rows: select the labelled ones first to save work).
        weight: ``[V, d]`` the output head, floating point, on hidden's device.
        labels: int ``[T]``, values in ``[0, V)`` or ``ignore_index`` (no loss, no gradient).
        ignore_index: the label of rows without a loss (default -100, as ``F.cross_entropy``).
        chunk_tokens: rows of logits computed at a time (default 8,192), >= 1.

    Returns:
        ``(loss_sum, correct)``: float32 scalar (float64 for float64 inputs), the summed loss over labelled
        rows (differentiable once);
        int64 scalar, the labelled rows whose argmax logit is the label.

    Raises:
        ValueError: shapes that do not fit (``hidden`` not 2-D, ``weight`` not ``[V, d]``, ``labels`` not
            ``[T]``), non-floating ``hidden``/``weight``, integer-less ``labels``, different devices, or a
            ``chunk_tokens`` below 1.
    """
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(
            f"hidden must be a floating-point [T, d] tensor, got "
            f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}"
        )
    if (
        not isinstance(weight, Tensor)
        or weight.dim() != 2
        or not weight.is_floating_point()
        or weight.shape[1] != hidden.shape[1]
    ):
        raise ValueError(
            f"weight must be a floating-point [V, d={hidden.shape[1]}] tensor, got "
            f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}"
        )
    labels = check_integer_tensor("labels", labels, dim=1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"labels must be [T={hidden.shape[0]}], got {tuple(labels.shape)}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    chunk_tokens = check_int("chunk_tokens", chunk_tokens, minimum=1)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.compiler.is_compiling():
        return _checkpointed_chunks(hidden, weight, labels, chunk_tokens, int(ignore_index), compute_dtype)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, int(ignore_index), compute_dtype)


def _labelled_rows(x: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(labelled, rows, targets)`` of per-position tensors ``x`` ``[B, N, F]`` and ``labels`` ``[B, N]``:
    the bool mask of the labelled positions, then eagerly only their rows ``[L, F]`` and labels ``[L]``.
    While ``torch.compile`` traces, every row and label instead (``[B * N, F]``, ``[B * N]``): a boolean
    selection has a data-dependent shape, which a full graph cannot hold; the callers' losses ignore the
    unlabelled rows either way. Raises ValueError when ``labels`` is not ``[B, N]``."""
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels must have the tokens' shape {tuple(x.shape[:-1])}, got {tuple(labels.shape)}")
    labelled = labels != ignore_index
    if torch.compiler.is_compiling():
        return labelled, x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    return labelled, x[labelled], labels[labelled]


def labelled_head_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> LMLoss:
    """:class:`LMLoss` of the final hidden states ``[B, N, d]`` through the head ``weight`` ``[V, d]`` against
    ``labels`` ``[B, N]``: only the labelled positions, through :func:`linear_cross_entropy` (a chunk of
    logits at a time). Raises ValueError when ``labels`` is not ``[B, N]``.

    Eagerly the labelled rows are selected first (a retrieval batch labels a few answer tokens of thousands:
    their logits only). While ``torch.compile`` traces, every row goes through the head instead, the ignored
    ones adding no loss and no gradient (:func:`_labelled_rows`). Same result, up to float32 summation order."""
    labelled, rows, targets = _labelled_rows(hidden, labels, ignore_index)
    loss_sum, correct = linear_cross_entropy(
        rows, weight, targets, ignore_index=ignore_index, chunk_tokens=chunk_tokens
    )
    return LMLoss(loss_sum, correct, labelled.sum())


def labelled_logits_loss(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> LMLoss:
    """:class:`LMLoss` from logits ``[B, N, V]`` already computed (a model whose head cannot be chunked):
    only the labelled positions, in float32 at least. Raises ValueError when ``labels`` is not ``[B, N]``.
    While ``torch.compile`` traces, every position is taken and the ignored ones masked (:func:`_labelled_rows`)."""
    labelled, rows, targets = _labelled_rows(logits, labels, ignore_index)
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    loss_sum = F.cross_entropy(rows, targets, ignore_index=ignore_index, reduction="sum")
    correct = ((rows.argmax(-1) == targets) & (targets != ignore_index)).sum()
    return LMLoss(loss_sum, correct, labelled.sum())
