"""Model-wide helpers over every :class:`~sparse_train.module.attention.SparseAttention` of a model: the
selector losses to add to the training loss, the selector's parameters and state names, gradient clipping
that keeps the model's and the selectors' norms apart (FSDP / DTensor shards included), and the per-layer
attention statistics."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..validation import check_float
from .attention import SparseAttention

__all__ = [
    "clip_grad_norms",
    "collect_attention_stats",
    "collect_selector_losses",
    "selector_parameter_names",
    "selector_parameters",
    "selector_state_names",
]


def _sparse_modules(model: nn.Module) -> Iterable[SparseAttention]:
    return (module for _, module in _named_sparse_modules(model))


def collect_selector_losses(model: nn.Module) -> Tensor:
    """Sum of the last ``selector_loss`` of every ``SparseAttention`` in ``model`` (a scalar tensor;
    zero without gradient when no module computed one, e.g. in eval mode or with distill="off")."""
    losses = [m.selector_loss for m in _sparse_modules(model) if m.selector_loss is not None]
    if losses:
        return torch.stack([loss.to(torch.float32) for loss in losses]).sum()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.zeros((), device=device)


def selector_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter that lives inside an ``SparseAttention`` of ``model`` (its selector), each once."""
    seen: dict[int, nn.Parameter] = {}
    for module in _sparse_modules(model):
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def selector_parameter_names(model: nn.Module) -> set[str]:
    """Names (relative to ``model``) of the parameters of :func:`selector_parameters`."""
    return {
        f"{prefix}{name}" for prefix, module in _named_sparse_modules(model) for name, _ in module.named_parameters()
    }


def selector_state_names(model: nn.Module) -> set[str]:
    """Every state-dict key (parameters and buffers) of ``model`` that lives inside an ``SparseAttention``."""
    return {f"{prefix}{key}" for prefix, module in _named_sparse_modules(model) for key in module.state_dict()}


def _named_sparse_modules(model: nn.Module) -> Iterable[tuple[str, SparseAttention]]:
    # (name prefix with its trailing dot, module) of every SparseAttention; the model itself has prefix ""
    return ((f"{name}." if name else "", m) for name, m in model.named_modules() if isinstance(m, SparseAttention))


