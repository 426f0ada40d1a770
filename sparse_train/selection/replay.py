"""Checkpoint replay: an activation-checkpoint recompute reuses the first forward's selection.

Why: under ``torch.utils.checkpoint`` (reentrant or not) and Hugging Face gradient checkpointing, the
layer's forward runs a second time inside the backward to rebuild the saved tensors. If that rerun
chose its blocks again, a tie in top-k, a rounding difference or selector parameters that changed in
between (an optimizer step, a hook) would give the backward a different function than the one whose
output produced the loss: silently wrong gradients.

Mechanism (no cooperation needed from the caller):

1. *Record.* A first forward with autograd recording stores a :class:`SelectionRecord` (index, plan,
   path, backend, dropout seed, whether distillation ran and on which sampled query blocks: every
   random draw of the forward; the detached distillation target; the packed-document ids it masked
   with) and ties its lifetime to the autograd graph:
   the record sits in ``grad_fn.metadata`` of the attention output (and of the selector scores), so
   it lives exactly as long as a backward through that graph is possible; the module keeps only a
   weak reference.
2. *Detect a recompute.* Checkpoint recomputes run inside the autograd engine, where
   ``torch._C._current_graph_task_id()`` is not -1; an ordinary forward never runs there.
3. *Match.* Candidates are the module's live records of the same batch/length not yet replayed in
   this backward. With one candidate (the normal case) it is the one. With several (two forwards
   before one backward, a module shared inside a checkpointed region) the autograd graph decides: a
   breadth-first walk from the node the engine is executing finds the records reachable from it, and
   the earliest of those in forward order wins (a recompute replays calls in forward order). If the
   walk finds none, the most recent candidate is used and ``ambiguous`` is counted.
4. *Retire.* A matched record is retired when that backward finishes (engine callback), so a later
   step never picks up a stale record even while the old graph is still referenced.

Reentrant checkpointing (``use_reentrant=True``) runs the first forward under ``torch.no_grad`` inside
``CheckpointFunction.forward`` and the recompute in that function's backward, whose node is the ``ctx`` of
the forward. :func:`reentrant_checkpoint_node` finds that node on the Python stack; the module then
computes its distillation loss in the first forward with autograd on for the selector alone (the loss
reaches only the selector's parameters, so its graph lies outside the checkpoint and the caller adds it
to the loss as without checkpointing), and the record hangs on the checkpoint's node: it lives as long as
that backward is possible, and the recompute, which runs while the engine executes that very node, finds
it there (the earliest in forward order when the module ran several times inside the region). Such a
record does not distill again (``distilled`` False): the recompute only attends.

Other reentrant implementations (a checkpoint that is not ``torch.utils.checkpoint``'s) are not
recognised: their first forward runs without autograd, so the selector gets no loss from it and the
recompute finds no record; it selects afresh, counts a ``miss`` and warns once. Inside
``torch.compile`` the bookkeeping is skipped (compiled graphs are traced once).
"""

from __future__ import annotations

import itertools
import sys
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

__all__ = ["SelectionRecord", "SelectionReplay", "in_backward_pass", "reentrant_checkpoint_node"]

_METADATA_KEY = "sparse_train.selection_records"
_CHECKPOINT_KEY = "sparse_train.reentrant_checkpoint_records"
_WALK_LIMIT = 50_000
_MISS_WARNING = (
    "SparseAttention: an activation-checkpoint recompute found no record of its first forward (counted in "
    "replay/misses) and selects its blocks afresh. If that checkpoint is reentrant and not "
    "torch.utils.checkpoint's, its first forward ran without autograd: the selector got no distillation loss "
    "and the backward may attend other blocks than the forward. Use torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=False) (in Hugging Face: gradient_checkpointing_kwargs={'use_reentrant': False})."
)


def in_backward_pass() -> bool:
    """True while the autograd engine executes a backward (where checkpoint recomputes happen)."""
    return torch._C._current_graph_task_id() != -1


def _reentrant_forward_code():
    """The code object of ``torch.utils.checkpoint.CheckpointFunction.forward`` (None if this torch has none)."""
    function = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
    return function.forward.__code__ if function is not None else None


def reentrant_checkpoint_node() -> Any | None:
    """The backward node of the reentrant ``torch.utils.checkpoint`` region whose first forward is running
    (the ``ctx`` of ``CheckpointFunction.forward``, found on the Python stack), or None: outside such a region,
    or when the region has no backward (autograd off around the checkpoint call, or no input that requires
    grad: the node then has no next edges and is never run). Nested regions: the innermost that has one."""
    code = _reentrant_forward_code()
    if code is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            node = frame.f_locals.get("ctx")
            if node is not None and any(next_node is not None for next_node, _ in node.next_functions):
                return node
        frame = frame.f_back
    return None


