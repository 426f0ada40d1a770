"""State dicts across the learned selectors (sparse_train/selection/state.py): the pooled scorer's weights loaded into
a token indexer, or the other way round, fail with a message naming ``SparseAttentionConfig.selector``; each loads
into a module of its own selector, and shapes of another size within one selector keep torch's own report."""

import pytest
import torch

import sparse_train as st


def attention(heads=4, kv_heads=2, head_dim=16, **fields):
    return st.SparseAttention(
        st.SparseAttentionConfig(**fields), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim
    )


class TinyModel(torch.nn.Module):
    def __init__(self, **fields):
        super().__init__()
        self.attn = attention(**fields)


@pytest.mark.parametrize(
    "pooling",
    [
        pytest.param({}, id="mean_max"),
        pytest.param({"query_pooling": "mean"}, id="mean-queries"),
        pytest.param({"query_pooling": "mean", "key_pooling": "mean"}, id="mean"),
    ],
)
@pytest.mark.parametrize("shape", [pytest.param((4, 2, 16), id="gqa2"), pytest.param((8, 2, 32), id="gqa4")])
def test_pooled_checkpoint_into_the_default_module_names_the_pooled_selector(pooling, shape):
    heads, kv_heads, head_dim = shape
    saved = TinyModel(heads=heads, kv_heads=kv_heads, head_dim=head_dim, selector="pooled", **pooling).state_dict()
    model = TinyModel(heads=heads, kv_heads=kv_heads, head_dim=head_dim)  # the defaults: the token selector
    with pytest.raises(ValueError) as info:
        model.load_state_dict(saved)
    message = str(info.value)
    assert "'attn.scorer.'" in message and "are a pooled selector's" in message, message
    assert "SparseAttentionConfig.selector='token'" in message and "build it with selector='pooled'" in message
    # the same state dict, non-strict too: the selector kind is no missing or unexpected key
    with pytest.raises(ValueError, match="build it with selector='pooled'"):
        model.load_state_dict(saved, strict=False)
    # with the selector the error names, it loads and the module scores as the saved one
    again = TinyModel(heads=heads, kv_heads=kv_heads, head_dim=head_dim, selector="pooled", **pooling)
    again.load_state_dict(saved)
    assert all(torch.equal(saved[name], tensor) for name, tensor in again.state_dict().items())


@pytest.mark.parametrize(
    "fields,message",
    [
        pytest.param({"selector_index_heads": 2}, "are a token selector's, and this layer has the pooled", id="E2"),
        pytest.param({}, "are a token selector's or a pooled one's with key_pooling='mean'", id="E1"),
    ],
)
def test_token_checkpoint_into_a_pooled_module_names_the_token_selector(fields, message):
    saved = TinyModel(**fields).state_dict()
    with pytest.raises(ValueError, match=message) as info:
        TinyModel(selector="pooled").load_state_dict(saved)
    assert "SparseAttentionConfig.selector='pooled'" in str(info.value)
    assert "selector='token'" in str(info.value)


def test_each_selector_loads_its_own_and_other_sizes_keep_torchs_report():
    for selector in ("token", "pooled"):
        model = TinyModel(selector=selector)
        model.load_state_dict(TinyModel(selector=selector).state_dict())
    # the token indexer of another selector_dim: no selector-kind error, torch's size mismatch
    with pytest.raises(RuntimeError, match="size mismatch for attn.scorer.query_proj"):
        TinyModel().load_state_dict(TinyModel(selector_dim=16).state_dict())
    with pytest.raises(RuntimeError, match="size mismatch for attn.scorer.query_proj"):
        TinyModel(selector="pooled").load_state_dict(TinyModel(selector="pooled", selector_dim=16).state_dict())


def test_oracle_module_ignores_learned_weights_when_not_strict():
    """Evaluating a trained model with the oracle selector (a diagnosis) loads its state dict non-strictly: the
    learned selector's weights are the only unexpected keys."""
    saved = TinyModel().state_dict()
    result = TinyModel(selector="oracle").load_state_dict(saved, strict=False)
    assert result.missing_keys == [] and all(".scorer." in name for name in result.unexpected_keys)


@pytest.mark.parametrize(
    "fields,has_bias",
    [
        pytest.param({}, False, id="token-kl-only"),
        pytest.param({"distill": "off"}, False, id="token-distill-off"),
        pytest.param({"selector_distill": "block"}, True, id="token-block-kl"),
        pytest.param({"distill": "sparse"}, True, id="token-sparse-kl"),
        pytest.param({"distill": "dense"}, True, id="token-dense-kl"),
        pytest.param({"selector": "pooled"}, True, id="pooled"),
        pytest.param({"selector": "pooled", "selector_distance_bias": False}, False, id="pooled-without"),
    ],
)
def test_distance_bias_exists_where_a_loss_trains_it(fields, has_bias):
    """The token-level KL never reads the distance bias: a token selector trained by it alone has none (under DDP
    without find_unused_parameters a parameter without gradients fails the step); every parameter it has learns."""
    config = st.SparseAttentionConfig(**fields)
    assert config.resolved_selector_distance_bias == has_bias
    module = attention(**fields, block_q=16, block_k=16, top_k=2, window=1, sinks=1, dense_warmup_steps=0).train()
    assert (module.scorer.distance_bias is not None) == has_bias
    if config.distill == "off":
        return
    q, k, v = torch.randn(1, 4, 160, 16), torch.randn(1, 2, 160, 16), torch.randn(1, 2, 160, 16)
    module(q, k, v).sum().add(module.selector_loss).backward()
    assert all(p.grad is not None for p in module.parameters())


def test_token_state_dict_with_a_zero_distance_bias_loads_into_the_default_module():
    """A token selector saved with a distance bias that nothing trained (zero) scores as one without it and loads
    into the default module; a trained (non-zero) bias stays an unexpected key."""
    saved = TinyModel(selector_distill="block").state_dict()
    assert not saved["attn.scorer.distance_bias"].any()
    model = TinyModel()
    model.load_state_dict(saved)
    assert torch.equal(model.attn.scorer.query_proj, saved["attn.scorer.query_proj"])
    saved["attn.scorer.distance_bias"] = torch.full_like(saved["attn.scorer.distance_bias"], 0.5)
    with pytest.raises(RuntimeError, match="Unexpected key.*attn.scorer.distance_bias"):
        TinyModel().load_state_dict(saved)
