"""Hugging Face ``transformers`` integration: ``attn_implementation="sparse_train"``.

Usage::

    from sparse_train.integrations import hf
    model = AutoModelForCausalLM.from_pretrained(...)          # or built from a config
    hf.enable(model, st.SparseAttentionConfig(top_k=16))       # selectors attached, implementation switched
    loss = model(input_ids, attention_mask=mask, labels=labels).loss
    loss = loss + st.collect_selector_losses(model)             # distillation of every layer's selector

What ``enable`` does:

* registers an attention function under ``"sparse_train"`` in ``AttentionInterface`` and a mask
  function in ``AttentionMaskInterface`` (the mask function hands the 2-D padding mask through, like
  the flash-attention one, instead of building an N x N mask);
* attaches a :class:`~sparse_train.SparseAttention` as ``sparse_attention`` to every attention layer
  (a registered submodule, so its selector is in ``state_dict`` and moves with ``.to()``);
* switches the implementation (``model.set_attn_implementation`` when available, else the config).

Padding and packing: a right-padded 2-D mask (ones then zeros per row) becomes ``seq_lens``. Left
padding (zeros, then ones, then possibly zeros) becomes packed documents: the padded prefix is one
document and the real tokens another, so no real query sees a padded key. Packed rows in the
padding-free format of ``DataCollatorWithFlattening`` (no attention mask, ``position_ids``
restarting at every document, optionally with the ``cu_seq_lens_q`` flash-attention kwargs) become
``document_ids`` (:func:`document_ids_for_call`): each document attends only itself, as
transformers' flash-attention path does. Holes (a zero between ones) and 4-D custom masks raise
``NotImplementedError`` with a hint, instead of computing something else. Models with sliding-window
layers (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2) or logit softcapping (Gemma 2) are refused
at ``enable`` with the reason. Attention layers are found by the attributes transformers' attention
interface reads (``layer_idx``, ``head_dim``, ``is_causal``), so fused projections (Phi-3) work.

Generation: ``model.generate()`` works after ``enable``. The prompt (query length == key length) takes
the sparse path like training; each decoding step (fewer queries than cached keys) attends the whole
cache densely through :meth:`SparseAttention.decode`, counted as the fallback ``"decode"``. Forwards and
``generate()`` run under ``torch.no_grad()`` and ``torch.inference_mode()`` alike (masks and position ids
made in inference mode have no version counter; they are validated at every layer instead of once).

Context parallelism: after ``st.enable_context_parallel(model, group)`` each rank runs the model on its
zig-zag shard of the sequence with the shard's GLOBAL ``position_ids`` (so the model's RoPE rotates at global
positions); :func:`context_parallel_inputs` builds a rank's ``input_ids``, ``position_ids`` and the labels of
the loss from the global batch. Packed documents come from restarting global positions; padding masks and
the ``cu_seq_lens`` kwargs are refused under context parallelism.

Saving: :func:`save_pretrained` / :func:`from_pretrained` keep the selectors beside the model's own
files. Only APIs present in transformers 5.17 and 5.24 are used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import weakref

import torch
from torch import Tensor, nn

from ..config import SparseAttentionConfig
from ..documents import document_ids_from_cu_seqlens, document_ids_from_position_ids
from ..module.attention import SparseAttention
from ..parallel.context_parallel import context_parallel_rank, shard_sequence

__all__ = [
    "ATTENTION_NAME",
    "register",
    "enable",
    "disable",
    "save_pretrained",
    "from_pretrained",
    "sparse_train_attention_forward",
    "sparse_train_mask",
    "seq_lens_from_padding_mask",
    "padding_from_mask",
    "document_ids_for_call",
    "context_parallel_inputs",
    "attention_layers",
    "rope_frequencies",
    "rope_style",
    "INTERLEAVED_ROPE_MODEL_TYPES",
    "SELECTOR_WEIGHTS_NAME",
    "SELECTOR_CONFIG_NAME",
]

ATTENTION_NAME = "sparse_train"
SUBMODULE_NAME = "sparse_attention"
SELECTOR_WEIGHTS_NAME = "sparse_train.safetensors"
"""Selector weights file written beside the model's own files by :func:`save_pretrained`."""
SELECTOR_CONFIG_NAME = "sparse_train_config.json"
"""The ``SparseAttentionConfig`` (and a format version) written beside the model's ``config.json``."""
_FORMAT_VERSION = 2
"""Version of the saved sparse config. Version 1 holds the kernel choices ``r0``, ``fused_backward``,
``stored_ds_backward`` and ``gluon_kernels`` as top-level config fields; :func:`_config_from_saved` reads them
into ``kernel_options``."""

