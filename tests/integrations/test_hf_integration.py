"""Hugging Face integration on tiny randomly initialised Llama / Qwen2 models built offline from
configs (hidden 64, 2 layers): equality with sdpa under full selection, training under sparse
selection, padding, state-dict round trip, and clear errors for what is not supported."""

import json

import pytest
import torch

import sparse_train as st

transformers = pytest.importorskip("transformers")
from sparse_train.integrations import hf  # noqa: E402

VOCAB = 97


def build(family):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "phi3":  # fused qkv_proj
        model = transformers.Phi3ForCausalLM(
            transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        )
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return model.to(torch.float64)


FAMILIES = [pytest.param("llama", id="llama"), pytest.param("qwen2", id="qwen2")]
WITH_FUSED_QKV = FAMILIES + [pytest.param("phi3", id="phi3-fused-qkv")]
FULL = dict(block_q=16, block_k=16, top_k=64, window=1, sinks=1, selector_dim=8, dense_warmup_steps=0)
SPARSE = dict(
    block_q=16,
    block_k=16,
    top_k=2,
    window=1,
    sinks=1,
    selector_dim=8,
    dense_warmup_steps=0,
    dense_enter_density=1.0,
    dense_exit_density=1.0,
)


def tokens(batch, n, seed=0):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", WITH_FUSED_QKV)
def test_full_selection_loss_and_grads_equal_sdpa(family):
    ids = tokens(2, 96)
    dense = build(family)
    dense_loss = dense(ids, labels=ids).loss
    dense_loss.backward()
    sparse = build(family)
    hf.enable(sparse, st.SparseAttentionConfig(**FULL))
    assert sparse.config._attn_implementation == "sparse_train"
    sparse_loss = sparse(ids, labels=ids).loss
    sparse_loss.backward()
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-12, atol=1e-12)
    sparse_params = dict(sparse.named_parameters())
    for name, p_dense in dense.named_parameters():
        torch.testing.assert_close(sparse_params[name].grad, p_dense.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert st.collect_attention_stats(sparse)["fallbacks/dense_full_selection"] == 2.0


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_selection_trains(family):
    model = build(family)
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    model.train()
    ids = tokens(2, 160, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        lm_loss = model(ids, labels=ids).loss
        loss = lm_loss + st.collect_selector_losses(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(lm_loss.detach()))
    stats = st.collect_attention_stats(model)
    assert stats["dense_path"] == 0.0 and stats["density"] < 0.8, stats
    assert losses[-1] < losses[0] - 0.1, losses
    selector_grads = [p.grad for n, p in model.named_parameters() if "sparse_attention" in n]
    assert selector_grads and all(g is not None and torch.isfinite(g).all() for g in selector_grads)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("selection", [pytest.param(SPARSE, id="sparse"), pytest.param(FULL, id="full")])
def test_padded_batch_equals_unpadded_rows(family, selection):
    model = build(family)
    hf.enable(model, st.SparseAttentionConfig(**selection))
    model.eval()
    lengths = [150, 97]
    ids = tokens(2, 150, seed=2)
    mask = (torch.arange(150).view(1, -1) < torch.tensor(lengths).view(-1, 1)).long()
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for b, length in enumerate(lengths):
            alone = model(ids[b : b + 1, :length]).logits
            torch.testing.assert_close(batched[b : b + 1, :length], alone, rtol=1e-9, atol=1e-9)


def test_padding_with_a_hole_raises_clearly():
    model = build("llama")
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    ids = tokens(2, 40)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 10:15] = 0
    with pytest.raises(NotImplementedError, match="hole between real tokens in row 1"):
        model(ids, attention_mask=mask)


# ----------------------------------------------------------------------------------------- packing, padding
FULL_SPARSE_PATH = dict(FULL, dense_fallback=False)


def each_document_alone(model, ids, lengths):
    parts, start = [], 0
    for n in lengths:
        parts.append(model(ids[:, start : start + n]).logits)
        start += n
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "selection", [pytest.param(FULL_SPARSE_PATH, id="sparse-path"), pytest.param(FULL, id="dense-fallback")]
)
def test_packed_position_ids_equal_each_document_alone(family, selection):
    """DataCollatorWithFlattening's format: one row, no attention mask, position ids restarting at every
    document. On a full selection the packed row equals each document run alone through sdpa."""
    lengths = [40, 3, 70, 37]  # a document shorter than a block, boundaries inside blocks
    ids = tokens(1, sum(lengths), seed=3)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    model = build(family).eval()
    with torch.no_grad():
        want = each_document_alone(model, ids, lengths)
        hf.enable(model, st.SparseAttentionConfig(**selection))
        got = model(ids, position_ids=position_ids).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    stats = st.collect_attention_stats(model)
    assert stats["dense_path"] == (0.0 if selection is FULL_SPARSE_PATH else 1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_train_on_the_sparse_path(family):
    lengths = [[70, 20, 70], [100, 60]]
    ids = tokens(2, 160, seed=4)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    model = build(family)
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    model.train()
    loss = model(ids, position_ids=position_ids, labels=ids).loss + st.collect_selector_losses(model)
    loss.backward()
    layer = hf.attention_layers(model)[0].sparse_attention
    index = layer.last_selection
    assert index is not None and torch.isfinite(loss)
    # no query block of the first row's last document (tokens 90..159) selects a block of its first one
    assert not index.to_dense()[0, :, 6:, :4].any()


def test_document_ids_from_flash_attention_kwargs_and_position_ids():
    cu = torch.tensor([0, 5, 7, 12], dtype=torch.int32)
    got = hf.document_ids_for_call(None, 1, 12, cu)
    assert got.tolist() == [[0] * 5 + [1] * 2 + [2] * 5]
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]])
    assert hf.document_ids_for_call(position_ids, 1, 12).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2]]
    assert hf.document_ids_for_call(torch.arange(12).view(1, -1) + 4, 2, 12) is None  # no restart: one sequence
    with pytest.raises(ValueError, match="batch 1"):
        hf.document_ids_for_call(None, 2, 12, cu)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "selection", [pytest.param(FULL_SPARSE_PATH, id="sparse-path"), pytest.param(FULL, id="dense-fallback")]
)
def test_left_padding_equals_sdpa_on_real_tokens(family, selection):
    ids = tokens(3, 150, seed=6)
    mask = torch.ones(3, 150, dtype=torch.long)
    mask[1, :53] = 0  # left padding
    mask[2, :7] = 0  # left and right padding
    mask[2, 140:] = 0
    model = build(family).eval()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        hf.enable(model, st.SparseAttentionConfig(**selection))
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "selection",
    [pytest.param(FULL_SPARSE_PATH, id="sparse-prefill"), pytest.param(SPARSE, id="dense-fallback-prefill")],
)
def test_generate_with_left_padding_matches_sdpa(family, selection):
    """Two prompts of different lengths, left-padded: prefill with the padding as its own document,
    then decoding over a left-padded KV cache; greedy tokens equal sdpa's."""
    model = build(family).eval()
    model.generation_config.pad_token_id = 0
    prompts = [tokens(1, 45, seed=7)[0], tokens(1, 28, seed=8)[0]]
    ids = torch.zeros(2, 45, dtype=torch.long)
    mask = torch.zeros(2, 45, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 45 - len(p) :], mask[b, 45 - len(p) :] = p, 1
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        hf.enable(model, st.SparseAttentionConfig(**selection))
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    layers = hf.attention_layers(model)
    assert all(layer.sparse_attention.fallback_counts.get("decode", 0) == 5 for layer in layers)
    prefill_dense = layers[0].sparse_attention.fallback_counts.get("dense_full_selection", 0)
    assert prefill_dense == (0 if selection is FULL_SPARSE_PATH else 1)


