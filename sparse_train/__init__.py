"""sparse_train: learned block-sparse attention for long-context transformer training.

Public API::

    import sparse_train as st
    idx = st.BlockIndex.from_selection(selected, seq_len=N, block_q=64, block_k=64, window=8, sinks=1)
    o = st.sparse_attention(q, k, v, idx)                     # q [B, HQ, N, D], k/v [B, HKV, N, D]
    attn = st.SparseAttention(st.SparseAttentionConfig(...), num_heads=HQ, num_kv_heads=HKV, head_dim=D)
"""

from .config import SparseAttentionConfig
from .documents import (
    block_document_ranges,
    cu_seqlens_from_document_ids,
    document_ids_from_cu_seqlens,
    document_ids_from_position_ids,
)
from .functional import sparse_attention
from .index.block_index import BlockIndex
from .losses import linear_cross_entropy
from .module.attention import SparseAttention
from .module.checkpointing import checkpoint_keeping_attention, keep_attention_context
from .module.collection import clip_grad_norms, collect_attention_stats, collect_selector_losses, selector_parameters
from .options import KernelOptions
from .parallel.context_parallel import (
    context_parallel_sparse_attention,
    disable_context_parallel,
    enable_context_parallel,
)
from .plan.plan import DEFAULT_R0, BlockPlan

__version__ = "0.1.0"

__all__ = [
    "BlockIndex",
    "BlockPlan",
    "DEFAULT_R0",
    "KernelOptions",
    "SparseAttention",
    "SparseAttentionConfig",
    "block_document_ranges",
    "checkpoint_keeping_attention",
    "clip_grad_norms",
    "collect_attention_stats",
    "collect_selector_losses",
    "context_parallel_sparse_attention",
    "cu_seqlens_from_document_ids",
    "disable_context_parallel",
    "document_ids_from_cu_seqlens",
    "document_ids_from_position_ids",
    "enable_context_parallel",
    "keep_attention_context",
    "linear_cross_entropy",
    "selector_parameters",
    "sparse_attention",
    "__version__",
]
