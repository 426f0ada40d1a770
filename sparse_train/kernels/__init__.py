"""Kernels: the Triton forward/backward (``forward``, ``backward``, ``op``) and block-mass
(``block_mass``) kernels, and the PyTorch references that define their semantics (``reference``,
``reference_block_mass``). Import the Triton modules lazily: they pull in
``triton`` and, on CPU, need ``TRITON_INTERPRET=1`` set before they are first imported."""

from .reference import reference_sparse_attention

__all__ = ["reference_sparse_attention"]
