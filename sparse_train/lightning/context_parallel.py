"""Context parallelism in Lightning: the :class:`ContextParallel` callback (``sparse-train fit --cp 2``).

W ranks train on one sequence together: every rank loads the SAME batch, keeps its zig-zag shard of the
sequence (:func:`~sparse_train.context_parallel.shard_sequence`: tokens and labels; ``document_ids`` stays
global), and the model runs under :func:`~sparse_train.context_parallel.enable_context_parallel` (RoPE at
global positions, K/V all-gathered in each attention layer, the selector's index built from every rank's
local selection).

Gradients. Each rank's parameter gradients are partial sums (its own tokens' loss terms, plus, through the
reduce-scatter in the backward of the K/V all-gather, the other ranks' contributions to its own keys). DDP
over the CP ranks all-reduces them; it averages, so the losses are scaled to make the average the sum:

* the LM loss sum of a rank is divided by (labelled tokens of all ranks / world size), the normalisation
  :class:`~sparse_train.lightning.training.CausalLMTraining` already uses for data parallelism; with CP
  the ranks' token sets are the shards of one sequence instead of other rows, and the same division makes
  the DDP average the gradient of the mean over the sequence's labelled tokens;
* a selector's distillation loss under CP is already the rank's share of the single-process loss (its KL
  sum over its rows / the valid rows of all ranks), so the training step multiplies it by the CP size
  before DDP's average divides by it.

So one CP step computes the single-process gradient of the same batch (tested: ``tests/test_context_parallel_fit.py``).

Supported: DDP (``--trainer.strategy=ddp``) with ``world_size == cp`` (one sequence over all ranks), our
:class:`~sparse_train.lightning.model.Transformer` (sparse or dense attention). Refused with a ValueError:
``world_size != cp`` (data parallelism across CP groups), FSDP and every other strategy, the Hugging Face
module, Lightning's distributed sampler (the ranks of a CP group must load the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy

from .. import context_parallel as cpm
from ..validation import check_int
from .model import Transformer

__all__ = ["ContextParallel", "ContextParallelShards"]


@dataclass(frozen=True)
class ContextParallelShards:
    """What the training step needs to know: the CP group, this rank in it and its size."""

    group: Any
    rank: int
    size: int

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard of a batch: ``tokens`` and ``labels`` (``[B, N]``) in the zig-zag layout;
        ``document_ids`` (and every other key) unchanged, since the model takes them GLOBAL.

        Raises:
            ValueError: N not a multiple of ``2 * size`` (the model checks the block sizes), or a
                ``position_ids`` key (the Hugging Face path, not supported under CP)."""
        if "position_ids" in batch:
            raise ValueError("context parallelism: batches with position_ids (the Hugging Face module's packed "
                             "rows) are not supported; use the repository's Transformer (document_ids)")
        out = dict(batch)
        for key in ("tokens", "labels"):
            cpm.check_layout(batch[key].shape[1], self.size)
            out[key] = cpm.shard_sequence(batch[key], 1, self.rank, self.size)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the CP group (evaluation counts)."""
        return cpm.all_reduce_sum(x, self.group)


class ContextParallel(Callback):
    """Shard every sequence over ``size`` ranks (context parallelism); see the module docstring.

    Args:
        size: ranks per sequence (the CP degree), >= 1; must equal the trainer's world size.
        backend: attention backend of the CP attention (``None``: the sparse config's ``backend``; the
            dense twin uses ``"reference"`` unless given).

    Raises (at ``setup``, before any training):
        ValueError: ``world_size != size``; a strategy other than DDP; a model other than the repository's
            ``Transformer``; ``use_distributed_sampler=True``.
    """

    def __init__(self, size: int = 2, backend: Optional[str] = None) -> None:
        super().__init__()
        self.size = check_int("ContextParallel.size", size, minimum=1)
        if backend is not None and not isinstance(backend, str):
            raise ValueError(f"ContextParallel.backend must be a backend name or None, got {backend!r}")
        self.backend = backend
        self.shards: Optional[ContextParallelShards] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.size == 1:
            return
        world = trainer.world_size
        if world != self.size:
            raise ValueError(f"context parallelism: cp={self.size} needs world_size == cp (one sequence over all "
                             f"ranks), got world_size={world}; data parallelism across CP groups is not supported yet")
        if not isinstance(trainer.strategy, DDPStrategy):
            raise ValueError(f"context parallelism runs under DDP (--trainer.strategy=ddp), which all-reduces the "
                             f"ranks' partial gradients; got {type(trainer.strategy).__name__}")
        model = getattr(pl_module, "model", None)
        if not isinstance(model, Transformer):
            raise ValueError(f"context parallelism supports sparse_train.lightning.model.Transformer "
                             f"(SparseLMModule), got {type(model).__name__}")
        if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError("context parallelism: the ranks of one sequence must load the same rows; set "
                             "--trainer.use_distributed_sampler=false")
        from torch.distributed.device_mesh import init_device_mesh

        device_type = trainer.strategy.root_device.type
        mesh = init_device_mesh(device_type, (world // self.size, self.size), mesh_dim_names=("dp", "cp"))
        group = mesh.get_group("cp")
        cpm.enable_context_parallel(model, group, backend=self.backend)
        rank, size = cpm.context_parallel_rank(group)
        self.shards = ContextParallelShards(group, rank, size)
        pl_module.training_logic.context_parallel = self.shards

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.shards is None:
            return
        cpm.disable_context_parallel(pl_module.model)
        pl_module.training_logic.context_parallel = None
        self.shards = None


def data_parallel_rank(trainer: Optional[Trainer]) -> tuple[int, int]:
    """``(rank, world)`` of the trainer's process among the data-parallel replicas: the ranks of one
    context-parallel group count as one replica (they load the same rows). Without a trainer ``(0, 1)``."""
    if trainer is None:
        return 0, 1
    rank, world = int(trainer.global_rank), int(trainer.world_size)
    for callback in getattr(trainer, "callbacks", ()):  # test doubles of a trainer may have none
        if isinstance(callback, ContextParallel) and callback.size > 1:
            return rank // callback.size, max(1, world // callback.size)
    return rank, world
