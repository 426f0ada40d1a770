"""Kernels: the PyTorch references that define their semantics (``reference``), the Triton kernels (``triton``)
and the Gluon kernels for Hopper (``gluon``). The Triton and Gluon modules are imported on first use: they pull
in ``triton`` and, on CPU, need ``TRITON_INTERPRET=1`` set before they are first imported."""

from .reference.attention import reference_sparse_attention

__all__ = ["reference_sparse_attention"]
