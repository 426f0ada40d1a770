"""Learned block selection: the block scorers (``scorer``: pooled; ``indexer``: token-level and oracle) + top-k,
distillation targets and loss (``distill``), selection-quality metrics (``metrics``) and activation-checkpoint
replay of selections (``replay``).

This is a subpackage on purpose: a top-level ``selectors`` package would shadow the standard
library module of that name and break ``import torch`` when Python runs from the repository root.
"""

from .distill import block_kl, dense_block_mass, query_row_positions, sparse_block_mass
from .indexer import OracleSelector, TokenIndexer, build_selector
from .metrics import (
    draw_query_blocks,
    needle_block_recall,
    oracle_budget,
    row_mass_recall,
    sample_query_blocks,
    selection_quality,
)
from .replay import SelectionRecord, SelectionReplay, in_backward_pass
from .scorer import (
    BlockScorer,
    SelectionGeometry,
    allowed_dynamic_blocks,
    block_mean,
    causal_block_mask,
    rope_inverse_frequencies,
    selection_candidates,
    selection_geometry,
    unrotate,
)

__all__ = [
    "BlockScorer",
    "OracleSelector",
    "TokenIndexer",
    "build_selector",
    "SelectionGeometry",
    "SelectionRecord",
    "SelectionReplay",
    "allowed_dynamic_blocks",
    "block_kl",
    "block_mean",
    "causal_block_mask",
    "dense_block_mass",
    "draw_query_blocks",
    "in_backward_pass",
    "needle_block_recall",
    "oracle_budget",
    "row_mass_recall",
    "rope_inverse_frequencies",
    "query_row_positions",
    "sample_query_blocks",
    "selection_candidates",
    "selection_geometry",
    "selection_quality",
    "sparse_block_mass",
    "unrotate",
]