@dataclass(eq=False)
class SelectionRecord:
    """What the first forward decided; a recompute must decide the same."""

    batch: int
    seq_len: int
    path: str
    """``"sparse"`` (block-sparse kernels) or ``"dense"`` (causal SDPA)."""
    reason: str | None
    """Fallback reason of the dense/reference path, if any."""
    index: Any
    """The ``BlockIndex`` (or None when no selection was made)."""
    plan: Any
    """The ``BlockPlan`` given to the kernels (or None)."""
    backend: str | None
    dropout_seed: int | None
    distilled: bool
    """Whether the recompute computes the distillation loss again: True when the first forward computed it
    inside a non-reentrant checkpoint (the recompute must save the same tensors); False under reentrant
    checkpointing, whose first forward's loss lies outside the checkpoint."""
    distill_blocks: Any = None
    """The query blocks the first forward's ``distill="sampled"`` target was computed on (a random
    draw: the recompute must use the same rows or the selector's gradient changes)."""
    distill_target: Any = None
    """``(target, row_valid)`` of the first forward's block-level distillation, or the token-level kernels'
    ``TokenKLStats`` (detached): the recompute reuses them rather than computing them again (same inputs and
    parameters, so the same tensors; saves their kernels, and under context parallelism a gather of K)."""
    pooled: Any = None
    """``(qbar, kbar)``, the selector's pooled inputs of a first forward that distilled (pooled from detached q
    and k, so no gradient flows through them): the recompute scores from them rather than pooling again (same
    q and k, so the same tensors; saves the two pooling kernels of every recomputed layer). ``qbar`` is None
    where ``distill_queries`` holds what the loss reads of it."""
    distill_queries: Any = None
    """The token indexer's query inputs of the sampled distillation blocks (``TokenIndexer.query_rows`` of
    :meth:`~sparse_train.selection.indexer.TokenIndexer.pool`'s queries; ``pooled`` then keeps only the keys): all
    its loss reads of the queries, a few blocks instead of the whole sequence."""
    document_ids: Any = None
    """The packed-document ids the first forward attended with (None without documents): the
    recompute masks with the same ones."""
    sequence: int = 0
    replayed_in: set = field(default_factory=set)
    retired: bool = False


class SelectionReplay:
    """Per-module store of live selection records and the matching logic (see module docstring)."""

    def __init__(self) -> None:
        self._records: list[weakref.ReferenceType] = []
        self._counter = itertools.count()
        self.hits = 0
        self.misses = 0
        self.ambiguous = 0

    def remember(self, record: SelectionRecord, anchors: list[Tensor | None], checkpoint_node: Any = None) -> None:
        """Attach ``record`` to the graph nodes of ``anchors`` (tensors of the first forward), or to
        ``checkpoint_node``, the backward node of the reentrant checkpoint whose first forward this is
        (:func:`reentrant_checkpoint_node`)."""
        nodes = [t.grad_fn for t in anchors if isinstance(t, Tensor) and t.grad_fn is not None]
        if not nodes and checkpoint_node is None:
            return
        record.sequence = next(self._counter)
        for node in nodes:
            node.metadata.setdefault(_METADATA_KEY, []).append(record)
        if checkpoint_node is not None:
            checkpoint_node.metadata.setdefault(_CHECKPOINT_KEY, []).append(record)
        self._records = [ref for ref in self._records if ref() is not None and not ref().retired]
        self._records.append(weakref.ref(record))

    def live_records(self) -> list[SelectionRecord]:
        """Records whose graph is still alive and that were not retired."""
        alive = [ref() for ref in self._records]
        return [r for r in alive if r is not None and not r.retired]

    def lookup(self, batch: int, seq_len: int) -> SelectionRecord | None:
        """The record this recompute must replay, or None (counted as a miss)."""
        task = torch._C._current_graph_task_id()
        candidates = [
            r for r in self.live_records() if r.batch == batch and r.seq_len == seq_len and task not in r.replayed_in
        ]
        if not candidates:
            self.misses += 1
            warnings.warn(_MISS_WARNING, stacklevel=2)
            return None
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            reachable = self._on_running_checkpoint(candidates) or self._reachable(candidates)
            if reachable:
                chosen = min(reachable, key=lambda r: r.sequence)
            else:
                self.ambiguous += 1
                chosen = max(candidates, key=lambda r: r.sequence)
        chosen.replayed_in.add(task)
        self.hits += 1
        self._retire_after_backward(chosen)
        return chosen

    @staticmethod
    def _retire_after_backward(record: SelectionRecord) -> None:
        def retire() -> None:
            record.retired = True

        try:
            torch.autograd.Variable._execution_engine.queue_callback(retire)
        except RuntimeError:
            # Not inside an engine task after all (e.g. called from a hook run outside backward):
            # keep the record; the graph's lifetime still bounds it.
            pass

    @staticmethod
    def _on_running_checkpoint(candidates: list[SelectionRecord]) -> list[SelectionRecord]:
        """Candidates attached to the node the engine is running: the reentrant checkpoint being recomputed."""
        node = torch._C._current_autograd_node()
        if node is None:
            return []
        wanted = {id(r) for r in candidates}
        return [r for r in node.metadata.get(_CHECKPOINT_KEY, ()) if id(r) in wanted]

    @staticmethod
    def _reachable(candidates: list[SelectionRecord]) -> list[SelectionRecord]:
        """Candidates whose anchor nodes can be reached from the node the engine is running."""
        start = torch._C._current_autograd_node()
        if start is None:
            return []
        wanted = {id(r): r for r in candidates}
        found: dict[int, SelectionRecord] = {}
        queue, seen = deque([start]), set()
        while queue and len(seen) < _WALK_LIMIT and len(found) < len(wanted):
            node = queue.popleft()
            if node is None or node in seen:
                continue
            seen.add(node)
            for record in node.metadata.get(_METADATA_KEY, ()):
                if id(record) in wanted:
                    found[id(record)] = record
            queue.extend(next_node for next_node, _ in node.next_functions)
        return list(found.values())

    def stats(self) -> dict[str, float]:
        return {
            "replay/hits": float(self.hits),
            "replay/misses": float(self.misses),
            "replay/ambiguous": float(self.ambiguous),
        }
