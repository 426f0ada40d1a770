"""LightningModule for language-model training with learned block-sparse attention.

Loss = next-token cross-entropy on labelled positions + the selectors' distillation loss
(``st.collect_selector_losses``). The same module covers the three fine-tuning stages:

1. dense:    ``model.attention: dense``; plain LM training.
2. selector: ``model.attention: sparse``, ``train_only_selector: true`` and ``distill: dense`` in the
   sparse config; every base weight is frozen and only the selectors learn, by distillation.
3. sparse:   ``model.attention: sparse``; everything trains, the selectors keep distilling.

Each stage starts from the previous stage's checkpoint through ``init_from`` (weights only; missing
selector weights are allowed when coming from a dense checkpoint). Resuming an interrupted stage uses
Lightning's ``--ckpt_path``, which restores the model (selectors included), optimizer, scheduler and loop.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info

import sparse_train as st

from ..validation import check_bool, check_float, check_int, check_keys
from ..selectors.metrics import needle_block_recall
from .data import IGNORE_INDEX
from .model import Transformer, TransformerConfig

__all__ = ["SparseLMModule", "load_weights", "selector_parameter_names", "selector_state_names"]


def selector_parameter_names(model: nn.Module) -> set[str]:
    """Names (relative to ``model``) of every parameter that lives inside an ``st.SparseAttention``."""
    names: set[str] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, st.SparseAttention):
            names.update(f"{mod_name}.{p}" if mod_name else p for p, _ in mod.named_parameters())
    return names


def selector_state_names(model: nn.Module) -> set[str]:
    """Every state-dict key (parameters and buffers) that lives inside an ``st.SparseAttention``."""
    names: set[str] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, st.SparseAttention):
            names.update(f"{mod_name}.{key}" if mod_name else key for key in mod.state_dict())
    return names


def load_weights(model: nn.Module, path: str, prefix: str = "model.") -> dict[str, list[str]]:
    """Load a Lightning checkpoint (or a plain state dict) into ``model``.

    Selector parameters may be missing (dense -> sparse) or unexpected (sparse -> dense); any other
    mismatch is an error, because silently keeping random weights would train a different model.
    Returns the missing/unexpected key lists for logging.
    """
    blob = torch.load(path, map_location="cpu", weights_only=False)
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else blob
    if any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    selector = selector_state_names(model)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in selector]
    # Unexpected keys are tolerated only when they are selector weights (a sparse checkpoint read by
    # a dense twin); their names contain the attention core's attribute name.
    unexpected = [k for k in result.unexpected_keys if ".core." not in k]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing={missing[:8]} "
                           f"unexpected={unexpected[:8]}")
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


def check_training_args(owner: str, *, lr: Any, selector_lr: Any, weight_decay: Any, betas: Any, warmup_steps: Any,
                        min_lr_ratio: Any, selector_loss_weight: Any, train_only_selector: Any,
                        init_from: Any) -> None:
    """Validate the optimisation arguments every LM module shares; messages name ``<owner>.<argument>``.
    Run before anything is built, so a NaN learning rate or a float warm-up fails before the model loads."""
    check_float(f"{owner}.lr", lr, minimum=0.0)
    check_float(f"{owner}.selector_lr", selector_lr, minimum=0.0, optional=True)
    check_float(f"{owner}.weight_decay", weight_decay, minimum=0.0)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}.betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        check_float(f"{owner}.betas[{i}]", beta, minimum=0.0, exclusive_maximum=1.0)
    check_int(f"{owner}.warmup_steps", warmup_steps, minimum=0)
    check_float(f"{owner}.min_lr_ratio", min_lr_ratio, minimum=0.0, maximum=1.0)
    check_float(f"{owner}.selector_loss_weight", selector_loss_weight, minimum=0.0)
    check_bool(f"{owner}.train_only_selector", train_only_selector)
    if init_from is not None and not isinstance(init_from, (str, os.PathLike)):
        raise ValueError(f"{owner}.init_from must be a checkpoint path or None, got {init_from!r}")


class SparseLMModule(LightningModule):
    """Trains :class:`~sparse_train.lightning.model.Transformer` (sparse or dense attention).

    Args:
        model: Architecture and attention configuration.
        lr: Peak learning rate of the base model (AdamW).
        selector_lr: Learning rate of the selector parameter group (``None`` = ``lr``). The selector's
            own ``selector_lr_multiplier`` (a reparametrisation, default 10) applies on top of it, so
            the selector's effective Adam step is ``selector_lr * selector_lr_multiplier``.
        weight_decay: AdamW weight decay on matrices (norm gains and embeddings are not decayed).
        betas: AdamW betas.
        warmup_steps: Linear warm-up steps before the cosine decay.
        min_lr_ratio: Final learning rate as a fraction of the peak (cosine floor at ``max_steps``).
        selector_loss_weight: Multiplier of the summed selector distillation loss in the total loss.
        train_only_selector: Freeze every non-selector weight (fine-tuning stage 2).
        init_from: Checkpoint whose weights initialise the model (previous fine-tuning stage).
        dense_twin_acc: ``val/acc`` the recipe's dense twin reached in the committed A/B; printed in
            the final line next to this run's accuracy (a recipe fact, not used in training).
    """

    def __init__(self, model: TransformerConfig = TransformerConfig(), lr: float = 3e-3,
                 selector_lr: Optional[float] = None, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 50, min_lr_ratio: float = 0.1,
                 selector_loss_weight: float = 1.0, train_only_selector: bool = False,
                 init_from: Optional[str] = None, dense_twin_acc: Optional[float] = None) -> None:
        super().__init__()
        check_training_args("SparseLMModule", lr=lr, selector_lr=selector_lr, weight_decay=weight_decay, betas=betas,
                            warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
                            selector_loss_weight=selector_loss_weight, train_only_selector=train_only_selector,
                            init_from=init_from)
        check_float("SparseLMModule.dense_twin_acc", dense_twin_acc, minimum=0.0, maximum=1.0, optional=True)
        self.save_hyperparameters()
        if isinstance(model, dict):  # from a checkpoint's hparams or a plain YAML mapping
            check_keys("SparseLMModule.model", model, TransformerConfig.__dataclass_fields__)
            model = TransformerConfig(**model)
        if not isinstance(model, TransformerConfig):
            raise ValueError(f"SparseLMModule.model must be a TransformerConfig or a dict of its fields, "
                             f"got {model!r}")
        self.model_config = model
        self.model = Transformer(model)
        self._attach_model_state(init_from, train_only_selector, "model.attention: sparse")

    def _attach_model_state(self, init_from: Optional[str], train_only_selector: bool, sparse_hint: str) -> None:
        """Shared tail of every constructor once ``self.model`` exists: selector bookkeeping, the
        previous stage's weights, the stage-2 freeze, and the metric buffers."""
        self._selector_names = {f"model.{n}" for n in selector_parameter_names(self.model)}
        if train_only_selector and not self._selector_names:
            raise ValueError(f"train_only_selector needs sparse attention ({sparse_hint})")
        if init_from:
            info = load_weights(self.model, init_from)
            rank_zero_info(f"[sparse-train] initialised from {init_from} "
                           f"(new selector tensors: {len(info['missing'])}, dropped: {len(info['unexpected'])})")
        if train_only_selector:
            for name, p in self.named_parameters():
                p.requires_grad_(name in self._selector_names)
        self._eval_counts: dict[str, list[float]] = {}
        self.final_metrics: dict[str, float] = {}
        self._fit_start = 0.0

    # ------------------------------------------------------------------ steps
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _lm_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.model(batch["tokens"])
        labels = batch["labels"]
        mask = labels != IGNORE_INDEX
        # Only labelled positions are projected through the loss, which matters for retrieval (a few
        # answers per 4K tokens) and costs nothing for LM (all positions labelled).
        sel_logits = logits[mask].float()
        sel_labels = labels[mask]
        loss = F.cross_entropy(sel_logits, sel_labels, reduction="sum")
        correct = (sel_logits.argmax(-1) == sel_labels).sum()
        return loss, correct, mask.sum()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, correct, count = self._lm_loss(batch)
        lm_loss = loss_sum / count.clamp_min(1)
        sel_loss = st.collect_selector_losses(self.model) if self._selector_names else None
        if self.hparams.train_only_selector:
            loss = sel_loss * self.hparams.selector_loss_weight
        elif sel_loss is not None:
            loss = lm_loss + self.hparams.selector_loss_weight * sel_loss
        else:
            loss = lm_loss
        bs = batch["tokens"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log("train/lm_loss", lm_loss.detach(), batch_size=bs)
        self.log("train/acc", correct.float() / count.clamp_min(1), prog_bar=True, batch_size=bs)
        if sel_loss is not None:
            self.log("train/selector_loss", sel_loss.detach(), batch_size=bs)
        return loss

    def _eval_step(self, batch: dict[str, torch.Tensor], prefix: str) -> None:
        loss_sum, correct, count = self._lm_loss(batch)
        acc = self._eval_counts.setdefault(prefix, [0.0, 0.0, 0.0])
        acc[0] += float(loss_sum)
        acc[1] += float(correct)
        acc[2] += float(count)
        self._count_needle_hits(batch, prefix)

    def _count_needle_hits(self, batch: dict[str, torch.Tensor], prefix: str) -> None:
        """Needle-block recall of each sparse layer on tasks that know where the answers are."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if not hasattr(dm, "needle_positions"):
            return
        pairs = dm.needle_positions(batch["tokens"].cpu(), batch["labels"].cpu())
        if pairs.numel() == 0:
            return
        cores = [m for m in self.model.modules() if isinstance(m, st.SparseAttention)]
        for layer, core in enumerate(cores):
            index = core.last_selection
            if index is None:  # dense path: every block was read
                continue
            hits = needle_block_recall(index, pairs)
            slot = self._eval_counts.setdefault(f"{prefix}/needle_recall/layer{layer}", [0.0, 0.0])
            slot[0] += float(hits.sum()) * pairs.shape[0]
            slot[1] += hits.numel() * pairs.shape[0]

    def _eval_epoch_end(self, prefix: str) -> None:
        needle = {}
        for key in [key for key in self._eval_counts if key.startswith(f"{prefix}/needle_recall/")]:
            hits, total = self._eval_counts.pop(key)
            needle[key] = hits / max(total, 1.0)
        loss_sum, correct, count = self._eval_counts.pop(prefix, [0.0, 0.0, 0.0])
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
        self.log_dict(metrics, prog_bar=True, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.final_metrics.update(metrics)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    # ------------------------------------------------------------------ lifecycle
    def check_data(self, datamodule: Any) -> None:
        """Raise ``ValueError`` when ``datamodule`` produces token ids the model cannot embed. Called by
        ``setup`` and, before training starts, by the ``sparse-train`` CLI (so it reports a config error)."""
        need = getattr(datamodule, "vocab_size", None)
        if need is not None and need > self.model_config.vocab_size:
            raise ValueError(f"data needs vocab_size >= {need} but model.vocab_size = "
                             f"{self.model_config.vocab_size}; set --model.init_args.model.vocab_size={need}")

    def setup(self, stage: str) -> None:
        self.check_data(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None)

    def on_fit_start(self) -> None:
        self._fit_start = time.perf_counter()
        n = self.model.num_parameters()
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        rank_zero_info(f"[sparse-train] {self.model_config.attention} attention, {n / 1e6:.2f}M parameters, "
                       f"{trainable / 1e6:.3f}M trainable")

    def on_fit_end(self) -> None:
        minutes = (time.perf_counter() - self._fit_start) / 60
        dm = getattr(self.trainer, "datamodule", None)
        chance = getattr(dm, "chance", None)
        parts = [f"{k} = {v:.4f}" for k, v in sorted(self.final_metrics.items()) if "/layer" not in k]
        if chance is not None:
            parts.append(f"chance = {chance:.4f}")
        for key in ("attn/mass_recall_mean", "attn/mass_recall_p5", "attn/oracle_mass_recall_mean"):
            value = self.trainer.callback_metrics.get(key)
            if value is not None:  # the last training-time measurement (sparse config metrics_every)
                parts.append(f"{key.split('/', 1)[1]} = {float(value):.4f}")
        twin = self.hparams.get("dense_twin_acc")
        if twin is not None and "val/acc" in self.final_metrics:
            parts.append(f"dense twin val/acc = {twin:.4f} (this run: {self.final_metrics['val/acc'] / twin:.1%} of it)")
        rank_zero_info(f"[sparse-train] done: {self.global_step} steps in {minutes:.1f} min; " + ", ".join(parts))

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay, selector = [], [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if name in self._selector_names:
                selector.append(p)
            elif p.dim() < 2 or "embed" in name:
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
        total = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else 10_000

        def schedule(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            t = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
