"""Which learned selector a state dict's weights belong to, checked before they load.

The pooled scorer (:class:`~sparse_train.selection.scorer.BlockScorer`) and the token indexer
(:class:`~sparse_train.selection.indexer.TokenIndexer`) name their parameters alike (``query_proj``, ``key_proj``,
``log_temperature``, ``distance_bias``) but shape them differently:

- pooled: ``query_proj`` ``[HKV, P_q D, S]``, ``key_proj`` ``[HKV, P_k D, S]`` with P = 2 for ``"mean_max"`` pooling
  and 1 for ``"mean"``;
- token: ``query_proj`` ``[HKV, G D, E S]`` (G the GQA group, E the index heads), ``key_proj`` ``[HKV, D, S]``.

:func:`check_selector_state` reads those shapes and, where they can only be the other selector's, raises a
``ValueError`` that names ``SparseAttentionConfig.selector`` instead of letting the load report a size mismatch.
Shapes that fit either selector (a pooled scorer with ``key_pooling="mean"`` whose query width equals the token
indexer's, E = 1) cannot be told apart and load as they are.
"""

from __future__ import annotations

from torch import Tensor, nn

from .indexer import TokenIndexer
from .scorer import BlockScorer

__all__ = ["check_selector_state"]


def _shapes(state_dict: dict, prefix: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    query, key = state_dict.get(prefix + "query_proj"), state_dict.get(prefix + "key_proj")
    if not (isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() == 3 and key.dim() == 3):
        return None
    return tuple(query.shape), tuple(key.shape)


def _pooled_layout(query: tuple[int, ...], key: tuple[int, ...], head_dim: int) -> bool:
    """Shapes a pooled scorer of head dim D can have: widths D or 2 D, one selector dim."""
    return query[1] in (head_dim, 2 * head_dim) and key[1] in (head_dim, 2 * head_dim) and query[2] == key[2]


def check_selector_state(scorer: nn.Module, state_dict: dict, prefix: str) -> None:
    """Raise a ``ValueError`` when the selector weights under ``prefix`` in ``state_dict`` belong to the other learned
    selector than ``scorer`` (a :class:`BlockScorer` or a :class:`TokenIndexer`; any other scorer, or a state dict
    without the weights, passes). Called by ``SparseAttention`` before its state dict loads."""
    shapes = _shapes(state_dict, prefix)
    if shapes is None or not isinstance(scorer, (BlockScorer, TokenIndexer)):
        return
    query, key = shapes
    own = tuple(scorer.query_proj.shape), tuple(scorer.key_proj.shape)
    if (query, key) == own:
        return
    d = scorer.head_dim
    saved = f"query_proj {list(query)}, key_proj {list(key)}"
    where = f"the state dict's selector weights at {prefix or '<root>'!r} ({saved})"
    if isinstance(scorer, TokenIndexer):
        if not _pooled_layout(query, key, d) or (key[1] == d and query[1] == scorer.group * d):
            return  # another token indexer's shapes, or either selector's: the load itself reports a mismatch
        another = "" if key[1] == 2 * d else " (or a token selector's of another GQA group)"
        raise ValueError(
            f"{where} are a pooled selector's{another}, and this layer has the token selector "
            "(SparseAttentionConfig.selector='token', the default): build it with selector='pooled' (and the "
            "saved query_pooling / key_pooling) to load them"
        )
    # BlockScorer: a token indexer's key projection has width D, its query projection G D x E S
    if key[1] != d or (_pooled_layout(query, key, d) and scorer.key_pooling == "mean"):
        return
    if _pooled_layout(query, key, d):
        raise ValueError(
            f"{where} are a token selector's or a pooled one's with key_pooling='mean', and this layer has the pooled "
            f"selector with key_pooling={scorer.key_pooling!r} (SparseAttentionConfig.selector='pooled'): build it "
            "with the saved selector (selector='token', the default, or key_pooling='mean') to load them"
        )
    raise ValueError(
        f"{where} are a token selector's, and this layer has the pooled selector "
        "(SparseAttentionConfig.selector='pooled'): build it with selector='token' (the default) and the saved "
        "selector_index_heads / selector_dim to load them"
    )
