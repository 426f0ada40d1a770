"""Step-labelled progress bars (issue 11, "Reliability"): Lightning labels a step-based run ``Epoch 0/-2``
(``max_epochs`` is -1); ``StepRichProgressBar`` / ``StepTQDMProgressBar`` show ``step s/max_steps``."""

from __future__ import annotations

import pytest

from sparse_train.lightning import SparseLMModule, StepRichProgressBar, StepTQDMProgressBar, TransformerConfig
from sparse_train.lightning.callbacks import step_description
from sparse_train.lightning.data import RetrievalDataModule


@pytest.mark.parametrize("bar_class", [StepRichProgressBar, StepTQDMProgressBar], ids=["rich", "tqdm"])
def test_progress_bars_describe_steps(bar_class, tmp_path):
    from lightning.pytorch import Callback, Trainer

    seen: list[str] = []

    class ReadLabel(Callback):  # runs after the bar's own hook (callbacks keep their order)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if isinstance(bar, StepRichProgressBar):
                seen.append(str(bar.progress.tasks[bar.train_progress_bar_id].description))
            else:
                seen.append(bar.train_progress_bar.desc)

    module = SparseLMModule(TransformerConfig(vocab_size=70, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                              attention="dense"))
    data = RetrievalDataModule(seq_len=64, num_pairs=2, num_queries=2, num_keys=4, batch_size=2, val_samples=2)
    bar = bar_class()
    trainer = Trainer(max_steps=3, callbacks=[bar, ReadLabel()], logger=False, enable_checkpointing=False,
                      enable_model_summary=False, accelerator="cpu", limit_val_batches=0,
                      default_root_dir=tmp_path)
    trainer.fit(module, data)
    # rich keeps the theme's style markup ("[...]") in front, tqdm appends ": "
    assert [label.split("]")[-1].strip().rstrip(":") for label in seen] == ["step 1/3", "step 2/3", "step 3/3"]


def test_epoch_based_run_keeps_lightnings_label():
    from lightning.pytorch import Trainer

    assert step_description(Trainer(max_epochs=2, logger=False, enable_checkpointing=False)) is None
