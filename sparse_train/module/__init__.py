"""The ``nn.Module`` layer: :class:`SparseAttention` (selector -> index -> kernel, fallbacks, distillation),
activation checkpointing that keeps the attention outputs, and the model-wide collection of selector losses,
statistics and gradient clipping."""
