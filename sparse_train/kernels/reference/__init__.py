"""PyTorch references that define the kernels' semantics: sparse attention (``attention``), the block mass of
the distillation target (``block_mass``) and the selector's block pooling (``pool``)."""

from .attention import reference_sparse_attention

__all__ = ["reference_sparse_attention"]
