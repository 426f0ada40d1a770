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

The training logic (loss, metrics, optimiser, messages) is :class:`~sparse_train.lightning.training.CausalLMTraining`,
shared by composition with :class:`~sparse_train.lightning.hf.HFCausalLMModule`; this module builds the
model, and :class:`~sparse_train.lightning.training.CausalLMHooks` forwards its Lightning hooks.
"""

from __future__ import annotations

import torch

from ..validation import check_float, check_keys
from .model import Block, Transformer, TransformerConfig
from .training import CausalLMHooks, CausalLMTraining, TrainingArgs, load_weights

__all__ = ["SparseLMModule", "load_weights"]


class SparseLMModule(CausalLMHooks):
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

    def __init__(
        self,
        model: TransformerConfig = TransformerConfig(),  # noqa: B008 (LightningCLI reads the dataclass default)
        lr: float = 3e-3,
        selector_lr: float | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        selector_loss_weight: float = 1.0,
        train_only_selector: bool = False,
        init_from: str | None = None,
        dense_twin_acc: float | None = None,
    ) -> None:
        super().__init__()
        args = TrainingArgs.checked(
            "SparseLMModule",
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
        check_float("SparseLMModule.dense_twin_acc", dense_twin_acc, minimum=0.0, maximum=1.0, optional=True)
        self.save_hyperparameters()
        if isinstance(model, dict):  # from a checkpoint's hparams or a plain YAML mapping
            check_keys("SparseLMModule.model", model, TransformerConfig.__dataclass_fields__)
            model = TransformerConfig(**model)
        if not isinstance(model, TransformerConfig):
            raise ValueError(f"SparseLMModule.model must be a TransformerConfig or a dict of its fields, got {model!r}")
        self.model_config = model
        self.model = Transformer(model)
        self.training_logic = CausalLMTraining(
            self,
            args,
            vocab_size=model.vocab_size,
            attention=model.attention,
            vocab_error="data needs vocab_size >= {need} but model.vocab_size = {have}; "
            "set --model.init_args.model.vocab_size={need}",
            sparse_hint="model.attention: sparse",
            layer_types=(Block,),
            dense_twin_acc=dense_twin_acc,
        )

    # ------------------------------------------------------------------ the model's forward (hooks: CausalLMHooks)
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)