_KERNEL_FIELDS_V1 = {
    "r0": ("r0",),
    "fused_backward": ("fused_dq",),
    "stored_ds_backward": ("stored_ds",),
    "gluon_kernels": ("fwd_gluon", "dq_gluon", "kv_gluon"),
}


def _config_from_saved(saved: dict, path: str) -> SparseAttentionConfig:
    """The :class:`SparseAttentionConfig` of a saved ``sparse_config.json`` of format 1 or 2."""
    version = saved.get("format_version")
    if version not in (1, _FORMAT_VERSION):
        raise ValueError(f"{path}: format_version {version!r}, this version reads 1 and {_FORMAT_VERSION}")
    fields = dict(saved["config"])
    if version == 1:
        options = {}
        for old, new_names in _KERNEL_FIELDS_V1.items():
            value = fields.pop(old, None)
            if value is None or (value is False and old != "gluon_kernels"):  # the kernel's default
                continue
            options.update(dict.fromkeys(new_names, value))
        fields["kernel_options"] = options or None
    return SparseAttentionConfig(**fields)


_last_cp_positions: tuple[weakref.ReferenceType, int, tuple[Tensor, Tensor | None]] | None = None
_last_mask: tuple[weakref.ReferenceType, int, tuple[Tensor | None, Tensor | None]] | None = None
_last_positions: tuple[weakref.ReferenceType, int, Tensor | None] | None = None


def seq_lens_from_padding_mask(mask: Tensor | None, seq_len: int) -> Tensor | None:
    """int64 ``[B]`` valid lengths from a right-padded 2-D mask ``[B, N]`` (None: no padding).

    Raises:
        NotImplementedError: a 4-D mask, or a mask that is not right padding (left padding or holes).
        ValueError: a mask whose length differs from the key length.
    """
    seq_lens, document_ids = padding_from_mask(mask, seq_len)
    if document_ids is not None:
        raise NotImplementedError(
            "sparse_train attention needs right padding here (each row: real tokens, then padding); "
            "left padding is handled by the attention function through padding_from_mask"
        )
    return seq_lens


_HOLE_MESSAGE = (
    "sparse_train attention supports right and left padding (each row: optional padding, real tokens, "
    "optional padding); this attention mask has a padded hole between real tokens"
)


