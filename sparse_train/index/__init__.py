"""The block index: the canonical selection of key blocks per query block (:class:`BlockIndex`, made canonical
by :func:`canonicalize`) and its geometry helpers (the capacity tier, the last causal key block, the document
tests of key blocks)."""

from .block_index import (
    INDEX_CHECKS,
    BlockIndex,
    canonicalize,
    capacity_tier,
    causal_last_block,
    document_sink_candidates,
    shares_document,
)

__all__ = [
    "INDEX_CHECKS",
    "BlockIndex",
    "canonicalize",
    "capacity_tier",
    "causal_last_block",
    "document_sink_candidates",
    "shares_document",
]