def clip_grad_norms(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Clip the gradient norm of the model's own parameters and of its selectors' separately.

    Use this instead of one ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``: the
    selectors' distillation gradients are large (``selector_lr_multiplier`` scales them) and never
    reach the model's weights, yet inside one global norm they shrink every model step whenever the
    selectors learn, so a sparse model would train slower than its dense twin even during the dense
    warm-up. With separate norms the model's update is the one it would get without selectors.

    Sharded gradients (FSDP) give the norms of the whole, unsharded gradients: each rank sums
    ``|g|**norm_type`` over its own shards of each group, one all-reduce adds the two sums over the ranks
    (a max for ``inf``), and every rank scales its shards by the same ``min(1, max_norm / (norm + 1e-6))``
    (the coefficient of ``clip_grad_norm_``). Two kinds of sharding are recognised:

    * DTensor gradients (FSDP2 ``fully_shard``): their local shards, reduced over their device mesh's
      ``Shard`` dimensions (``Replicate`` dimensions hold copies and are not summed);
    * ``process_group`` given (FSDP1 with ``use_orig_params=True``, as Lightning's ``FSDPStrategy``): every
      plain-tensor gradient is this rank's piece of a parameter split across ``process_group``; FSDP
      leaves ``grad`` None on ranks that hold no piece of a parameter.

    Without either, the gradients are taken to be whole (single device, DDP). Under sharding every rank
    of the group must call this (it is a collective), whatever gradients it holds.

    Args:
        model: any module; parameters without a gradient are skipped.
        max_norm: largest norm of each group, > 0.
        norm_type: the p of the p-norm, > 0 or ``inf`` (as ``clip_grad_norm_``).
        process_group: the group plain-tensor gradients are sharded over (see above); None = whole.

    Returns:
        ``(model_norm, selector_norm)``: each group's total norm before clipping (0 for an empty
        group), fp32 scalars (fp64 for fp64 gradients) on the gradients' device, equal on every rank.

    Raises:
        ValueError: ``max_norm`` not a finite number > 0; ``norm_type`` not > 0; DTensor gradients
            together with ``process_group``, on different meshes, or with a ``Partial`` placement.
    """
    max_norm = check_float("max_norm", max_norm, exclusive_minimum=0.0)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}")
    norm_type = float(norm_type)
    selector = selector_parameters(model)
    selector_ids = {id(p) for p in selector}
    own = [p for p in model.parameters() if id(p) not in selector_ids]
    grads = [[p.grad for p in params if p.grad is not None] for params in (own, selector)]
    device = next(
        (g.device for group in grads for g in group), next((p.device for p in model.parameters()), torch.device("cpu"))
    )
    reduce_over, local = _local_gradients(grads, process_group)
    infinite = math.isinf(norm_type)
    # Sums in fp32 at least (bf16 squares lose the small gradients), fp64 for fp64 gradients.
    dtype = torch.float32
    for g in (g for group in grads for g in group):
        dtype = torch.promote_types(dtype, g.dtype)
    with torch.no_grad():
        # Row 0: pieces summed over the ranks (shards); row 1: pieces every rank holds whole.
        totals = torch.zeros(2, 2, dtype=dtype, device=device)
        for group, pieces in enumerate(local):
            for row, tensors in enumerate(pieces):
                if tensors:
                    norms = torch.stack(
                        [torch.linalg.vector_norm(t, norm_type, dtype=dtype).to(device) for t in tensors]
                    )
                    totals[row, group] = norms.max() if infinite else norms.pow(norm_type).sum()
        if reduce_over:
            op = torch.distributed.ReduceOp.MAX if infinite else torch.distributed.ReduceOp.SUM
            shard_totals = totals[0].contiguous()
            for handle in reduce_over:
                torch.distributed.all_reduce(shard_totals, op=op, group=handle)
            totals[0] = shard_totals
        combined = totals.max(dim=0).values if infinite else totals.sum(dim=0).pow(1.0 / norm_type)
        coefficients = (max_norm / (combined + 1e-6)).clamp(max=1.0)
        for group, pieces in enumerate(local):
            by_device: dict[torch.device, list[Tensor]] = {}
            for t in (t for row in pieces for t in row):
                by_device.setdefault(t.device, []).append(t)
            for dev, tensors in by_device.items():
                # In place on the local pieces: a DTensor's local tensor is its storage (FSDP2 keeps it).
                torch._foreach_mul_(tensors, coefficients[group].to(dev))
    return combined[0], combined[1]


def _local_gradients(grads: list[list[Tensor]], process_group) -> tuple[list, list[list[list[Tensor]]]]:
    """Split each group's gradients into (pieces to sum over the ranks, pieces held whole); also the
    process groups to all-reduce over (empty = nothing is sharded)."""
    from torch.distributed.tensor import DTensor

    meshes = {}
    local: list[list[list[Tensor]]] = []
    for group in grads:
        sharded, whole = [], []
        for grad in group:
            if isinstance(grad, DTensor):
                if process_group is not None:
                    raise ValueError(
                        "clip_grad_norms: process_group is for plain sharded gradients (FSDP1); "
                        "DTensor gradients carry their own mesh, pass process_group=None"
                    )
                if any(placement.is_partial() for placement in grad.placements):
                    raise ValueError(
                        f"clip_grad_norms: a DTensor gradient has a Partial placement "
                        f"({grad.placements}); reduce it before clipping"
                    )
                shard_dims = tuple(i for i, placement in enumerate(grad.placements) if placement.is_shard())
                meshes[(grad.device_mesh, shard_dims)] = (grad.device_mesh, shard_dims)
                (sharded if shard_dims else whole).append(grad.to_local())
            elif process_group is not None:
                sharded.append(grad)
            else:
                whole.append(grad)
        local.append([sharded, whole])
    sharded_meshes = [key for key in meshes.values() if key[1]]
    if len(sharded_meshes) > 1:
        raise ValueError(
            f"clip_grad_norms: DTensor gradients are sharded over {len(sharded_meshes)} different "
            "meshes or mesh dimensions; one reduction cannot combine them"
        )
    if sharded_meshes:
        mesh, shard_dims = sharded_meshes[0]
        return [mesh.get_group(dim) for dim in shard_dims], local
    if process_group is not None:
        return [process_group], local
    return [], local


_PER_LAYER_STATS = ("mass_recall_mean", "mass_recall_p5", "oracle_mass_recall_mean", "oracle_density_r90")
"""Stats also reported per layer (``layers/<i>/<name>``, i = the module's order in ``model``): a
selector that fails in one layer hides in the average over layers."""


def collect_attention_stats(model: nn.Module) -> dict[str, float]:
    """``stats()`` of every ``SparseAttention`` in ``model``: counts (``fallbacks/*``, ``replay/*``)
    summed, everything else averaged over the modules that report it (NaNs ignored), and the recall
    metrics of each layer under ``layers/<i>/``."""
    sums: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    per_layer: dict[str, float] = {}
    for layer, module in enumerate(_sparse_modules(model)):
        for key, value in module.stats().items():
            if key.startswith(("fallbacks/", "replay/")):
                sums[key] = sums.get(key, 0.0) + value
            elif not math.isnan(value):
                values.setdefault(key, []).append(value)
                if key in _PER_LAYER_STATS:
                    per_layer[f"layers/{layer}/{key}"] = value
    out = {key: sum(vals) / len(vals) for key, vals in values.items()}
    out.update(per_layer)
    out.update(sums)
    return out