def padding_from_mask(mask: Tensor | None, seq_len: int) -> tuple[Tensor | None, Tensor | None]:
    """``(seq_lens, document_ids)`` from a 2-D padding mask ``[B, N]`` (nonzero = real token).

    Right padding (ones, then zeros) gives int64 ``seq_lens [B]`` and no document ids. Left padding
    (zeros, ones, then possibly zeros) gives int64 ``document_ids [B, N]``: 0 on the padded prefix,
    1 on the real tokens, 2 on a padded tail, so real queries see only real keys; ``seq_lens`` is
    then None. ``(None, None)`` without a mask. The mask is validated once per mask object and version
    (every layer receives the same one); an inference tensor (created under ``torch.inference_mode``) has
    no version counter, so an in-place write to it could not be seen: it is validated at every call.

    Raises:
        NotImplementedError: a 4-D mask, or a row with a hole (a zero between real tokens).
        ValueError: a mask whose length differs from the key length.
        RuntimeError: a hole while torch.compile runs the graph: checked by an assertion on the device (no
            host sync while tracing); on CUDA it surfaces as a device-side assert at the next synchronisation.
    """
    global _last_mask
    if mask is None:
        return None, None
    if mask.dim() != 2:
        raise NotImplementedError(
            f"sparse_train attention takes a 2-D padding mask [B, N]; got a {mask.dim()}-D mask. Custom 4-D "
            "masks are not supported: pass the tokenizer's attention_mask instead."
        )
    if mask.shape[1] != seq_len:
        raise ValueError(f"padding mask has length {mask.shape[1]} but keys have length {seq_len}")
    # Every layer receives the same mask object: validate it once, not once per layer.
    cached = _cache_key(mask)
    if cached is not None and _last_mask is not None and _last_mask[0]() is mask and _last_mask[1] == cached:
        return _last_mask[2]
    keep = mask.to(torch.bool)
    seq_lens = keep.sum(dim=-1)
    changes = torch.zeros_like(keep, dtype=torch.int64)
    changes[:, 1:] = (keep[:, 1:] != keep[:, :-1]).to(torch.int64)
    # runs of the row: an optional padded prefix, the real tokens, an optional padded tail; a row without
    # a padded prefix starts at id 1 like the others: ids 0 / 1 / 2 = prefix / real / tail
    run = changes.cumsum(dim=1)
    starts_real = keep[:, 0]
    document_ids = run + starts_real.to(torch.int64).view(-1, 1)
    # more runs than prefix / real / tail, or a prefix of real tokens followed by two more runs: a hole
    runs = run[:, -1] + 1
    hole = (runs > 3) | ((runs == 3) & starts_real)
    if torch.compiler.is_compiling():
        # No data-dependent branch while tracing: the padding becomes documents whatever its side (right
        # padding included, which is exact too). A hole would split the real tokens into documents, so it is
        # refused by an assertion on the device: no host sync, and the step fails instead of computing wrong
        # attention (on CUDA as a device-side assert at the next synchronisation).
        torch._assert_async(~hole.any(), _HOLE_MESSAGE + " (detected on the device while running a compiled graph)")
        result = (None, document_ids)
    else:
        result = (seq_lens, None)
        right_padded = torch.arange(seq_len, device=mask.device).view(1, -1) < seq_lens.view(-1, 1)
        if not torch.equal(right_padded, keep):
            if bool(hole.any()):
                raise NotImplementedError(f"{_HOLE_MESSAGE} in row {int(hole.nonzero()[0, 0])}")
            result = (None, document_ids)
    if cached is not None:
        _last_mask = (weakref.ref(mask), cached, result)
    return result


def _cache_key(tensor: Tensor) -> int | None:
    """The version counter of ``tensor`` (an in-place write bumps it), which keys the per-forward caches of
    :func:`padding_from_mask` and :func:`document_ids_for_call`; None (not cached) for an inference tensor,
    which has no version counter, and while torch.compile traces (dynamo traces neither weak references nor
    version counters, and the traced ops cost no host sync)."""
    if torch.compiler.is_compiling() or tensor.is_inference():
        return None
    return tensor._version


def document_ids_for_call(
    position_ids: Tensor | None, batch: int, seq_len: int, cu_seq_lens: Tensor | None = None
) -> Tensor | None:
    """Packed documents of a padding-free batch: int ``[B, N]`` document ids, or None when every row
    is one sequence.

    The most direct source wins: ``cu_seq_lens`` (``cu_seq_lens_q``, the flash-attention kwarg
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produces; batch 1) when given, else
    ``position_ids`` ``[1 or B, N]`` (a document starts wherever the position does not continue the
    previous one by +1, the rule of transformers' own packed-sequence detection). One host sync per
    position tensor (to return None on unpacked input; while torch.compile traces, the ids are
    returned without that check); every layer of a forward receives the same tensor, so the result
    is computed once (at every call for an inference tensor, as in :func:`padding_from_mask`).

    Raises:
        ValueError: ``cu_seq_lens`` with a batch other than 1, or shapes that do not match.
    """
    global _last_positions
    if cu_seq_lens is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q describes one packed row (batch 1), got a batch of {batch}")
        return document_ids_from_cu_seqlens(cu_seq_lens, seq_len)
    if position_ids is None or position_ids.shape[-1] != seq_len:
        return None
    cached = _cache_key(position_ids)
    if (
        cached is not None
        and _last_positions is not None
        and _last_positions[0]() is position_ids
        and _last_positions[1] == cached
    ):
        return _last_positions[2]
    document_ids = document_ids_from_position_ids(position_ids).expand(batch, seq_len)
    if torch.compiler.is_compiling():
        return document_ids  # no data-dependent branch while tracing: one document per row is exact too
    if bool((document_ids[:, -1] == 0).all()):
        document_ids = None  # no restarts
    if cached is not None:
        _last_positions = (weakref.ref(position_ids), cached, document_ids)
    return document_ids


