"""What the selector's score kernels (``kernels/triton/scores.py``, ``kernels/triton/topk.py``) and the
selector's PyTorch paths (:mod:`sparse_train.selection.scorer`) share: the buckets of the learned distance bias
and the score of a key block without any valid key."""

__all__ = ["DISTANCE_BUCKETS", "EMPTY_BLOCK_SCORE"]

DISTANCE_BUCKETS = 16
"""Buckets of the distance bias: 0, 1, 2-3, 4-7, ..., and everything from 2**14 blocks on."""

EMPTY_BLOCK_SCORE = -1.0e30
"""Score of key blocks without any valid key: below every real score, yet finite so top-k still
returns them when a row has nothing better (counts stay shape-determined)."""