@pytest.mark.parametrize("family", WITH_FUSED_QKV)
@pytest.mark.parametrize("prompt_len", [40, 170], ids=["short-prompt-full-selection", "long-prompt-sparse-prefill"])
def test_generate_after_enable(family, prompt_len):
    """generate() runs without disable(): the prompt takes the module's path, every decoding step the
    dense decode path (counted as "decode"). With a short prompt (full selection) the tokens equal
    sdpa's; a long prompt is prefilled sparse (so tokens may differ from sdpa's); the decode step's
    values are checked against a float64 reference in test_module.py."""
    model = build(family).eval()
    ids = tokens(1, prompt_len, seed=5)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    layers = hf.attention_layers(model)
    assert got.shape == want.shape
    assert all(layer.sparse_attention.fallback_counts.get("decode", 0) == 5 for layer in layers)
    if prompt_len == 40:
        assert torch.equal(got, want)
    else:
        assert layers[0].sparse_attention.fallback_counts.get("dense_full_selection", 0) == 0


# ----------------------------------------------------------------------------------------- inference mode
def _padded(kind, batch=2, n=150):
    """``(ids, forward kwargs)`` of a batch with no mask, right or left padding, or packed position ids."""
    ids = tokens(batch, n, seed=9)
    if kind == "no-mask":
        return ids, {}
    if kind == "packed-position-ids":
        return ids, {"position_ids": torch.cat([torch.arange(60), torch.arange(n - 60)]).view(1, -1).expand(batch, n)}
    mask = torch.ones(batch, n, dtype=torch.long)
    if kind == "right-padding":
        mask[1, 97:] = 0
    else:
        mask[1, :53] = 0
    return ids, {"attention_mask": mask}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["no-mask", "right-padding", "left-padding", "packed-position-ids"])
