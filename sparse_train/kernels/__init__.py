"""Kernels: the PyTorch references that define their semantics (``reference``), the Triton kernels (``triton``)
and the Gluon kernels for Hopper (``gluon``).

The Triton and Gluon modules are imported on first use, through :func:`triton_kernels`, the one place that
loads them: they import ``triton`` and, on CPU, need ``TRITON_INTERPRET=1`` set before they are first imported,
so ``import sparse_train`` (and every PyTorch path) does without them."""

__all__ = ["triton_kernels"]


def triton_kernels():
    """The Triton kernel package :mod:`sparse_train.kernels.triton` (its launchers as submodules: ``op``,
    ``pool``, ``scores``, ``unrotate``, ``index_queries``, ``index_scores``, ``index_candidates``, ``topk``,
    ``canonical``, ``draw``, ``block_mass``, ``token_kl``, ``schedule``), imported on the first call."""
    from . import triton as kernels

    return kernels
