"""Gradient clipping must not couple the model to its selectors.

The selectors' distillation gradients are large (the lr multiplier reparametrisation scales them), so
clipping one global norm over model and selector parameters shrinks the model's step whenever the
selectors learn: the sparse model then trains slower than its dense twin even while its attention is
still dense (measured on the 16K retrieval recipe: behind its twin at step 1300 of the dense warm-up).
"""

from __future__ import annotations

import pytest
import torch

import sparse_train as st
from sparse_train.lightning import RetrievalDataModule, SparseLMModule, TransformerConfig

TINY = dict(vocab_size=70, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
SPARSE = dict(block_q=32, block_k=32, top_k=2, window=1, sinks=1, backend="reference", dense_warmup_steps=100)


def _train(attention: str, tmp_path, clip: float | None, steps: int = 4) -> dict[str, torch.Tensor]:
    from lightning.pytorch import Trainer, seed_everything

    seed_everything(0)
    module = SparseLMModule(TransformerConfig(**TINY, attention=attention, sparse=SPARSE), lr=1e-2, warmup_steps=1)
    dm = RetrievalDataModule(
        seq_len=128, num_pairs=2, num_queries=2, num_keys=4, num_values=8, batch_size=2, val_samples=2
    )
    trainer = Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        accelerator="cpu",
        gradient_clip_val=clip,
        default_root_dir=tmp_path / attention,
    )
    trainer.fit(module, dm)
    selector = {id(p) for p in st.selector_parameters(module.model)}
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if id(p) not in selector}


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["no-clip", "clip-active"])
def test_dense_warmup_trains_model_weights_exactly_like_the_dense_twin(tmp_path, clip):
    sparse = _train("sparse", tmp_path, clip)
    dense = _train("dense", tmp_path, clip)
    assert sparse.keys() == dense.keys()
    worst = max(float((sparse[n] - dense[n]).abs().max()) for n in dense)
    print(f"clip={clip}: largest difference of a model weight, sparse (warm-up) vs dense twin: {worst:.3e}")
    assert worst == 0.0


def test_clip_grad_norms_clips_model_and_selectors_separately():
    torch.manual_seed(0)
    attn = st.SparseAttention(st.SparseAttentionConfig(block_q=16, block_k=16, top_k=1, window=1, sinks=0), 2, 1, 8)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "attn": attn})
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    selector_params = list(st.selector_parameters(model))
    model_params = [p for p in model.parameters() if all(p is not s for s in selector_params)]
    assert selector_params and model_params
    expected = [
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps])) for ps in (model_params, selector_params)
    ]
    model_norm, selector_norm = st.clip_grad_norms(model, max_norm=1.0)
    assert float(model_norm) == pytest.approx(float(expected[0]))
    assert float(selector_norm) == pytest.approx(float(expected[1]))
    for params in (model_params, selector_params):
        after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
        assert float(after) == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norms_rejects_bad_max_norm():
    with pytest.raises(ValueError, match="max_norm"):
        st.clip_grad_norms(torch.nn.Linear(2, 2), max_norm=0.0)


@pytest.mark.gpu
def test_dense_warmup_matches_dense_twin_on_gpu(tmp_path):
    """bf16-mixed on CUDA with the Triton path: the sparse model in its dense warm-up must move its
    model weights like its dense twin, up to the run-to-run noise of dense training itself."""
    from lightning.pytorch import Trainer, seed_everything

    def train(attention: str, tag: str) -> dict[str, torch.Tensor]:
        seed_everything(0)
        sparse = dict(block_q=64, block_k=64, top_k=2, window=1, sinks=1, dense_warmup_steps=100, distill="dense")
        module = SparseLMModule(TransformerConfig(**TINY, attention=attention, sparse=sparse), lr=1e-2, warmup_steps=1)
        dm = RetrievalDataModule(
            seq_len=1024, num_pairs=2, num_queries=2, num_keys=4, num_values=8, batch_size=4, val_samples=2
        )
        trainer = Trainer(
            max_steps=20,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            accelerator="gpu",
            devices=1,
            precision="bf16-mixed",
            gradient_clip_val=0.5,
            default_root_dir=tmp_path / tag,
        )
        trainer.fit(module, dm)
        selector = {id(p) for p in st.selector_parameters(module.model)}
        return {n: p.detach().float().cpu() for n, p in module.model.named_parameters() if id(p) not in selector}

    dense = train("dense", "dense")
    dense_again = train("dense", "dense_again")
    sparse = train("sparse", "sparse")

    def worst(a, b):
        return max(float((a[n] - b[n]).abs().max()) for n in a)

    noise, gap = worst(dense, dense_again), worst(dense, sparse)
    print(f"after 20 steps: dense vs dense rerun {noise:.3e}, dense vs sparse warm-up {gap:.3e}")
    assert gap <= noise * 2.0 + 1e-7