def test_inference_mode_forward_equals_no_grad(family, kind):
    """Under torch.inference_mode the masks and position ids are inference tensors, which have no version
    counter: the forward runs (twice, so a cached validation would be reused) and equals the no_grad one."""
    model = build(family).eval()
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    ids, kwargs = _padded(kind)
    with torch.no_grad():
        want = model(ids, **kwargs).logits
    with torch.inference_mode():
        inference_kwargs = {name: value.clone() for name, value in kwargs.items()}  # inference tensors
        got = model(ids, **inference_kwargs).logits
        again = model(ids, **inference_kwargs).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert st.collect_attention_stats(model)["dense_path"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_under_inference_mode_equals_no_grad(family):
    """generate() under torch.inference_mode (left-padded prompts: the prefill's mask is built inside
    inference mode) gives the tokens of generate() under torch.no_grad."""
    model = build(family).eval()
    model.generation_config.pad_token_id = 0
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    ids, kwargs = _padded("left-padding", n=120)
    with torch.no_grad():
        want = model.generate(ids, **kwargs, max_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        got = model.generate(ids, **kwargs, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_inference_tensors_are_validated_at_every_call():
    """An inference tensor has no version counter, so an in-place write cannot be told from the cached
    state: masks and position ids created under torch.inference_mode are read afresh at every call."""
    with torch.inference_mode():
        mask = torch.ones(2, 10, dtype=torch.long)
        assert hf.padding_from_mask(mask, 10)[0].tolist() == [10, 10]
        mask[1, 6:] = 0
        assert hf.padding_from_mask(mask, 10)[0].tolist() == [10, 6]
        mask[1, :2] = 0  # left padding as well: documents
        seq_lens, documents = hf.padding_from_mask(mask, 10)
        assert seq_lens is None and documents[1].tolist() == [0, 0] + [1] * 4 + [2] * 4
        positions = torch.arange(10).view(1, -1)
        assert hf.document_ids_for_call(positions, 1, 10) is None
        positions[0, 4:] = torch.arange(6)
        assert hf.document_ids_for_call(positions, 1, 10).tolist() == [[0] * 4 + [1] * 6]


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="sdpa",
)


@pytest.mark.parametrize(
    "make_model,match",
    [
        pytest.param(
            lambda: transformers.Qwen2ForCausalLM(
                transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=0)
            ),
            "sliding-window",
            id="qwen2-sliding",
        ),
        pytest.param(
            lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=32)),
            "sliding-window",
            id="mistral-sliding",
        ),
        pytest.param(
            lambda: transformers.Gemma2ForCausalLM(
                transformers.Gemma2Config(
                    **{**TINY, "attn_implementation": "eager"},
                    head_dim=16,
                    pad_token_id=0,
                    layer_types=["full_attention", "full_attention"],
                )
            ),
            "softcapping",
            id="gemma2-softcap",
        ),
    ],
)
def test_unsupported_attention_is_refused_at_enable(make_model, match):
    """A sliding window or logit softcapping would be silently ignored by causal block-sparse
    attention: enable() refuses the model and names the reason."""
    torch.manual_seed(0)
    model = make_model()
    with pytest.raises(NotImplementedError, match=match):
        hf.enable(model, st.SparseAttentionConfig(**SPARSE))


