"""LightningModule for dense -> sparse fine-tuning of a local Hugging Face causal LM (Llama / Qwen2 style).

Stage 1 (the dense model) is the Hugging Face checkpoint itself: a local directory loaded with
``AutoModelForCausalLM.from_pretrained(pretrained_path, local_files_only=True)`` (no hub access).

2. selector: ``attention: sparse``, ``train_only_selector: true``, ``sparse.distill: dense``; the HF
   weights are frozen and only the selectors attached by ``sparse_train.integrations.hf.enable`` learn.
3. sparse:   ``attention: sparse``, ``init_from: <stage-2 checkpoint>``; everything trains.

``attention: dense`` keeps the model's own attention implementation (SDPA by default) and attaches no
selector. Everything after the model is built (loss, metrics, optimizer groups, schedule, logging) is
:class:`~sparse_train.lightning.training.CausalLMTraining`, the same component
:class:`~sparse_train.lightning.module.SparseLMModule` holds: the HF model is wrapped so that it maps
``tokens [B, N]`` to ``logits [B, N, V]`` like our ``Transformer``, and the data modules' batches
(``{"tokens", "labels"}`` with labels already aligned to positions, ``-100`` = no loss) are used as they
are; the packed rows of :class:`~sparse_train.lightning.TextDataModule` also pass their restarting
``position_ids`` to the HF model. The HF model's own ``labels=`` loss is deliberately not used: it shifts
labels by one position. The training loss calls ``HFCausalLM(tokens, labels=...)``, which for the plain-head
architectures (Llama, Mistral, Qwen2, Qwen3, Phi-3) runs the decoder and then the chunked head of
:func:`~sparse_train.losses.linear_cross_entropy`, so the ``[B, N, V]`` logits never exist.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import torch
import torch.nn as nn

from ..config import SparseAttentionConfig
from ..losses import LMLoss, labelled_head_loss, labelled_logits_loss
from ..module.checkpointing import checkpoint_kwargs
from ..tasks import IGNORE_INDEX
from ..validation import check_bool, check_choice, check_keys
from .training import CausalLMHooks, CausalLMTraining, TrainingArgs

# Parameter dtypes worth loading a causal LM in; a typo would otherwise surface as an AttributeError of torch.
_DTYPES = ("float32", "bfloat16", "float16", "float64")

__all__ = ["HFCausalLMModule", "HFCausalLM"]


# Architectures whose causal-LM head is exactly ``lm_head(decoder(...).last_hidden_state)``: no logit
# scaling, soft-capping or bias (Gemma 2, Cohere, Granite have them). For these the training loss runs the
# chunked head; any other model computes its logits as transformers does and the loss from them.
_PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})


class HFCausalLM(nn.Module):
    """``tokens -> logits`` view of a Hugging Face causal LM (kept as ``.lm``, so its state-dict keys are
    ``lm.<HF names>``). No KV cache is built: the sparse path is training/prefill only."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def chunked_head(self) -> bool:
        """Whether ``forward(labels=...)`` skips the full logits (:data:`_PLAIN_HEAD_MODEL_TYPES`, a
        bias-free output embedding)."""
        head = self.lm.get_output_embeddings()
        return (
            getattr(self.lm.config, "model_type", None) in _PLAIN_HEAD_MODEL_TYPES
            and isinstance(head, nn.Linear)
            and head.bias is None
        )

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | LMLoss:
        """Logits ``[B, N, V]`` of ``tokens`` ``[B, N]``; with ``labels`` the loss instead.

        ``position_ids`` ``[B, N]`` (int64) restarting at 0 at each document mark a packed row, the format of
        transformers' ``DataCollatorWithFlattening`` (:class:`~sparse_train.lightning.TextDataModule` batches
        carry it). Whether attention then stays inside each document is the attention implementation's
        business: flash-attention-2 and the sparse_train path honour the restarts; ``None`` = positions
        ``0..N-1``, one document per row.

        ``labels`` int ``[B, N]`` aligned to positions (``IGNORE_INDEX`` = no loss; not shifted, unlike the
        HF model's own ``labels=``) -> :class:`~sparse_train.losses.LMLoss` over the labelled
        positions. Where :attr:`chunked_head` holds, the head runs through
        :func:`~sparse_train.losses.linear_cross_entropy` (8,192 rows of logits at a time: with a 128K-token
        vocabulary the float32 logits of 64K positions would be about 31 GiB); otherwise from the model's logits."""
        if labels is None:
            return self.lm(input_ids=tokens, position_ids=position_ids, use_cache=False).logits
        if self.chunked_head:
            hidden = self.lm.get_decoder()(
                input_ids=tokens, position_ids=position_ids, use_cache=False
            ).last_hidden_state
            return labelled_head_loss(hidden, self.lm.get_output_embeddings().weight, labels, ignore_index=IGNORE_INDEX)
        logits = self.lm(input_ids=tokens, position_ids=position_ids, use_cache=False).logits
        return labelled_logits_loss(logits, labels, ignore_index=IGNORE_INDEX)

    def num_parameters(self) -> int:
        # Count shared tensors (tied embeddings) once.
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


