"""The block index: the canonical selection of key blocks per query block (:class:`BlockIndex`, made canonical
by :func:`canonicalize`) and its geometry helpers."""

from .block_index import INDEX_CHECKS, BlockIndex, canonicalize

__all__ = ["INDEX_CHECKS", "BlockIndex", "canonicalize"]