def test_mistral_without_window_is_accepted():
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=None))
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    assert len(hf.attention_layers(model)) == 2


def test_state_dict_round_trip_includes_selector():
    model = build("llama")
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    with torch.no_grad():
        for layer in hf.attention_layers(model):
            layer.sparse_attention.scorer.query_proj.mul_(-2.0)  # distinguishable from a fresh init
    state = model.state_dict()
    selector_keys = [k for k in state if "sparse_attention." in k]
    # per layer: query_proj, key_proj, log_temperature, the lr multiplier, the warm-up step count, the
    # distillation draw number, the hysteresis state and the dropout seeds' base and draw number (the default
    # token selector trained by the token-level KL has no distance bias)
    assert len(selector_keys) == 2 * 9, selector_keys
    restored = build("llama")
    hf.enable(restored, st.SparseAttentionConfig(**SPARSE))
    restored.load_state_dict(state, strict=True)
    model.eval()
    restored.eval()
    ids = tokens(1, 160, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, model(ids).logits, rtol=0, atol=0)
        for a, b in zip(hf.attention_layers(model), hf.attention_layers(restored)):
            assert torch.equal(a.sparse_attention._last_index.indices, b.sparse_attention._last_index.indices)


def test_enable_is_idempotent_and_requires_selectors():
    model = build("llama")
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    first = [layer.sparse_attention for layer in hf.attention_layers(model)]
    hf.enable(model, st.SparseAttentionConfig(**FULL))
    assert [layer.sparse_attention for layer in hf.attention_layers(model)] == first
    assert first[0].scale == pytest.approx(16**-0.5), "the selector inherits the model's logit scale"
    hf.disable(model)
    assert model.config._attn_implementation == "sdpa"
    bare = build("llama")
    hf.register()
    bare.set_attn_implementation("sparse_train")
    with pytest.raises(RuntimeError, match="enable"):
        bare(tokens(1, 20))