class HFCausalLMModule(CausalLMHooks):
    """Fine-tunes a local Hugging Face causal LM with (or without) learned block-sparse attention.

    Args:
        pretrained_path: Local checkpoint directory (``config.json`` + weights), read with
            ``AutoModelForCausalLM.from_pretrained(pretrained_path, local_files_only=True)``.
        attention: ``sparse`` = ``sparse_train.integrations.hf.enable`` (attn_implementation
            ``"sparse_train"``, one selector per attention layer); ``dense`` = the model's own attention.
        sparse: Keyword arguments of ``st.SparseAttentionConfig`` (or the dataclass itself); ignored when
            ``attention`` is ``dense``.
        dtype: Parameter dtype to load the weights in (``"float32"`` keeps fp32 master weights for mixed
            precision; ``None`` = transformers' default).
        attn_implementation: Implementation for the dense model (``None`` = transformers' default, SDPA).
        gradient_checkpointing: Enable Hugging Face gradient checkpointing (non-reentrant; the sparse
            selections are replayed in the recomputation).
        checkpoint_keeps_attention: With ``gradient_checkpointing``, keep each layer's attention output instead
            of recomputing it (:mod:`sparse_train.module.checkpointing`; more memory, one attention forward less per
            layer and step).
        lr, selector_lr, weight_decay, betas, warmup_steps, min_lr_ratio, selector_loss_weight,
        train_only_selector, init_from: as in :class:`SparseLMModule`. ``init_from`` is a checkpoint of
            this module (a previous stage, selectors included); missing selector weights are allowed.
    """

    def __init__(
        self,
        pretrained_path: str,
        attention: Literal["sparse", "dense"] = "sparse",
        sparse: dict[str, Any] | None = None,
        dtype: str | None = "float32",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        checkpoint_keeps_attention: bool = False,
        lr: float = 1e-4,
        selector_lr: float | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        selector_loss_weight: float = 1.0,
        train_only_selector: bool = False,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        args = TrainingArgs.checked(
            "HFCausalLMModule",
            lr=lr,
            selector_lr=selector_lr,
            weight_decay=weight_decay,
            betas=betas,
            warmup_steps=warmup_steps,
            min_lr_ratio=min_lr_ratio,
            selector_loss_weight=selector_loss_weight,
            train_only_selector=train_only_selector,
            init_from=init_from,
        )
        # Loading is local-only: without this check a missing directory is reported by huggingface_hub as
        # an invalid *hub repo id*, which sends the user looking in the wrong place.
        if not isinstance(pretrained_path, (str, os.PathLike)) or not os.path.isdir(pretrained_path):
            raise ValueError(
                f"HFCausalLMModule.pretrained_path must be a local checkpoint directory "
                f"(config.json + weights), got {pretrained_path!r}"
            )
        check_choice("HFCausalLMModule.attention", attention, ("sparse", "dense"))
        if dtype is not None:
            check_choice("HFCausalLMModule.dtype", dtype, _DTYPES)
        check_bool("HFCausalLMModule.gradient_checkpointing", gradient_checkpointing)
        check_bool("HFCausalLMModule.checkpoint_keeps_attention", checkpoint_keeps_attention)
        if isinstance(sparse, SparseAttentionConfig):
            sparse = dataclasses.asdict(sparse)
        if sparse is not None and not isinstance(sparse, dict):
            raise ValueError(
                f"HFCausalLMModule.sparse must be a dict of SparseAttentionConfig fields, a "
                f"SparseAttentionConfig or None, got {sparse!r}"
            )
        sparse = dict(sparse or {})
        if attention == "sparse":
            check_keys("HFCausalLMModule.sparse", sparse, SparseAttentionConfig.__dataclass_fields__)
            SparseAttentionConfig(**sparse)  # names a bad value before the checkpoint is loaded
        self.save_hyperparameters()
        lm = self._load_pretrained(pretrained_path, dtype, attn_implementation)
        # from_pretrained returns the model in eval mode and Lightning keeps submodules' modes as they
        # are at fit start: without this the selectors would never train (no distillation in eval).
        lm.train()
        if attention == "sparse":
            from ..integrations import hf

            hf.enable(lm, SparseAttentionConfig(**sparse))
        if gradient_checkpointing:
            kwargs = checkpoint_kwargs(checkpoint_keeps_attention)
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model = HFCausalLM(lm)
        path = str(pretrained_path).replace("{", "{{").replace("}", "}}")  # literal inside the format string
        self.training_logic = CausalLMTraining(
            self,
            args,
            vocab_size=int(lm.config.vocab_size),
            attention=attention,
            vocab_error=f"data needs vocab_size >= {{need}} but the checkpoint {path} has vocab_size = {{have}}",
            sparse_hint="attention: sparse",
            layer_types=self._layer_types(lm),
        )

    @staticmethod
    def _layer_types(lm: nn.Module) -> tuple[type[nn.Module], ...]:
        """The classes the checkpoint names in ``_no_split_modules`` (its decoder layers, e.g.
        ``LlamaDecoderLayer``): the units FSDP shards and gathers one at a time, as accelerate does."""
        names = set(getattr(lm, "_no_split_modules", None) or ())
        return tuple(sorted({type(m) for m in lm.modules() if type(m).__name__ in names}, key=lambda t: t.__name__))

    @staticmethod
    def _load_pretrained(path: str, dtype: str | None, attn_implementation: str | None) -> nn.Module:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = getattr(torch, dtype)
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)

    # ------------------------------------------------------------------ the model's forward (hooks: CausalLMHooks)
    def forward(self, tokens: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(tokens, position_ids=position_ids)
