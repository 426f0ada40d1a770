"""Lightning training stack: model, LightningModule, data modules, timing and progress-bar callbacks.

Run it through the ``sparse-train`` console script (:mod:`sparse_train.cli`) with a recipe from
``recipes/``; the classes are importable for custom scripts.
"""

from .callbacks import StepRichProgressBar, StepTimer, StepTQDMProgressBar
from .data import ByteLMDataModule, RetrievalDataModule, RetrievalTask
from .model import Transformer, TransformerConfig
from .hf import HFCausalLMModule
from .module import SparseLMModule, load_weights

__all__ = ["StepTimer", "StepRichProgressBar", "StepTQDMProgressBar", "ByteLMDataModule", "RetrievalDataModule",
           "RetrievalTask", "Transformer", "TransformerConfig", "SparseLMModule", "HFCausalLMModule", "load_weights"]
