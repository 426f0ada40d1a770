"""Framework integrations. ``sparse_train.integrations.hf``: Hugging Face transformers
(``attn_implementation="sparse_train"``, ``enable(model, config)``); imported on demand so that
sparse_train itself does not require transformers."""

__all__ = ["hf"]
