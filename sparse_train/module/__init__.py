"""The ``nn.Module`` layer: :class:`~sparse_train.module.attention.SparseAttention` (selector -> index -> kernel,
fallbacks, distillation, and the model-wide collection of selector losses, statistics and gradient clipping),
its sequence layout (:mod:`~sparse_train.module.layout`: the whole sequence, or under context parallelism one
rank's shard) and activation checkpointing that keeps the attention outputs
(:mod:`~sparse_train.module.checkpointing`)."""