@pytest.mark.parametrize("family", FAMILIES)
def test_selector_unrotates_by_the_models_own_rope(family):
    """enable() hands the model's RoPE frequencies to every selector, so the pooled q/k it scores are
    the pre-rotation projections (checked against q_proj/k_proj outputs captured by hooks)."""
    model = build(family)
    hf.enable(model, st.SparseAttentionConfig(**SPARSE, selector="pooled"))  # compared with a BlockScorer below
    layer = hf.attention_layers(model)[0]
    scorer = layer.sparse_attention.scorer
    torch.testing.assert_close(scorer.rope_inv_freq, hf.rope_frequencies(model).float())
    captured = {}
    layer.q_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("q", o))
    layer.k_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("k", o))
    pooled = {}
    original_pool = scorer.pool

    def spy(q, k, *args, **kwargs):
        pooled["got"] = original_pool(q, k, *args, **kwargs)
        return pooled["got"]

    scorer.pool = spy
    model.eval()
    with torch.no_grad():
        model(tokens(1, 160, seed=3))  # 10 query blocks: a sparse selection, so the selector runs
    head_dim = layer.head_dim
    q_pre = captured["q"].view(1, 160, -1, head_dim).transpose(1, 2)
    k_pre = captured["k"].view(1, 160, -1, head_dim).transpose(1, 2)
    plain = st.selection.BlockScorer(
        scorer.num_heads,
        scorer.num_kv_heads,
        head_dim,
        8,
        key_pooling=scorer.key_pooling,
        query_pooling=scorer.query_pooling,
    )
    want_q, want_k = plain.pool(q_pre, k_pre, SPARSE["block_q"], SPARSE["block_k"])
    torch.testing.assert_close(pooled["got"][0], want_q, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pooled["got"][1], want_k, rtol=1e-4, atol=1e-5)
    assert hf.rope_frequencies(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trip(family, tmp_path):
    """Model files without selector tensors (they load as the plain model), selectors and config
    beside them; from_pretrained gives identical logits and selections."""
    model = build(family)
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    with torch.no_grad():
        for layer in hf.attention_layers(model):
            layer.sparse_attention.scorer.query_proj.mul_(-3.0)
            layer.sparse_attention.selector_steps.fill_(7)
    hf.save_pretrained(model, tmp_path)
    assert (tmp_path / hf.SELECTOR_WEIGHTS_NAME).is_file() and (tmp_path / hf.SELECTOR_CONFIG_NAME).is_file()
    model_class = type(model)
    plain, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    restored = hf.from_pretrained(model_class, tmp_path, torch_dtype=torch.float64)
    assert restored.config._attn_implementation == hf.ATTENTION_NAME
    restored_layers = hf.attention_layers(restored)
    assert restored_layers[0].sparse_attention.config == hf.attention_layers(model)[0].sparse_attention.config
    assert int(restored_layers[0].sparse_attention.selector_steps) == 7
    model.eval()
    restored.eval()
    ids = tokens(1, 160, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, model(ids).logits, rtol=0, atol=0)
    for a, b in zip(hf.attention_layers(model), restored_layers):
        assert torch.equal(a.sparse_attention._last_index.indices, b.sparse_attention._last_index.indices)


@pytest.mark.parametrize(
    "old_fields,options",
    [
        pytest.param({"r0": 3, "fused_backward": False, "gluon_kernels": None}, st.KernelOptions(r0=3), id="r0"),
        pytest.param(
            {"r0": None, "stored_ds_backward": True, "gluon_kernels": False},
            st.KernelOptions(stored_ds=True, fwd_gluon=False, dq_gluon=False, kv_gluon=False),
            id="stored-ds-triton-only",
        ),
    ],
)
def test_from_pretrained_reads_format_1_kernel_fields_into_kernel_options(old_fields, options, tmp_path):
    """A ``sparse_train_config.json`` of format 1 keeps the kernel choices as top-level fields; they load into
    ``kernel_options``."""
    model = build("llama")
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    hf.save_pretrained(model, tmp_path)
    path = tmp_path / hf.SELECTOR_CONFIG_NAME
    saved = json.loads(path.read_text())
    del saved["config"]["kernel_options"]
    saved["config"].update(old_fields, fused_backward=old_fields.get("fused_backward", False))
    saved["format_version"] = 1
    path.write_text(json.dumps(saved))
    restored = hf.from_pretrained(type(model), tmp_path)
    assert hf.attention_layers(restored)[0].sparse_attention.config.kernel_options == options
    saved["format_version"] = 7
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="format_version 7, this version reads 1 and 2"):
        hf.from_pretrained(type(model), tmp_path)


