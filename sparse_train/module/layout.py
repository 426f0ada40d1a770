"""Where the rows of a :class:`~sparse_train.module.attention.SparseAttention` call sit in the sequence: the
strategy its forward calls for the steps that depend on it.

:class:`SequenceLayout` is the default: the whole sequence on this process. Context parallelism replaces it
from outside (:func:`~sparse_train.parallel.context_parallel.enable_context_parallel` sets
``module.layout`` to a :class:`~sparse_train.parallel.context_parallel.ContextParallelLayout`), which holds
one zig-zag shard of the sequence per rank and supplies the local pieces: the input checks of a shard, the
RoPE positions and valid lengths of the local rows, the local query blocks, the all-gather of keys and of
selections, the attention of the local rows and the distillation loss's cross-rank reductions. The forward
itself is written once, in terms of these steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from ..functional import resolve_backend, sparse_attention
from ..index.block_index import BlockIndex

if TYPE_CHECKING:
    from .attention import SparseAttention

__all__ = ["SequenceLayout"]


class SequenceLayout:
    """The whole sequence on this process (the default layout of ``SparseAttention``)."""

    splits_sequence = False
    """Whether this process holds only part of the sequence (then every path attends through an index,
    since dense SDPA cannot attend local query rows over gathered keys)."""

    def check_inputs(
        self,
        module: SparseAttention,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_lens: Tensor | None,
        document_ids: Tensor | None,
        position_ids: Tensor | None,
    ) -> int:
        """Check a call's inputs (the module's rules; their values are checked by the path that runs) and
        return the sequence length N."""
        module._check_inputs(q, k, v, seq_lens, document_ids, position_ids)
        return q.shape[2]

    def pooling_rows(
        self, seq_len: int, seq_lens: Tensor | None, position_ids: Tensor | None, device
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(valid_len, positions)`` of the rows here, as :meth:`BlockScorer.pool` takes them: the
        per-batch count of valid rows and their RoPE positions (None: ``0..N-1``)."""
        return seq_lens, position_ids

    def query_blocks(self, seq_len: int, block_q: int, device) -> Tensor | None:
        """The global query blocks whose rows are here (None: all of them, in order)."""
        return None

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """``x`` of the rows here, along ``dim``, completed to the whole sequence in global order."""
        return x

    def dropout_seed(self, draw: Callable[[], int]) -> int:
        """This call's dropout seed: ``draw()`` here (under context parallelism drawn on one rank and shared,
        so every rank drops the same elements)."""
        return draw()

    def backend(
        self, module: SparseAttention, q: Tensor, k: Tensor, v: Tensor, index: BlockIndex, document_ids: Tensor | None
    ) -> tuple[str, str]:
        """``(backend, reason)`` of the attention over ``index`` (:func:`~sparse_train.functional.resolve_backend`
        of the config's backend)."""
        return resolve_backend(q, k, v, index, module.config.backend, document_ids=document_ids)

    def plan(self, index: BlockIndex, r0: int | None):
        """The block plan the Triton kernels reuse for ``index`` (None: each call builds its own)."""
        return index.plan(r0)

    def attention(
        self,
        module: SparseAttention,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        index: BlockIndex,
        *,
        selected: bool,
        plan,
        backend: str,
        scale: float,
        dropout_p: float,
        dropout_seed: int | None,
        seq_lens: Tensor | None,
        document_ids: Tensor | None,
        check_values: bool,
    ) -> tuple[Tensor, Tensor]:
        """``(o, lse)`` of the rows here over ``index`` (the selection when ``selected``, else the full causal
        index of the dense path with dropout)."""
        return sparse_attention(
            q,
            k,
            v,
            index,
            scale=scale,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
            deterministic=module.config.deterministic,
            return_lse=True,
            backend=backend,
            seq_lens=seq_lens,
            document_ids=document_ids,
            kernel_options={"plan": plan, **module._kernel_options()},
            check_values=check_values,
        )

    def distillation_loss(
        self,
        module: SparseAttention,
        q: Tensor,
        k: Tensor,
        scores: Tensor,
        index: BlockIndex | None,
        lse: Tensor | None,
        seq_lens: Tensor | None,
        scale: float,
        geometry,
        mode: str,
        distill_blocks: Tensor | None,
        document_ids: Tensor | None,
        check_values: bool,
        target=None,
        row_scores=None,
    ) -> tuple[Tensor, tuple]:
        """The selector's distillation loss of this call and its target (see
        :meth:`SparseAttention._distillation_loss`)."""
        return module._distillation_loss(
            q,
            k,
            scores,
            index,
            lse,
            seq_lens,
            scale,
            geometry,
            mode,
            distill_blocks,
            document_ids,
            check_values,
            target,
            row_scores,
        )
