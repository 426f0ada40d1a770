"""What a causal-LM LightningModule does with its model, written once and shared by composition.

:class:`~sparse_train.lightning.module.SparseLMModule` (our ``Transformer``) and
:class:`~sparse_train.lightning.hf.HFCausalLMModule` (a local Hugging Face checkpoint) differ only in how
they build ``module.model``, a ``tokens [B, N] -> logits [B, N, V]`` network. Each holds one
:class:`CausalLMTraining`; both inherit :class:`CausalLMHooks`, which forwards every Lightning hook to
it, and neither inherits the other's behaviour. The component reaches the model through the module passed to each call
(never a stored reference), so a strategy that wraps ``module.model``'s submodules (FSDP) is seen.

Multi-GPU runs use Lightning's strategies. Under ``--trainer.strategy=fsdp`` (FSDP1, ``use_orig_params=True``)
:meth:`CausalLMTraining.configure_model` gives the strategy an auto-wrap policy that makes each of the model's
layers (``layer_types``: our ``Block``, a Hugging Face model's ``_no_split_modules``) its own FSDP unit, so the
selectors, which sit inside the layers' attention, are sharded, gathered and freed with their layer; gradient-norm
clipping stays two
groups through ``st.clip_grad_norms`` on the shards. Losses are normalised by the labelled tokens of all
ranks, so a step on ``W`` ranks of ``B`` rows each computes the gradient of one ``W * B`` row batch. Under
context parallelism (:class:`~sparse_train.lightning.context_parallel.ContextParallel`, ``--cp``) the ranks of a
CP group hold shards of the same rows instead, the groups different rows, and the same normalisation gives the
single-process gradient of the rows of all groups, under DDP and under FSDP (both average the gradients over the
whole world). Validation and test metrics are token-weighted over the rows of every rank
(:meth:`CausalLMTraining.eval_epoch_end`).

Batches are dicts with ``tokens`` and ``labels`` (aligned to positions, ``IGNORE_INDEX`` = no loss); packed
rows also carry ``document_ids`` / ``position_ids``, which go to the model when its ``forward`` takes them
(:meth:`CausalLMTraining.model_inputs`).

Loss = next-token cross-entropy on labelled positions + ``selector_loss_weight`` x the selectors'
distillation loss (``st.collect_selector_losses``); with ``train_only_selector`` every non-selector weight
is frozen and the loss is the selector loss alone (fine-tuning stage 2).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import time
from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import sparse_train as st

from ..losses import labelled_logits_loss
from ..module.collection import selector_parameter_names, selector_state_names
from ..selection.metrics import needle_block_recall
from ..tasks import IGNORE_INDEX
from ..validation import check_bool, check_float, check_int

__all__ = [
    "TrainingArgs",
    "CausalLMTraining",
    "CausalLMHooks",
    "load_weights",
    "keep_buffer_dtypes",
    "selector_parameter_names",
    "selector_state_names",
    "attached_datamodule",
    "gradient_shard_group",
    "unwrapped_name",
]


def keep_buffer_dtypes(strategy: FSDPStrategy) -> None:
    """Under FSDP with no ``mixed_precision`` of the user's, keep Lightning's parameter and reduction dtypes but
    every buffer in the dtype it was built with. Lightning's FSDP casts buffers to its precision's dtype (bf16
    under ``bf16-mixed``, fp32 under ``32-true``), and the buffers of a long-context model are its RoPE
    frequencies (the Hugging Face rotary ``inv_freq``, the selector's ``rope_inv_freq``): rounded to bf16 (8
    significant bits) they turn the rotation at position 64K by radians away from the one the checkpoint was
    trained with, silently; a float64 buffer would lose its precision under either. A single-GPU run keeps
    them as built (autocast never touches buffers); so does FSDP with ``buffer_dtype=None``."""
    if strategy.mixed_precision is not None:
        return
    config = strategy.mixed_precision_config
    if config is not None and config.buffer_dtype is not None:
        strategy.mixed_precision = dataclasses.replace(config, buffer_dtype=None)


def load_weights(model: nn.Module, path: str, prefix: str = "model.") -> dict[str, list[str]]:
    """Load a Lightning checkpoint (or a plain state dict) into ``model``.

    Selector parameters may be missing (dense -> sparse) or unexpected (sparse -> dense); any other
    mismatch is an error, because silently keeping random weights would train a different model.
    Returns the missing/unexpected key lists for logging.
    """
    blob = torch.load(path, map_location="cpu", weights_only=False)
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else blob
    if any(k.startswith(prefix) for k in state):
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    selector = selector_state_names(model)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in selector]
    # Unexpected keys are tolerated only when they are selector weights (a sparse checkpoint read by
    # a dense twin); their names contain the attention core's attribute name.
    unexpected = [k for k in result.unexpected_keys if ".core." not in k]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing={missing[:8]} unexpected={unexpected[:8]}"
        )
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


# Attributes under which wrappers (FSDP1, activation checkpointing, torch.compile) hold the wrapped module;
# they appear in parameter names seen from outside the wrapper and are not part of the model's own names.
_WRAPPER_ATTRIBUTES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def unwrapped_name(name: str) -> str:
    """``name`` without the attribute segments that FSDP, activation checkpointing or ``torch.compile``
    wrappers insert (``model.blocks.0._fsdp_wrapped_module.attn.wq.weight`` -> ``model.blocks.0.attn.wq.weight``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_ATTRIBUTES)