def test_from_pretrained_loads_selector_files_without_the_resume_state(tmp_path):
    """A selector file written without the resume state (``distill_draws``, ``dense_mode``) loads with their initial
    values and the saved selectors; a file missing a selector weight or holding a foreign tensor is refused."""
    from safetensors.torch import load_file, save_file

    from sparse_train.module.attention import RESUME_STATE

    model = build("llama")
    hf.enable(model, st.SparseAttentionConfig(**SPARSE))
    with torch.no_grad():
        for layer in hf.attention_layers(model):
            layer.sparse_attention.scorer.query_proj.mul_(-3.0)
            layer.sparse_attention.distill_draws.fill_(4)
    hf.save_pretrained(model, tmp_path)
    path = tmp_path / hf.SELECTOR_WEIGHTS_NAME
    saved = load_file(path)
    save_file({name: t for name, t in saved.items() if not name.endswith(RESUME_STATE)}, path)
    restored = hf.attention_layers(hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path))
    for want, got in zip(hf.attention_layers(model), restored):
        assert int(got.sparse_attention.distill_draws) == 0
        assert torch.equal(got.sparse_attention.scorer.query_proj, want.sparse_attention.scorer.query_proj)
    weight = next(name for name in saved if name.endswith("scorer.key_proj"))
    save_file({name: t for name, t in saved.items() if name != weight}, path)
    with pytest.raises(ValueError, match=rf"missing \['{weight}'\], unexpected \[\]"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path)
    foreign = "model.layers.0.self_attn.sparse_attention.extra"
    save_file({**saved, foreign: torch.zeros(1)}, path)
    with pytest.raises(ValueError, match=rf"missing \[\], unexpected \['{foreign}'\]"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path)


def test_save_and_load_refuse_models_without_selectors(tmp_path):
    with pytest.raises(ValueError, match="call hf.enable"):
        hf.save_pretrained(build("llama"), tmp_path)
    with pytest.raises(FileNotFoundError, match="sparse_train_config.json"):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path)


def test_mask_function_accepts_causal_and_packed_and_refuses_other_patterns():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        sliding_window_causal_mask_function,
    )

    packed = and_masks(causal_mask_function, packed_sequence_mask_function(torch.zeros(1, 8, dtype=torch.long)))
    assert hf.sparse_train_mask(attention_mask=None, mask_function=packed) is None
    assert hf.sparse_train_mask(attention_mask=None, mask_function=causal_mask_function) is None
    with pytest.raises(NotImplementedError, match="another mask pattern"):
        hf.sparse_train_mask(attention_mask=None, mask_function=sliding_window_causal_mask_function(4))


def test_padding_becomes_documents_while_compiling(monkeypatch):
    """While torch.compile traces there is no data-dependent branch: left and right padding both become
    documents (ids prefix 0 / real 1 / tail 2), never the right-padding lengths that left padding would
    turn into wrong attention."""
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, 7:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    mask[2, :2] = 0  # both
    mask[2, 9:] = 0
    eager_lens, eager_docs = hf.padding_from_mask(mask, 10)
    assert eager_lens is None and eager_docs[1].tolist() == [0] * 4 + [1] * 6
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    seq_lens, docs = hf.padding_from_mask(mask.clone(), 10)
    assert seq_lens is None
    assert docs.tolist() == [[1] * 7 + [2] * 3, [0] * 4 + [1] * 6, [0] * 2 + [1] * 7 + [2]]


