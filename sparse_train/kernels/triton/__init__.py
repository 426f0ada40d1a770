"""Triton kernels: sparse attention forward/backward and its autograd op (``forward``, ``backward``, ``op``),
the selector's kernels (``pool``, ``scores``, ``unrotate``, ``index_queries``, ``index_scores``,
``index_candidates``, ``topk``, ``canonical``, ``draw``), the distillation target (``block_mass``) and loss
(``token_kl``), the backward's KV schedule (``schedule``); shared ``@triton.jit`` helpers in ``_jit`` and launch
helpers in ``_launch``. On CPU these need ``TRITON_INTERPRET=1`` set before they are first imported; the package
loads through :func:`sparse_train.kernels.triton_kernels`. ``HAS_GLUON``: whether this triton has the Gluon language
of the Hopper kernels (:mod:`sparse_train.kernels.gluon`)."""

from ..gluon.common import HAS_GLUON
from . import (
    block_mass,
    canonical,
    draw,
    index_candidates,
    index_queries,
    index_scores,
    op,
    pool,
    schedule,
    scores,
    token_kl,
    topk,
    unrotate,
)

__all__ = [
    "HAS_GLUON",
    "block_mass",
    "canonical",
    "draw",
    "index_candidates",
    "index_queries",
    "index_scores",
    "op",
    "pool",
    "schedule",
    "scores",
    "token_kl",
    "topk",
    "unrotate",
]
