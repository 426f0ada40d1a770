"""Context parallelism in Lightning: the :class:`ContextParallel` callback (``sparse-train fit --cp 2``).

The ``world_size`` ranks form a :class:`~torch.distributed.device_mesh.DeviceMesh` ``("dp", "cp")`` of shape
``(world_size / cp, cp)``: rank ``r`` is position ``r % cp`` of context-parallel (CP) group ``r // cp``, so each
group is ``cp`` consecutive ranks. The ranks of a CP group train on one sequence together: they load the SAME
rows, each keeps its zig-zag shard of the sequence (:func:`~sparse_train.parallel.context_parallel.shard_sequence`:
tokens and labels; ``document_ids`` stays global), and the model runs under
:func:`~sparse_train.parallel.context_parallel.enable_context_parallel` over the group (RoPE at global positions, K/V
all-gathered in each attention layer, the selector's index built from every rank's local selection). The
``world_size / cp`` groups are data-parallel (DP) replicas: they load different rows
(:func:`data_parallel_rank`, which the data modules shard by).

Gradients. Each rank's parameter gradients are partial sums (its own tokens' loss terms, plus, through the
reduce-scatter in the backward of the K/V all-gather, the other ranks of its group's contributions to its own
keys). DDP's all-reduce, or FSDP's reduce-scatter, averages them over the whole world, so the losses are scaled
to make that average the gradient of the global batch (the rows of every replica):

* the LM loss sum of a rank is divided by (labelled tokens of ALL ranks / world size), the normalisation
  :class:`~sparse_train.lightning.training.CausalLMTraining` already uses for data parallelism: the DDP
  average is then the gradient of the mean over every labelled token of the global batch, however the
  tokens are spread over the rows and the shards;
* a selector's distillation loss under CP is the rank's share of its group's loss (its KL sum over its rows
  / the valid rows of the group's ranks), so the training step multiplies it by the CP size: the average over
  all ranks is then the mean over the replicas of each replica's selector loss, as in data parallelism without
  CP (where DDP averages the ranks' own losses). That is the selector loss of the global batch when every
  replica has the same number of valid distillation rows (rows without ``seq_lens`` or ``document_ids``: the
  valid rows then depend only on the shapes); with packed documents or ``seq_lens`` the replicas' counts can
  differ, and each replica's loss (a mean over its own valid rows) still weighs ``1 / dp`` in the average.

So one DP x CP step computes the single-process gradient of the global batch (tested on CPU processes only:
``tests/parallel/test_context_parallel_fit.py``, cp = 2 alone and dp = 2 x cp = 2, under DDP and under FSDP).

FSDP (Lightning's ``FSDPStrategy``, FSDP1): the parameters are sharded over the whole world, FSDP's default
process group, whose reduce-scatter divides by the world size as DDP's all-reduce does, so the normalisation
above holds unchanged; the CP collectives run over the mesh's ``cp`` groups, next to it. The callback's
``setup`` runs before the strategy wraps the model (Lightning calls the setup hooks, then ``configure_model``,
then wraps), and FSDP1 wraps by composition: the attention modules inside the layers' units are the objects
:func:`~sparse_train.parallel.context_parallel.enable_context_parallel` switched. The gradient clipping reduces the
shards' norms over FSDP's group (``gradient_shard_group``: the world). Hybrid sharding and an FSDP
``process_group`` / ``device_mesh`` of the user's are refused: the first is untested next to the mesh, the
second would shard and average over another group than the world the losses are normalised by.

Supported: DDP (``--trainer.strategy=ddp``) and FSDP (``--trainer.strategy=fsdp``; FULL_SHARD tested,
SHARD_GRAD_OP and NO_SHARD accepted, they reduce over the same group) with ``world_size`` a multiple of
``cp``, our :class:`~sparse_train.lightning.model.Transformer` (sparse or dense attention). Refused with a
ValueError: ``world_size`` not a multiple of ``cp``, every other strategy (DeepSpeed included), FSDP's HYBRID_SHARD and
_HYBRID_SHARD_ZERO2, ``FSDPStrategy(process_group=...)`` or ``device_mesh=...``, the Hugging Face module,
Lightning's distributed sampler (the ranks of a CP group must load the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

from ..parallel import context_parallel as cpm
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
            raise ValueError(
                "context parallelism: batches with position_ids (the Hugging Face module's packed "
                "rows) are not supported; use the repository's Transformer (document_ids)"
            )
        out = dict(batch)
        for key in ("tokens", "labels"):
            cpm.check_layout(batch[key].shape[1], self.size)
            out[key] = cpm.shard_sequence(batch[key], 1, self.rank, self.size)
        return out


class ContextParallel(Callback):
    """Shard every sequence over ``size`` ranks (context parallelism); see the module docstring.

    Args:
        size: ranks per sequence (the CP degree), >= 1; must divide the trainer's world size (the
            ``world_size / size`` CP groups are data-parallel replicas).
        backend: attention backend of the CP attention (``None``: the sparse config's ``backend``; the
            dense twin uses ``"reference"`` unless given).

    Raises (at ``setup``, before any training):
        ValueError: ``world_size`` not a multiple of ``size``; a strategy other than DDP and FSDP; FSDP with
            hybrid sharding or a ``process_group`` / ``device_mesh`` of the user's; a model other than the
            repository's ``Transformer``; ``use_distributed_sampler=True``.
    """

    def __init__(self, size: int = 2, backend: str | None = None) -> None:
        super().__init__()
        self.size = check_int("ContextParallel.size", size, minimum=1)
        if backend is not None and not isinstance(backend, str):
            raise ValueError(f"ContextParallel.backend must be a backend name or None, got {backend!r}")
        self.backend = backend
        self.shards: ContextParallelShards | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.size == 1:
            return
        world = trainer.world_size
        if world % self.size:
            raise ValueError(
                f"context parallelism: world_size={world} is not a multiple of cp={self.size}; the "
                f"ranks form world_size / cp groups of cp consecutive ranks, each group sharding one "
                f"sequence and the groups training on different rows"
            )
        if isinstance(trainer.strategy, FSDPStrategy):
            _check_fsdp(trainer.strategy)
        # DeepSpeed subclasses DDPStrategy but shards and reduces on its own terms: untested with the mesh
        elif not isinstance(trainer.strategy, DDPStrategy) or isinstance(trainer.strategy, DeepSpeedStrategy):
            raise ValueError(
                f"context parallelism runs under DDP or FSDP (--trainer.strategy=ddp or fsdp), which "
                f"average the ranks' partial gradients over the world; got "
                f"{type(trainer.strategy).__name__}"
            )
        model = getattr(pl_module, "model", None)
        if not isinstance(model, Transformer):
            raise ValueError(
                f"context parallelism supports sparse_train.lightning.model.Transformer "
                f"(SparseLMModule), got {type(model).__name__}"
            )
        if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError(
                "context parallelism: the ranks of one sequence must load the same rows; set "
                "--trainer.use_distributed_sampler=false"
            )
        from torch.distributed.device_mesh import init_device_mesh

        device_type = trainer.strategy.root_device.type
        # data_parallel_rank gives the cp consecutive ranks from r // cp * cp the same rows; the mesh's cp group
        # must be exactly those ranks (row-major layout, checked below), or a group would shard unrelated rows.
        mesh = init_device_mesh(device_type, (world // self.size, self.size), mesh_dim_names=("dp", "cp"))
        group = mesh.get_group("cp")
        first = trainer.global_rank // self.size * self.size
        ranks = torch.distributed.get_process_group_ranks(group)
        if ranks != list(range(first, first + self.size)):
            raise RuntimeError(
                f"context parallelism: the device mesh put global rank {trainer.global_rank} in the "
                f"cp group {ranks}, not in the consecutive ranks data_parallel_rank loads the same "
                f"rows on ({first}..{first + self.size - 1})"
            )
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


def _check_fsdp(strategy: FSDPStrategy) -> None:
    """Refuse the FSDP configurations whose gradient average is not the plain mean over the world that the
    loss normalisation assumes, or that nothing has tested next to the ``("dp", "cp")`` mesh."""
    from torch.distributed.fsdp import ShardingStrategy

    hybrid = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if strategy.sharding_strategy in hybrid:
        raise ValueError(
            f"context parallelism under FSDP: sharding_strategy={strategy.sharding_strategy.name} is "
            f"not supported (FSDP builds its own per-node shard and replica groups next to the "
            f"('dp', 'cp') mesh; untested); use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, which reduce the "
            f"gradients over the whole world"
        )
    for key in ("process_group", "device_mesh"):
        if strategy.kwargs.get(key) is not None:
            raise ValueError(
                f"context parallelism under FSDP: FSDPStrategy({key}=...) is not supported; FSDP must "
                f"shard and average the gradients over the default process group (the whole world), "
                f"which the loss normalisation divides by"
            )


def data_parallel_rank(trainer: Trainer | None) -> tuple[int, int]:
    """``(rank, world)`` of the trainer's process among the data-parallel replicas: the ranks of one
    context-parallel group (``cp`` consecutive global ranks, the ``ContextParallel`` mesh's layout) count as
    one replica and load the same rows; replica ``global_rank // cp`` of ``world_size // cp``. Without a
    trainer ``(0, 1)``."""
    if trainer is None:
        return 0, 1
    rank, world = int(trainer.global_rank), int(trainer.world_size)
    for callback in getattr(trainer, "callbacks", ()):  # test doubles of a trainer may have none
        if isinstance(callback, ContextParallel) and callback.size > 1:
            return rank // callback.size, max(1, world // callback.size)
    return rank, world
