"""Lightning training stack: model, LightningModules, data modules, timing and progress-bar callbacks.

Run it through the ``sparse-train`` console script (:mod:`sparse_train.cli`) with a recipe from
``recipes/``; the classes are importable for custom scripts. The two LightningModules
(:class:`SparseLMModule` for our ``Transformer``, :class:`HFCausalLMModule` for a Hugging Face checkpoint)
build their model and hold one :class:`~sparse_train.lightning.training.CausalLMTraining` (loss, metrics,
optimiser). The data behind the retrieval and byte-level data modules is :mod:`sparse_train.tasks`, which
needs no Lightning; :class:`TextDataModule` (:mod:`sparse_train.lightning.text_data`) packs tokenized local
text or JSONL documents for fine-tuning.
"""

from ..tasks import RetrievalTask
from .callbacks import ForkPoint, StepRichProgressBar, StepTimer, StepTQDMProgressBar
from .data import ByteLMDataModule, RetrievalDataModule
from .hf import HFCausalLMModule
from .model import Transformer, TransformerConfig
from .module import SparseLMModule
from .text_data import TextDataModule
from .training import CausalLMTraining, load_weights

__all__ = [
    "ForkPoint",
    "StepTimer",
    "StepRichProgressBar",
    "StepTQDMProgressBar",
    "ByteLMDataModule",
    "RetrievalDataModule",
    "TextDataModule",
    "RetrievalTask",
    "Transformer",
    "TransformerConfig",
    "SparseLMModule",
    "HFCausalLMModule",
    "CausalLMTraining",
    "load_weights",
]