@pytest.mark.parametrize(
    "padded,want_row",
    [
        pytest.param([(3, 5)], None, id="hole"),
        pytest.param([(0, 2), (5, 7)], None, id="left-padding-then-a-hole"),
        pytest.param([(9, 10)], [1] * 9 + [2], id="right-padding-no-hole"),
    ],
)
def test_compiled_padding_refuses_a_hole_on_the_device(padded, want_row):
    """Compiled (fullgraph, no host sync possible) a hole cannot raise the eager NotImplementedError; an
    assertion on the device refuses it instead of splitting the real tokens into documents. Right and left
    padding still compile to documents (``want_row``: row 1's ids; None: a hole)."""
    compiled = torch.compile(lambda m: hf.padding_from_mask(m, 10)[1], fullgraph=True, backend="aot_eager")
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :2] = 0  # left padding in row 0: always fine
    for start, stop in padded:
        mask[1, start:stop] = 0
    if want_row is None:
        with pytest.raises(RuntimeError, match="padded hole between real tokens"):
            compiled(mask)
    else:
        assert compiled(mask).tolist() == [[0, 0] + [1] * 8, want_row]


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_equals_sdpa_while_compiling(family, monkeypatch):
    ids = tokens(2, 150, seed=8)
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[1, :61] = 0
    model = build(family).eval()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        hf.enable(model, st.SparseAttentionConfig(**FULL_SPARSE_PATH))
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-9, atol=1e-9)


def _loss_and_grads(model, call):
    model.zero_grad(set_to_none=True)
    out = call()
    (2.0 * out.loss_sum).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family,attention",
    [
        pytest.param("llama", "sdpa", id="llama"),
        pytest.param("qwen2", "sdpa", id="qwen2"),
        pytest.param("phi3", "sdpa", id="phi3"),
        pytest.param("llama", "sparse", id="llama-sparse"),
    ],
)
def test_labels_path_runs_the_chunked_head_and_equals_the_logits_loss(family, attention, monkeypatch):
    """``HFCausalLM(tokens, labels=...)``, the Lightning training loss, takes the decoder's hidden states through
    ``st.linear_cross_entropy`` (chunk forced to 5 rows) and equals cross-entropy over the model's own logits:
    loss, correct count, every gradient, in float64."""
    import torch.nn.functional as F

    import sparse_train.losses as losses_module
    from sparse_train.lightning.hf import HFCausalLM

    chunks = []
    real = losses_module.linear_cross_entropy
    monkeypatch.setattr(
        losses_module,
        "linear_cross_entropy",
        lambda *a, **k: chunks.append(a[0].shape[0]) or real(*a, **{**k, "chunk_tokens": 5}),
    )
    model = build(family)
    if attention == "sparse":
        hf.enable(model, st.SparseAttentionConfig(**SPARSE, distill="off"))
    wrapped = HFCausalLM(model)
    ids = tokens(2, 64, seed=3)
    labels = tokens(2, 64, seed=4)
    labels[0, :20] = -100
    got, got_grads = _loss_and_grads(model, lambda: wrapped(ids, labels=labels))
    assert wrapped.chunked_head and chunks == [int((labels != -100).sum())]

    def plain():
        logits = wrapped(ids)[labels != -100]
        loss = F.cross_entropy(logits, labels[labels != -100], reduction="sum")
        return type(got)(loss, (logits.argmax(-1) == labels[labels != -100]).sum(), (labels != -100).sum())

    want, want_grads = _loss_and_grads(model, plain)
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-12, atol=1e-12)
    assert int(got.correct) == int(want.correct) and int(got.count) == int(want.count) == 108
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_labels_path_of_a_head_it_does_not_know_uses_the_logits():
    """A model type outside the plain-head list (GPT-2 here) gets the loss from its own logits, the same value."""
    import torch.nn.functional as F

    from sparse_train.lightning.hf import HFCausalLM

    torch.manual_seed(0)
    model = (
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
            )
        )
        .double()
        .eval()
    )  # no dropout
    wrapped = HFCausalLM(model)
    ids, labels = tokens(1, 32, seed=1), tokens(1, 32, seed=2)
    assert not wrapped.chunked_head
    out = wrapped(ids, labels=labels)
    want = F.cross_entropy(wrapped(ids)[0], labels[0], reduction="sum")
    torch.testing.assert_close(out.loss_sum, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"labels must have the tokens' shape \(1, 32\)"):
        wrapped(ids, labels=labels[:, 1:])