# Batch keys that mark where the documents of a packed row begin (sparse_train.lightning.text_data).
_BOUNDARY_KEYS = ("document_ids", "position_ids")


@functools.cache
def _forward_keywords(model_type: type) -> frozenset[str]:
    """Parameter names of ``model_type.forward`` that can be passed by keyword (``**kwargs`` excluded:
    a catch-all does not say the model honours document boundaries)."""
    params = inspect.signature(model_type.forward).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def attached_datamodule(module: LightningModule) -> Any:
    """The data module of the trainer ``module`` is attached to, or None (no trainer, or plain loaders)."""
    return getattr(module.trainer, "datamodule", None) if module._trainer is not None else None


@dataclasses.dataclass(frozen=True)
class TrainingArgs:
    """The optimisation arguments every LM module takes (documented in ``SparseLMModule``)."""

    lr: float
    selector_lr: float | None
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    min_lr_ratio: float
    selector_loss_weight: float
    train_only_selector: bool
    init_from: str | None

    @classmethod
    def checked(cls, owner: str, **values: Any) -> TrainingArgs:
        """The arguments, validated; messages name ``<owner>.<argument>``. Modules call it before they
        build anything, so a NaN learning rate or a float warm-up fails before the model loads."""
        check_float(f"{owner}.lr", values["lr"], minimum=0.0)
        check_float(f"{owner}.selector_lr", values["selector_lr"], minimum=0.0, optional=True)
        check_float(f"{owner}.weight_decay", values["weight_decay"], minimum=0.0)
        betas = values["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{owner}.betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            check_float(f"{owner}.betas[{i}]", beta, minimum=0.0, exclusive_maximum=1.0)
        check_int(f"{owner}.warmup_steps", values["warmup_steps"], minimum=0)
        check_float(f"{owner}.min_lr_ratio", values["min_lr_ratio"], minimum=0.0, maximum=1.0)
        check_float(f"{owner}.selector_loss_weight", values["selector_loss_weight"], minimum=0.0)
        check_bool(f"{owner}.train_only_selector", values["train_only_selector"])
        init_from = values["init_from"]
        if init_from is not None and not isinstance(init_from, (str, os.PathLike)):
            raise ValueError(f"{owner}.init_from must be a checkpoint path or None, got {init_from!r}")
        return cls(**{**values, "betas": tuple(betas)})


class CausalLMTraining:
    """Loss, metrics, evaluation, optimiser and schedule, data check and run messages of a causal-LM
    LightningModule whose ``model`` already exists (see the module docstring).

    Construction finishes the module: selector bookkeeping, the previous stage's weights
    (``args.init_from``), and the stage-2 freeze (``args.train_only_selector``).

    Args:
        module: The LightningModule, with ``module.model`` built.
        args: Its validated optimisation arguments.
        vocab_size: Token ids the model accepts.
        attention: ``"sparse"`` or ``"dense"`` (the start-of-fit message).
        vocab_error: Message when the data needs more token ids than the model has, formatted with
            ``need`` and ``have``.
        sparse_hint: How to ask for sparse attention in this module's config (the error message when
            ``train_only_selector`` finds no selector).
        layer_types: The model's repeated layer classes; under FSDP each instance becomes its own
            unit (:meth:`configure_model`). Empty = the strategy's own wrapping.
        dense_twin_acc: The dense twin's ``val/acc``, printed in the final line (reporting only).
    """

    def __init__(
        self,
        module: LightningModule,
        args: TrainingArgs,
        *,
        vocab_size: int,
        attention: str,
        vocab_error: str,
        sparse_hint: str,
        layer_types: tuple[type[nn.Module], ...] = (),
        dense_twin_acc: float | None = None,
    ) -> None:
        self.args = args
        self.layer_types = tuple(layer_types)
        self.vocab_size = vocab_size
        self.attention = attention
        self.vocab_error = vocab_error
        self.dense_twin_acc = dense_twin_acc
        self.selector_names = {f"model.{n}" for n in selector_parameter_names(module.model)}
        if args.train_only_selector and not self.selector_names:
            raise ValueError(f"train_only_selector needs sparse attention ({sparse_hint})")
        if args.init_from:
            info = load_weights(module.model, args.init_from)
            rank_zero_info(
                f"[sparse-train] initialised from {args.init_from} "
                f"(new selector tensors: {len(info['missing'])}, dropped: {len(info['unexpected'])})"
            )
        if args.train_only_selector:
            for name, p in module.named_parameters():
                p.requires_grad_(name in self.selector_names)
        # Recorded before any strategy wraps the model: FSDP replaces each parameter's data by a flat 1-D
        # view of this rank's shard, so neither shapes nor sizes can be read from the parameters later.
        self.low_dim_names = {name for name, p in module.named_parameters() if p.dim() < 2}
        unique = {id(p): p for p in module.model.parameters()}.values()  # tied weights once
        self.parameter_counts = (sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad))
        self.final_metrics: dict[str, float] = {}
        self._eval_counts: dict[str, list[float]] = {}
        self._fit_start = 0.0
        self._warned_boundaries = False
        # Set by the ContextParallel callback (sparse_train.lightning.context_parallel): every batch is
        # sharded along the sequence and the selector losses are this rank's shares. None = no CP.
        self.context_parallel = None

    # ------------------------------------------------------------------ data
    def check_data(self, datamodule: Any) -> None:
        """Raise ``ValueError`` when ``datamodule`` produces token ids the model cannot embed. Called from
        ``setup`` and, before training starts, by the ``sparse-train`` CLI (so it reports a config error)."""
        need = getattr(datamodule, "vocab_size", None)
        if need is not None and need > self.vocab_size:
            raise ValueError(self.vocab_error.format(need=need, have=self.vocab_size))

    # ------------------------------------------------------------------ steps
    def model_inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The document-boundary tensors of ``batch`` (``document_ids``, ``position_ids``; packed rows, see
        :mod:`~sparse_train.lightning.text_data`) that ``model.forward`` names as keywords: our
        ``Transformer`` takes ``document_ids``, :class:`~sparse_train.lightning.hf.HFCausalLM` takes
        ``position_ids``. A model that takes neither gets only the tokens and attends across the documents of
        a row; that is warned once (the labels still never cross a document)."""
        accepted = _forward_keywords(type(model))
        inputs = {key: batch[key] for key in _BOUNDARY_KEYS if key in batch and key in accepted}
        if not inputs and any(key in batch for key in _BOUNDARY_KEYS) and not self._warned_boundaries:
            self._warned_boundaries = True
            present = ", ".join(key for key in _BOUNDARY_KEYS if key in batch)
            rank_zero_warn(
                f"the batch marks document boundaries ({present}) but {type(model).__name__}.forward "
                f"takes none of {_BOUNDARY_KEYS}: attention crosses the documents packed into a row"
            )
        return inputs

    def _lm_loss(
        self, module: LightningModule, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.context_parallel is not None:
            batch = self.context_parallel.shard_batch(batch)
        inputs = self.model_inputs(module.model, batch)
        labels = batch["labels"]
        if "labels" in _forward_keywords(type(module.model)):
            # our Transformer and HFCausalLM compute the loss in their forward, a chunk of logits at a time (never
            # [B, N, V] where the head allows it)
            out = module.model(batch["tokens"], labels=labels, **inputs)
            return out.loss_sum, out.correct, out.count
        # a model without a labels path: its logits, projected through the loss at the labelled positions only
        logits = module.model(batch["tokens"], **inputs)
        return tuple(labelled_logits_loss(logits, labels, ignore_index=IGNORE_INDEX))

    @staticmethod
    def _tokens_per_rank(module: LightningModule, count: torch.Tensor) -> torch.Tensor:
        """The labelled tokens of all ranks divided by the number of ranks. DDP and FSDP average the ranks'
        gradients, so dividing each rank's loss sum by this (not by its own count) makes the step the
        gradient of the mean over every labelled token of the global batch, as one device would compute
        it, also when the ranks' rows hold different numbers of labels."""
        trainer = module._trainer
        if trainer is None or trainer.world_size == 1:
            return count.float()
        return trainer.strategy.reduce(count.float(), reduce_op="sum") / trainer.world_size

    def training_step(self, module: LightningModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss_sum, correct, count = self._lm_loss(module, batch)
        lm_loss = loss_sum / self._tokens_per_rank(module, count).clamp_min(1)
        sel_loss = st.collect_selector_losses(module.model) if self.selector_names else None
        if sel_loss is not None and self.context_parallel is not None:
            # A rank's selector loss is its share of its CP group's; DDP and FSDP average over all ranks, so this
            # makes the average the mean of the groups' losses, as they average the ranks' own losses without CP.
            sel_loss = sel_loss * self.context_parallel.size
        if self.args.train_only_selector:
            loss = sel_loss * self.args.selector_loss_weight
        elif sel_loss is not None:
            loss = lm_loss + self.args.selector_loss_weight * sel_loss
        else:
            loss = lm_loss
        bs = batch["tokens"].shape[0]
        # Averaged over the ranks (a no-op on one device): with the normalisation above the mean of the
        # ranks' lm_loss is the global batch's token mean, the number one device would log.
        sync = module._trainer is not None and module.trainer.world_size > 1
        module.log("train/loss", loss, prog_bar=True, batch_size=bs, sync_dist=sync)
        module.log("train/lm_loss", lm_loss.detach(), batch_size=bs, sync_dist=sync)
        module.log("train/acc", correct.float() / count.clamp_min(1), prog_bar=True, batch_size=bs, sync_dist=sync)
        if sel_loss is not None:
            module.log("train/selector_loss", sel_loss.detach(), batch_size=bs, sync_dist=sync)
        return loss

    def eval_step(self, module: LightningModule, batch: dict[str, torch.Tensor], prefix: str) -> None:
        """Accumulate loss, correct answers and labelled positions of a validation/test batch (under CP: of
        this rank's shard of it); :meth:`eval_epoch_end` sums them over the ranks."""
        loss_sum, correct, count = self._lm_loss(module, batch)
        acc = self._eval_counts.setdefault(prefix, [0.0, 0.0, 0.0])
        acc[0] += float(loss_sum)
        acc[1] += float(correct)
        acc[2] += float(count)
        self._count_needle_hits(module, batch, prefix)

    def _count_needle_hits(self, module: LightningModule, batch: dict[str, torch.Tensor], prefix: str) -> None:
        """Needle-block recall of each sparse layer on tasks that know where the answers are."""
        dm = attached_datamodule(module)
        if not hasattr(dm, "needle_positions"):
            return
        pairs = dm.needle_positions(batch["tokens"].cpu(), batch["labels"].cpu())
        if pairs.numel() == 0:
            return
        cores = [m for m in module.model.modules() if isinstance(m, st.SparseAttention)]
        for layer, core in enumerate(cores):
            index = core.last_selection
            if index is None:  # dense path: every block was read
                continue
            hits = needle_block_recall(index, pairs)
            slot = self._eval_counts.setdefault(f"{prefix}/needle_recall/layer{layer}", [0.0, 0.0])
            slot[0] += float(hits.sum()) * pairs.shape[0]
            slot[1] += hits.numel() * pairs.shape[0]

    def eval_epoch_end(self, module: LightningModule, prefix: str) -> None:
        """Log the epoch's exact metrics (and keep them as ``final_metrics`` outside the sanity check).

        ``loss`` and ``acc`` are token-weighted over the labelled positions of every rank: the sums are
        added over the world, so ranks that read different rows (data parallelism) or shards of the same
        rows (context parallelism) give the single-process value over all of them; ranks that read the
        same rows (a data module that gives every replica the whole held-out set) count them equally
        often, which leaves the means unchanged. The needle recalls are each rank's own, averaged over
        the ranks by ``sync_dist``."""
        needle = {}
        for key in [key for key in self._eval_counts if key.startswith(f"{prefix}/needle_recall/")]:
            hits, total = self._eval_counts.pop(key)
            needle[key] = hits / max(total, 1.0)
        loss_sum, correct, count = self._eval_counts.pop(prefix, [0.0, 0.0, 0.0])
        trainer = module._trainer
        if trainer is not None and trainer.world_size > 1:  # every rank, also one that saw no batch
            totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=module.device)
            loss_sum, correct, count = trainer.strategy.reduce(totals, reduce_op="sum").tolist()
        if count == 0:
            return
        # Exact token-weighted means over the whole held-out set (not a mean of batch means).
        metrics = {f"{prefix}/loss": loss_sum / count, f"{prefix}/acc": correct / count}
        if needle:
            # Mean over layers, and the best layer: retrieval usually happens in one layer, and the
            # others have no reason to look at the needle (their recall stays near random).
            metrics.update(needle)
            metrics[f"{prefix}/needle_recall"] = sum(needle.values()) / len(needle)
            metrics[f"{prefix}/needle_recall_best_layer"] = max(needle.values())
        module.log_dict(metrics, prog_bar=True, sync_dist=True)
        if not module.trainer.sanity_checking:
            self.final_metrics.update(metrics)

    # ------------------------------------------------------------------ lifecycle
    def configure_model(self, module: LightningModule) -> None:
        """Under Lightning's ``FSDPStrategy`` without an ``auto_wrap_policy`` of the user's, give the strategy
        one that makes every ``layer_types`` module its own FSDP unit; the root unit Lightning wraps around
        the LightningModule keeps the rest (embeddings, final norm, head). Without a policy the whole model
        is one unit: every parameter gathered at once, nothing saved in memory. (Wrapping the layers here
        with ``wrap`` is no alternative: Lightning then leaves the root unwrapped, and the parameters outside
        the layers would be neither sharded nor synchronised.) Each selector lives inside its layer's
        attention and is sharded, gathered and freed with the layer. Buffers keep the dtype they were built
        with (:func:`keep_buffer_dtypes`). A module an earlier call of this process wrapped is refused
        (:func:`check_not_wrapped_before`). No-op for every other strategy and without a trainer
        (``load_from_checkpoint`` calls this hook too)."""
        if module._trainer is None:
            return
        strategy = module.trainer.strategy
        if isinstance(strategy, FSDPStrategy):
            check_not_wrapped_before(module)
        if isinstance(strategy, FSDPStrategy) and self.layer_types and "auto_wrap_policy" not in strategy.kwargs:
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            strategy.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(set(self.layer_types))
        if isinstance(strategy, FSDPStrategy):
            keep_buffer_dtypes(strategy)

    def check_strategy(self, module: LightningModule) -> None:
        """Raise ``ValueError`` when DDP would fail mid-run: a selector that does not distill on every
        step (``distill="off"`` or ``distill_every > 1``) leaves its parameters without gradients on some
        steps, which DDP without ``find_unused_parameters`` reports as an error at the next step."""
        strategy = module.trainer.strategy
        ddp = strategy.model if isinstance(strategy, DDPStrategy) else None
        if ddp is None or getattr(ddp, "find_unused_parameters", True):
            return
        skipping = [
            core
            for core in module.model.modules()
            if isinstance(core, st.SparseAttention)
            and (core.config.distill == "off" or core.config.distill_every > 1)
            and any(p.requires_grad for p in core.parameters())
        ]
        if skipping:
            cfg = skipping[0].config
            raise ValueError(
                f"DDP: the selectors do not distill on every step (distill={cfg.distill!r}, "
                f"distill_every={cfg.distill_every}), so their parameters miss gradients on some "
                "steps; use --trainer.strategy=ddp_find_unused_parameters_true (or distill_every=1)"
            )

    def on_fit_start(self, module: LightningModule) -> None:
        self.check_strategy(module)
        self._fit_start = time.perf_counter()
        n, trainable = self.parameter_counts
        rank_zero_info(
            f"[sparse-train] {self.attention} attention, {n / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable"
        )

    def on_fit_end(self, module: LightningModule) -> None:
        minutes = (time.perf_counter() - self._fit_start) / 60
        chance = getattr(attached_datamodule(module), "chance", None)
        parts = [f"{k} = {v:.4f}" for k, v in sorted(self.final_metrics.items()) if "/layer" not in k]
        if chance is not None:
            parts.append(f"chance = {chance:.4f}")
        for key in (
            "attn/density",
            "attn/mass_recall_mean",
            "attn/mass_recall_p5",
            "attn/oracle_mass_recall_mean",
            "attn/oracle_density_r90",
        ):
            value = module.trainer.callback_metrics.get(key)
            if value is not None:  # the last training-time measurement (sparse config metrics_every)
                parts.append(f"{key.split('/', 1)[1]} = {float(value):.4f}")
        twin = self.dense_twin_acc
        if twin is not None and "val/acc" in self.final_metrics:
            parts.append(
                f"dense twin val/acc = {twin:.4f} (this run: {self.final_metrics['val/acc'] / twin:.1%} of it)"
            )
        rank_zero_info(f"[sparse-train] done: {module.global_step} steps in {minutes:.1f} min; " + ", ".join(parts))

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self, module: LightningModule) -> dict[str, Any]:
        """AdamW with three groups (decayed matrices; norms and embeddings; selectors at ``selector_lr``),
        linear warm-up then cosine decay to ``min_lr_ratio`` at ``trainer.max_steps``, stepped per step."""
        hp = self.args
        decay, no_decay, selector = [], [], []
        for wrapped_name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            name = unwrapped_name(wrapped_name)
            if name in self.selector_names:
                selector.append(p)
            elif name in self.low_dim_names or "embed" in name:
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay, "lr": hp.lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": hp.lr},
            {"params": selector, "weight_decay": 0.0, "lr": hp.lr if hp.selector_lr is None else hp.selector_lr},
        ]
        groups = [g for g in groups if g["params"]]
        optimizer = torch.optim.AdamW(groups, betas=tuple(hp.betas))
        max_steps = module.trainer.max_steps
        total = max_steps if max_steps and max_steps > 0 else 10_000

        def schedule(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            t = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        module: LightningModule,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None,
        gradient_clip_algorithm: str | None,
    ) -> None:
        """``--trainer.gradient_clip_val`` with the norm algorithm clips the model's and the selectors'
        gradients as two groups (``st.clip_grad_norms``): one global norm would let the selectors'
        large distillation gradients shrink the model's steps, so the sparse model would not train like
        its dense twin. Under FSDP the gradients are shards and the norms are reduced over the ranks
        that hold them (Lightning's FSDP precision plugin refuses norm clipping). Value clipping is per
        element and needs no split."""
        if not gradient_clip_val:
            return
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm != "norm":
            module.clip_gradients(
                optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
            )
            return
        # The precision plugin has unscaled the gradients (fp16 AMP) before it calls this hook.
        st.clip_grad_norms(
            module.model, float(gradient_clip_val), process_group=gradient_shard_group(module.trainer.strategy)
        )