def sparse_train_mask(
    *args, attention_mask: Tensor | None = None, kv_length: int | None = None, mask_function=None, **kwargs
) -> Tensor | None:
    """Mask function for ``AttentionMaskInterface``: the 2-D padding mask (or None without padding).

    Accepted patterns: plain causal, and causal restricted to packed sequences (what transformers
    builds from restarting ``position_ids``; the attention function recovers the documents from the
    same ``position_ids``). Sliding windows and custom and/or-masks would need semantics the sparse
    path does not implement, so they raise.
    """
    if mask_function is not None and not _is_causal_or_packed(mask_function):
        raise NotImplementedError(
            "sparse_train attention supports causal masks (with padding or packed sequences) only; this "
            "model/input asked for another mask pattern (sliding window or a custom mask function)."
        )
    if attention_mask is None:
        return None
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.dim() == 2 and bool(attention_mask.all()):
        return None
    return attention_mask


def _is_causal_or_packed(mask_function) -> bool:
    """The mask function is transformers' causal one, or its packed-sequence composition:
    ``and_masks(remap_positions_for_packed_sequence(causal), packed_sequence_mask_function(...))``
    (recognised by the factory each closure comes from; anything else is refused)."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return True
    factory = getattr(mask_function, "__qualname__", "").split(".<locals>.")[0]
    captured = [cell.cell_contents for cell in (getattr(mask_function, "__closure__", None) or ())]
    if factory == "packed_sequence_mask_function":
        return True
    if factory == "remap_positions_for_packed_sequence":
        inner = [c for c in captured if callable(c)]
        return len(inner) == 1 and _is_causal_or_packed(inner[0])
    if factory == "and_masks":
        parts = [f for c in captured if isinstance(c, tuple) for f in c]
        return bool(parts) and all(_is_causal_or_packed(f) for f in parts)
    return False


def sparse_train_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """``AttentionInterface`` function: query ``[B, HQ, N, D]``, key/value ``[B, HKV, N, D]`` ->
    (output ``[B, N, HQ, D]``, None).

    Reads from ``kwargs`` what transformers passes through to attention functions: ``position_ids``
    (packed rows and the selector's RoPE un-rotation) and ``cu_seq_lens_q`` (padding-free packing)."""
    sparse = getattr(module, SUBMODULE_NAME, None)
    if not isinstance(sparse, SparseAttention):
        raise RuntimeError(
            f"{type(module).__name__} has no sparse_train selector; call "
            "sparse_train.integrations.hf.enable(model, config) instead of only setting attn_implementation"
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("sparse_train attention does not implement sliding-window layers")
    if query.shape[2] != key.shape[2]:
        # KV-cache decoding (generate) or chunked prefill: the new queries over the whole cache, dense
        if dropout:
            raise NotImplementedError(
                "sparse_train attention with a KV cache runs without dropout (call model.eval() for generation)"
            )
        mask = attention_mask[:, -key.shape[2] :] if attention_mask is not None and attention_mask.dim() == 2 else None
        if attention_mask is not None and mask is None:
            raise NotImplementedError(
                f"sparse_train attention takes a 2-D padding mask; got a {attention_mask.dim()}-D mask while decoding"
            )
        out = sparse.decode(query, key, value, key_padding_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    if sparse.layout.splits_sequence:
        return _context_parallel_attention(sparse, query, key, value, attention_mask, scaling, dropout, kwargs)
    batch, seq_len = query.shape[0], key.shape[2]
    seq_lens, padding_documents = padding_from_mask(attention_mask, seq_len)
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, Tensor) and position_ids.dim() == 2 and position_ids.shape[1] == seq_len:
        position_ids = position_ids.to(query.device).expand(batch, seq_len)
    else:
        position_ids = None
    packed = document_ids_for_call(position_ids, batch, seq_len, kwargs.get("cu_seq_lens_q"))
    document_ids = padding_documents
    if packed is not None:
        packed = packed.to(query.device)
        # both: a document boundary wherever either has one
        document_ids = packed if document_ids is None else _merge_boundaries(document_ids, packed)
    out = sparse(
        query,
        key,
        value,
        seq_lens=seq_lens,
        document_ids=document_ids,
        position_ids=position_ids,
        scale=scaling,
        dropout_p=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


def _context_parallel_attention(
    sparse: SparseAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict,
) -> tuple[Tensor, None]:
    """The attention call of a layer under context parallelism: query/key/value are this rank's zig-zag shard
    ``[B, H, N / W, D]``; ``position_ids`` (required) are the shard's GLOBAL positions, all-gathered into the
    sequence's ``[B, N]`` positions, which give the packed documents (restarts) and the selector's RoPE
    un-rotation."""
    if attention_mask is not None and not (attention_mask.dim() == 2 and bool(attention_mask.all())):
        raise NotImplementedError(
            "sparse_train attention under context parallelism takes no padding mask: pack the rows instead "
            "(position_ids restarting at every document)"
        )
    if kwargs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(
            "sparse_train attention under context parallelism reads packed documents from position_ids, not "
            "from cu_seq_lens_q"
        )
    batch, local_len = query.shape[0], key.shape[2]
    position_ids = kwargs.get("position_ids")
    if not (
        isinstance(position_ids, Tensor)
        and position_ids.dim() == 2
        and position_ids.shape[0] in (1, batch)
        and position_ids.shape[1] == local_len
    ):
        raise ValueError(
            "a Hugging Face model under context parallelism needs position_ids: this rank's shard of the GLOBAL "
            f"positions, [B or 1, {local_len}] (sparse_train.integrations.hf.context_parallel_inputs builds them), "
            f"got {getattr(position_ids, 'shape', position_ids)!r}"
        )
    positions, documents = _global_positions(sparse, position_ids.to(query.device), batch, local_len)
    out = sparse(
        query,
        key,
        value,
        document_ids=documents,
        position_ids=positions,
        scale=scaling,
        dropout_p=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


def _global_positions(
    sparse: SparseAttention, position_ids: Tensor, batch: int, local_len: int
) -> tuple[Tensor, Tensor | None]:
    """This rank's ``position_ids`` gathered into the sequence's global ``[B, N]`` positions, checked, and their
    packed documents (or None). Every layer of a forward receives the same local tensor, so the gather and its
    host reads run once per forward (keyed as :func:`padding_from_mask`'s cache)."""
    global _last_cp_positions
    cached = _cache_key(position_ids)
    if (
        cached is not None
        and _last_cp_positions is not None
        and _last_cp_positions[0]() is position_ids
        and _last_cp_positions[1] == cached
    ):
        return _last_cp_positions[2]
    local = position_ids.expand(batch, local_len).contiguous()
    positions = sparse.layout.gather(local, -1)  # [B, N], global order
    if not torch.compiler.is_compiling():
        # global positions start at 0 and continue by +1 or restart a document at 0; the model's own default,
        # 0 .. N/W - 1 on every rank, gathers into a jump (one host sync)
        following = positions[:, 1:]
        valid = (positions[:, 0] == 0).all() & ((following - positions[:, :-1] == 1) | (following == 0)).all()
        if not bool(valid):
            raise ValueError(
                "a Hugging Face model under context parallelism needs position_ids that are this rank's shard of the "
                "GLOBAL positions (0, 1, ... restarting at 0 where a packed document starts); the ranks' "
                "position_ids do not gather into such a sequence (a model called without position_ids uses local "
                "ones); sparse_train.integrations.hf.context_parallel_inputs builds them"
            )
    result = positions, document_ids_for_call(positions, batch, positions.shape[1])
    if cached is not None:
        _last_cp_positions = (weakref.ref(position_ids), cached, result)
    return result


def context_parallel_inputs(
    input_ids: Tensor,
    labels: Tensor | None = None,
    position_ids: Tensor | None = None,
    *,
    group=None,
    ignore_index: int = -100,
) -> dict[str, Tensor]:
    """This rank's keyword arguments of a Hugging Face causal LM under context parallelism, from the GLOBAL batch.

    Returns ``input_ids`` and ``position_ids`` (the rank's zig-zag shard, :func:`~sparse_train.parallel.
    context_parallel.shard_sequence`, of the tokens and of their global positions: ``position_ids`` when given,
    e.g. restarting at packed documents, else ``0 .. N-1``); with ``labels`` also ``labels`` and ``shift_labels``
    (the labels shifted left by one over the GLOBAL sequence, ``ignore_index`` last, then sharded: transformers'
    causal-LM loss takes ``shift_labels`` as they are instead of shifting the local shard, whose neighbour
    tokens sit on another rank) and ``num_items_in_batch`` (the global count of labelled tokens, so each rank's
    loss is its share of the global mean). Summed over the ranks, the losses and the parameter gradients
    (all-reduce them over ``group``) are the single-process ones.

    Args:
        input_ids: int ``[B, N]``, the whole batch, the same on every rank of ``group``.
        labels: int ``[B, N]`` unshifted (the ``labels`` argument of a causal LM), or None.
        position_ids: int ``[B or 1, N]`` global positions, or None for ``0 .. N-1``.
        group: the context-parallel process group (``None``: the default group).
        ignore_index: the label of tokens without a loss.

    Raises:
        ValueError: tensors that are not ``[B, N]`` of one N, or N not a multiple of 2 * world size
            (:func:`~sparse_train.parallel.context_parallel.shard_sequence`).
    """
    rank, world = context_parallel_rank(group)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, N] tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    batch, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).view(1, seq_len)
    elif not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != seq_len:
        raise ValueError(f"position_ids must be [B or 1, {seq_len}], got {getattr(position_ids, 'shape', None)!r}")
    out = {
        "input_ids": shard_sequence(input_ids, 1, rank, world),
        "position_ids": shard_sequence(position_ids, 1, rank, world),
    }
    if labels is not None:
        if not isinstance(labels, Tensor) or tuple(labels.shape) != (batch, seq_len):
            raise ValueError(
                f"labels must be [{batch}, {seq_len}] like input_ids, got {getattr(labels, 'shape', None)!r}"
            )
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
        local = shard_sequence(shifted, 1, rank, world)
        out.update(labels=local, shift_labels=local, num_items_in_batch=(shifted != ignore_index).sum())
    return out


def _merge_boundaries(a: Tensor, b: Tensor) -> Tensor:
    """Document ids ``[B, N]`` whose documents start wherever a document of ``a`` or of ``b`` starts."""
    starts = torch.zeros_like(a, dtype=torch.int64)
    starts[:, 1:] = ((a[:, 1:] != a[:, :-1]) | (b[:, 1:] != b[:, :-1])).to(torch.int64)
    return starts.cumsum(dim=1)


def register() -> None:
    """Register the attention and mask functions under ``"sparse_train"`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, sparse_train_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sparse_train_mask)


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules that call transformers' attention interface: the modules carrying
    ``layer_idx``, ``head_dim`` and ``is_causal`` (the attributes that interface reads), whatever
    their projections are called (separate q/k/v or Phi-3's fused ``qkv_proj``)."""
    return [m for m in model.modules() if all(hasattr(m, name) for name in ("layer_idx", "head_dim", "is_causal"))]


def _unsupported_reason(model: nn.Module, layer: nn.Module) -> str | None:
    """Why this layer's attention is not plain causal softmax attention, or None."""
    config = model.config
    window = getattr(layer, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None and getattr(config, "sliding_window", None) is not None:
        # models that pass the config's window at call time (Mistral): sliding unless the layer type says full
        layer_idx = getattr(layer, "layer_idx", None)
        if not (layer_types and layer_idx is not None and layer_types[layer_idx] == "full_attention"):
            window = config.sliding_window
    if window is not None:
        return (
            f"sliding-window attention (window {window}) is a different mask than causal attention; "
            "sparse_train does not implement it"
        )
    softcap = getattr(layer, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return f"attention logit softcapping ({softcap}) is not implemented by the sparse kernels"
    return None


def rope_frequencies(model: nn.Module) -> Tensor | None:
    """The model's RoPE ``inv_freq`` (``[R/2]``): the buffer of its rotary-embedding module, which
    already includes any rope scaling; None when the model has none or several different ones."""
    found = [m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), Tensor)]
    if not found or any(f.shape != found[0].shape or not torch.equal(f, found[0]) for f in found[1:]):
        return None
    return found[0]


INTERLEAVED_ROPE_MODEL_TYPES = ("gptj", "cohere", "cohere2")
"""Hugging Face ``model_type`` values whose RoPE turns channel pairs ``(2i, 2i + 1)``; every other model
(Llama, Qwen2, Mistral, ...) turns ``(i, i + R/2)`` (``rotate_half``)."""


def rope_style(model: nn.Module) -> str:
    """The RoPE convention of a Hugging Face model: ``"interleaved"`` for the model types of
    :data:`INTERLEAVED_ROPE_MODEL_TYPES`, ``"rotate_half"`` otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return "interleaved" if model_type in INTERLEAVED_ROPE_MODEL_TYPES else "rotate_half"


def _set_implementation(model: nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def enable(model: nn.Module, config: SparseAttentionConfig | None = None) -> nn.Module:
    """Attach a ``SparseAttention`` (``<layer>.sparse_attention``) to every attention layer and switch
    the model to ``attn_implementation="sparse_train"``. Returns the model.

    The selector inherits the model's logit scale unless ``config.scale`` is set, and un-rotates q
    and k by the model's own RoPE frequencies in the model's convention before scoring
    (:func:`rope_frequencies`, :func:`rope_style`) unless ``config.selector_rope_theta`` is set (then the
    config's theta and ``selector_rope_style`` apply); existing selectors are kept (calling ``enable`` twice does
    not reset trained selectors).

    Raises:
        ValueError: ``config`` not a SparseAttentionConfig or None, or not fitting the model's heads (its kernel
            options, :func:`~sparse_train.options.check_kernel_option_shapes`); ``model`` not a Hugging Face model
            (a module whose ``config`` has ``num_attention_heads``) or without attention layers.
        NotImplementedError: a layer with sliding-window attention or attention-logit softcapping.
    """
    config = SparseAttentionConfig() if config is None else config
    if not isinstance(config, SparseAttentionConfig):
        raise ValueError(
            f"hf.enable: config must be a SparseAttentionConfig or None, got {type(config).__name__} "
            "(for a dict use SparseAttentionConfig(**mapping))"
        )
    hf_config = getattr(model, "config", None) if isinstance(model, nn.Module) else None
    if getattr(hf_config, "num_attention_heads", None) is None:
        raise ValueError(
            "hf.enable: model must be a Hugging Face transformers model (a torch.nn.Module whose config has "
            f"num_attention_heads), got {type(model).__name__}"
            + ("" if hf_config is None else f" with a {type(hf_config).__name__} config")
        )
    register()
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    layers = attention_layers(model)
    inv_freq = rope_frequencies(model)
    if not layers:
        raise ValueError(
            f"found no attention layers (modules with layer_idx, head_dim, is_causal) in {type(model).__name__}"
        )
    for layer in layers:
        reason = _unsupported_reason(model, layer)
        if reason is not None:
            raise NotImplementedError(
                f"hf.enable: {type(model).__name__} layer {getattr(layer, 'layer_idx', '?')}: {reason}"
            )
    for layer in layers:
        if isinstance(getattr(layer, SUBMODULE_NAME, None), SparseAttention):
            continue
        layer_config = config
        if config.scale is None and getattr(layer, "scaling", None) is not None:
            layer_config = dataclasses.replace(config, scale=float(layer.scaling))
        sparse = SparseAttention(layer_config, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=layer.head_dim)
        if config.selector_rope_theta is None:
            sparse.scorer.set_rope(inv_freq, rope_style(model))
        sparse.to(device=next(layer.parameters()).device)
        sparse.train(layer.training)
        layer.add_module(SUBMODULE_NAME, sparse)
    _set_implementation(model, ATTENTION_NAME)
    return model


def disable(model: nn.Module, implementation: str = "sdpa") -> nn.Module:
    """Switch back to ``implementation`` (selectors stay attached, e.g. for a later ``enable``)."""
    _set_implementation(model, implementation)
    return model


def _is_selector_key(name: str) -> bool:
    return f".{SUBMODULE_NAME}." in f".{name}"


def save_pretrained(model: nn.Module, directory, config: SparseAttentionConfig | None = None, **kwargs) -> None:
    """Save an ``enable``-d model as a Hugging Face model directory plus its selectors.

    ``model.save_pretrained(directory, **kwargs)`` writes the model's own files *without* the
    selector tensors (so the directory loads as the plain model, no unexpected keys); the selectors
    go to ``sparse_train.safetensors`` and the layer config to ``sparse_train_config.json`` beside
    them. :func:`from_pretrained` reads all three back.

    Args:
        config: the ``SparseAttentionConfig`` to record; ``None`` = the one the first layer was built
            with (with ``scale`` reset to None when it only holds the model's own scale).

    Raises:
        ValueError: the model has no selectors (call :func:`enable` first).
    """
    from safetensors.torch import save_file

    layers = attention_layers(model)
    selectors = [getattr(layer, SUBMODULE_NAME, None) for layer in layers]
    if not selectors or not all(isinstance(selector, SparseAttention) for selector in selectors):
        raise ValueError(
            "save_pretrained: the model has no sparse_train selectors; call hf.enable(model, config) first"
        )
    if config is None:
        config = selectors[0].config
        model_scale = getattr(layers[0], "scaling", None)
        if config.scale is not None and model_scale is not None and float(model_scale) == config.scale:
            config = dataclasses.replace(config, scale=None)  # enable() fills it from the model again
    state = model.state_dict()
    selector_state = {name: t for name, t in state.items() if _is_selector_key(name)}
    plain_state = {name: t for name, t in state.items() if not _is_selector_key(name)}
    model.save_pretrained(directory, state_dict=plain_state, **kwargs)
    save_file(
        {name: t.detach().contiguous().cpu() for name, t in selector_state.items()},
        os.path.join(directory, SELECTOR_WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    with open(os.path.join(directory, SELECTOR_CONFIG_NAME), "w") as f:
        json.dump({"format_version": _FORMAT_VERSION, "config": config.to_dict()}, f, indent=1)


def from_pretrained(model_class, directory, **kwargs) -> nn.Module:
    """Load a directory written by :func:`save_pretrained`: ``model_class.from_pretrained(directory,
    **kwargs)`` (e.g. ``AutoModelForCausalLM``), then :func:`enable` with the saved config and the
    saved selector weights (strict: every selector tensor must be present and no other).

    Raises:
        FileNotFoundError: the directory has no ``sparse_train_config.json`` / selector weights.
        ValueError: an unknown format version, or selector tensors that do not match the model.
    """
    from safetensors.torch import load_file

    config_path = os.path.join(directory, SELECTOR_CONFIG_NAME)
    weights_path = os.path.join(directory, SELECTOR_WEIGHTS_NAME)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} not found: was the directory written by sparse_train.integrations.hf.save_pretrained?"
            )
    with open(config_path) as f:
        saved = json.load(f)
    config = _config_from_saved(saved, config_path)
    model = model_class.from_pretrained(directory, **kwargs)
    enable(model, config)
    weights = load_file(weights_path)
    # the keys the load itself reports: a selector fills the resume state an older file lacks
    # (sparse_train.module.attention.RESUME_STATE)
    result = model.load_state_dict(weights, strict=False)
    missing = sorted(name for name in result.missing_keys if _is_selector_key(name))
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not match the model's selectors: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return model
