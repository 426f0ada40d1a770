"""The launch schedule of one Triton attention call: the plan of its index, the cold slots of the hybrid
backward, the atomic workspace, the split count and the tiles of every kernel (:func:`attention_schedule`)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..options import check_fused_dq_allowed, check_no_plan_with_query_blocks, normalize_kernel_options
from .plan import BlockPlan, build_plan, cold_capacity, cold_slots
from .tuning import BackwardConfig, ForwardConfig, backward_config, forward_config, forward_num_splits

__all__ = ["AttentionSchedule", "attention_schedule"]


class AttentionSchedule(NamedTuple):
    """Everything the Triton attention needs besides the tensors (see :func:`attention_schedule`)."""

    plan: BlockPlan
    slots: Tensor
    """:func:`cold_slots` of the plan (all -1 in deterministic mode)."""
    cold_capacity: int
    """Blocks of the atomic workspace (:func:`cold_capacity`; 0: no block can be cold)."""
    num_splits: int
    forward: ForwardConfig
    backward: BackwardConfig


def attention_schedule(
    index,
    group: int,
    head_dim: int,
    device,
    kernel_options=None,
    deterministic: bool = False,
    query_blocks: Tensor | None = None,
) -> AttentionSchedule:
    """The launch schedule of one attention call over ``index``: its plan (``kernel_options.plan``, or
    ``index.plan(r0)``), the cold slots (none in deterministic mode: every block KV-centric), the
    atomic workspace size and the split count (``kernel_options.num_splits`` or
    :func:`forward_num_splits` from the index capacity, the longest row the shape allows) and the tiles
    of every kernel. ``group`` = HQ / HKV, ``device`` the one the kernels run on.

    Every number here follows from shapes and options, never from the selection's values, so building
    the schedule reads nothing back to the host (CUDA-graph capture, ``torch.compile(fullgraph=True)``).

    ``query_blocks`` (checked int64 ``[NQL]``): the schedule of a call that computes only these query
    blocks (context parallelism): the plan of their index rows (:func:`build_plan` with
    ``query_blocks``, built per call; ``kernel_options.plan`` is refused) and the split count of NQL
    query blocks.

    Raises:
        ValueError: ``kernel_options.plan`` together with ``query_blocks``."""
    options = normalize_kernel_options(kernel_options)
    if query_blocks is not None:
        check_no_plan_with_query_blocks(options)
        plan = build_plan(index, options.r0, query_blocks=query_blocks)
    else:
        plan = options.plan if options.plan is not None else index.plan(options.r0)
    check_fused_dq_allowed(options, deterministic)
    # the fused and the stored-dS backward take every block KV-centric (its kernel produces dQ's inputs); no
    # block is cold
    every_block_kv_centric = deterministic or bool(options.fused_dq) or bool(options.stored_ds)
    slots = cold_slots(plan.hot, plan.reuse, every_block_kv_centric or plan.r0 <= 1)
    cold = cold_capacity(plan.reuse.numel(), plan.r0, every_block_kv_centric)
    forward = forward_config(group, index.block_q, index.block_k, head_dim, options, device)
    backward = backward_config(
        group, index.block_q, index.block_k, head_dim, cold > 0, options, device, query_map=query_blocks is not None
    )
    num_splits = options.num_splits or forward_num_splits(
        index.num_q_blocks if query_blocks is None else query_blocks.numel(),
        index.batch,
        index.num_kv_heads,
        group,
        forward.heads_per_program,
        index.capacity,
        device,
    )
    return AttentionSchedule(plan, slots, cold, num_splits, forward, backward)