def check_not_wrapped_before(module: LightningModule) -> None:
    """Raise ``RuntimeError`` when ``module`` already holds FSDP units from an earlier ``trainer.fit`` /
    ``validate`` / ``test`` of this process. Lightning's ``FSDPStrategy`` then skips wrapping the root
    (Lightning-AI/pytorch-lightning#19015), so the parameters outside the layers (embeddings, final norm,
    head) stay flat shards and the first forward fails deep inside ("'weight' must be 2-D") or, worse,
    computes with shards. The message names the ways that work."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise RuntimeError(
            f"this {type(module).__name__} was already wrapped by FSDP in an earlier trainer.fit/validate/test of "
            "this process, and Lightning's FSDPStrategy does not wrap it again (the parameters outside the layers "
            "would stay sharded; Lightning-AI/pytorch-lightning#19015). Validate during fit (val_check_interval, "
            "limit_val_batches), or start from the checkpoint in a new process: `sparse-train validate --config ... "
            "--ckpt_path PATH`, or a fresh module from `load_from_checkpoint(PATH)` with a new Trainer"
        )


def gradient_shard_group(strategy: Any) -> torch.distributed.ProcessGroup | None:
    """The process group over which ``strategy``'s parameter gradients are split (Lightning's
    ``FSDPStrategy``, FSDP1 with ``use_orig_params=True``: each rank's ``p.grad`` is its piece of the
    parameter), or None when every rank holds whole gradients (one device, DDP, FSDP ``NO_SHARD``).
    Hybrid sharding splits within the group FSDP reports and replicates across groups, so the norms
    are summed over that group only."""
    if not isinstance(strategy, FSDPStrategy) or strategy.world_size == 1:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    root = strategy.model
    if not isinstance(root, FullyShardedDataParallel):
        raise RuntimeError(
            f"FSDPStrategy's model is a {type(root).__name__}, not the FSDP root the gradient clipping expects"
        )
    if root.sharding_strategy == ShardingStrategy.NO_SHARD:
        return None
    return root.process_group


class CausalLMHooks(LightningModule):
    """The Lightning hooks of a causal-LM module, each forwarded to ``self.training_logic`` (a
    :class:`CausalLMTraining`). A subclass builds ``self.model`` and ``self.training_logic`` in its
    ``__init__`` and defines ``forward``; nothing else of its behaviour comes from here."""

    training_logic: CausalLMTraining

    @property
    def final_metrics(self) -> dict[str, float]:
        """The last validation/test metrics of the fit (what the final line prints)."""
        return self.training_logic.final_metrics

    def check_data(self, datamodule: Any) -> None:
        """Raise ``ValueError`` when ``datamodule`` produces token ids the model cannot embed (also called
        by the ``sparse-train`` CLI before training, so it reports a config error)."""
        self.training_logic.check_data(datamodule)

    def setup(self, stage: str) -> None:
        self.check_data(attached_datamodule(self))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_logic.training_step(self, batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.training_logic.eval_step(self, batch, "val")

    def on_validation_epoch_end(self) -> None:
        self.training_logic.eval_epoch_end(self, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.training_logic.eval_step(self, batch, "test")

    def on_test_epoch_end(self) -> None:
        self.training_logic.eval_epoch_end(self, "test")

    def configure_model(self) -> None:
        self.training_logic.configure_model(self)

    def on_fit_start(self) -> None:
        self.training_logic.on_fit_start(self)

    def on_fit_end(self) -> None:
        self.training_logic.on_fit_end(self)

    def configure_optimizers(self) -> dict[str, Any]:
        return self.training_logic.configure_optimizers(self)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        self.training_logic.configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
