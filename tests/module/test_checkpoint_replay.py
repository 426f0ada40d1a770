"""Checkpoint replay: the recompute under activation checkpointing reuses the first forward's selection.

The decisive test changes the selector's parameters between forward and backward (so a re-run top-k
picks other blocks) and compares gradients with an un-checkpointed run on the original selection:
equal with replay on, and - in the same test - different with ``replay=False``, which shows the
check has teeth.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sparse_train as st
from sparse_train.kernels.triton import token_kl as token_kl_kernels
from sparse_train.selection.scorer import selection_geometry

HQ, HKV, D, N = 4, 2, 16, 160


def make(replay=True, **overrides):
    base = dict(
        block_q=16,
        block_k=16,
        top_k=2,
        window=1,
        sinks=1,
        selector_dim=8,
        replay=replay,
        dense_fallback=False,
        dense_warmup_steps=0,
    )
    base.update(overrides)
    torch.manual_seed(0)
    return st.SparseAttention(st.SparseAttentionConfig(**base), num_heads=HQ, num_kv_heads=HKV, head_dim=D)


def inputs(seed=0, batch=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, N, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, HKV, N, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, HKV, N, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(batch, HQ, N, D, generator=g, dtype=torch.float64)
    return q, k, v, w


def scramble(module):
    """Selector parameters that certainly choose other blocks."""
    with torch.no_grad():
        for p in module.scorer.parameters():
            p.copy_(torch.randn_like(p) * 3.0)


def layer(module):
    # projections before and after the core make the checkpointed region save tensors of its own
    return lambda q, k, v: module(q * 1.5, torch.tanh(k), v).sin()


def grads_without_checkpoint(**cfg):
    module = make(**cfg)
    q, k, v, w = inputs()
    out = layer(module)(q, k, v)
    loss = (out * w).sum()
    if module.selector_loss is not None:
        loss = loss + module.selector_loss
    loss.backward()
    return [t.grad for t in (q, k, v)], module._last_index


def grads_with_checkpoint_and_scrambled_selector(replay, reentrant=False, **cfg):
    module = make(replay=replay, **cfg)
    q, k, v, w = inputs()
    out = checkpoint(layer(module), q, k, v, use_reentrant=reentrant)
    loss = (out * w).sum()
    if module.selector_loss is not None:
        loss = loss + module.selector_loss
    first_index = module._last_index
    scramble(module)
    loss.backward()
    return [t.grad for t in (q, k, v)], first_index, module


REENTRANT = [pytest.param(False, id="non-reentrant"), pytest.param(True, id="reentrant")]


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("distill", ["off", "sparse"], ids=["no-distill", "sparse-distill"])
def test_recompute_replays_first_selection_and_fails_without_replay(distill, reentrant):
    reference, ref_index = grads_without_checkpoint(distill=distill)

    replayed, index, module = grads_with_checkpoint_and_scrambled_selector(True, reentrant, distill=distill)
    assert torch.equal(index.indices, ref_index.indices)
    for got, want in zip(replayed, reference):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert module.stats()["replay/hits"] == 1.0 and module.stats()["replay/misses"] == 0.0

    # the same check with replay switched off: the recompute picks new blocks -> gradients change
    fresh, _, module_off = grads_with_checkpoint_and_scrambled_selector(False, reentrant, distill=distill)
    assert module_off._last_index is not None
    worst = max(float((got - want).abs().max()) for got, want in zip(fresh, reference))
    assert worst > 1e-3, f"without replay the gradients should differ, max diff {worst:.2e}"


def test_scrambled_selector_really_changes_the_selection():
    module = make()
    q, k, v, _ = inputs()
    module(q, k, v)
    before = module._last_index.indices.clone()
    scramble(module)
    module(q, k, v)
    assert not torch.equal(before, module._last_index.indices)


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_two_forwards_then_one_backward_match_their_own_selections(reentrant):
    """Two checkpointed micro-batches, then one backward: each recompute must find its own record
    (the graph walk, or the reentrant checkpoint's node, disambiguates), not simply the most recent one."""
    module = make(distill="off")
    q1, k1, v1, w1 = inputs(seed=1)
    q2, k2, v2, w2 = inputs(seed=2)
    ref = []
    for q, k, v, w in ((q1, k1, v1, w1), (q2, k2, v2, w2)):
        (layer(module)(q, k, v) * w).sum().backward()
        ref.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    out1 = checkpoint(layer(module), q1, k1, v1, use_reentrant=reentrant)
    out2 = checkpoint(layer(module), q2, k2, v2, use_reentrant=reentrant)
    scramble(module)
    ((out1 * w1).sum() + (out2 * w2).sum()).backward()
    for got, want in zip([q1.grad, k1.grad, v1.grad, q2.grad, k2.grad, v2.grad], ref[0] + ref[1]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert module.stats()["replay/hits"] == 2.0 and module.stats()["replay/ambiguous"] == 0.0


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_recompute_does_not_count_twice_and_keeps_the_path(reentrant):
    # N=160 -> block density 0.69; a full selection afterwards flips the hysteresis state, which the
    # recompute of the earlier step must not follow
    module = make(dense_fallback=True, distill="off", dense_enter_density=0.9, dense_exit_density=0.5)
    q, k, v, w = inputs()
    out = checkpoint(layer(module), q, k, v, use_reentrant=reentrant)
    short = [t[:, :, :32].detach() for t in (q, k, v)]
    module(*short)  # full selection: dense path, hysteresis state -> dense
    assert module._dense_mode
    (out * w).sum().backward()
    counts = module.fallback_counts
    assert counts == {"reference_cpu": 1, "dense_full_selection": 1}, counts
    assert module.stats()["replay/hits"] == 1.0


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_stale_records_are_retired_after_backward(reentrant):
    module = make(distill="off")
    for step in range(3):
        q, k, v, w = inputs(seed=step)
        loss = (checkpoint(layer(module), q, k, v, use_reentrant=reentrant) * w).sum()
        loss.backward()  # `loss` stays referenced, keeping the old graph (and record) alive
    assert module.stats()["replay/hits"] == 3.0
    assert module.stats()["replay/ambiguous"] == 0.0
    assert module._replay.live_records() == [], "every replayed record must be retired when its backward ends"


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda run, q, k, v: run(q, k, v), id="no_grad"),
        pytest.param(lambda run, q, k, v: checkpoint(run, q, k, v, use_reentrant=True), id="reentrant-under-no_grad"),
    ],
)
def test_no_grad_forward_in_train_mode_computes_no_selector_loss(call):
    """A module left in train mode and run under torch.no_grad (evaluation without model.eval(); a reentrant
    checkpoint under no_grad has no backward either) computes no distillation loss and keeps no record."""
    module = make(distill="sampled").train()
    q, k, v, _ = inputs()
    with torch.no_grad():
        out = call(layer(module), q, k, v)
        want = layer(module)(q, k, v)
    assert module.selector_loss is None and module._replay.live_records() == []
    assert int(module.distill_draws) == 0, "no distillation sample was drawn"
    torch.testing.assert_close(out, want, rtol=0, atol=0)


class _UnrecognisedReentrantCheckpoint(torch.autograd.Function):
    """A reentrant checkpoint written apart from torch.utils.checkpoint (as some training libraries have their
    own): the forward under torch.no_grad, the recompute and its backward inside the backward."""

    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return run(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.run(*inputs)
        torch.autograd.backward(out, grad)
        return (None, *(t.grad for t in inputs))


def test_unrecognised_reentrant_checkpoint_warns_and_counts_a_miss():
    """Only torch.utils.checkpoint's reentrant forward is recognised; another one leaves the selector without a
    loss and the recompute without a record, which is counted and warned about, naming the remedy."""
    module = make(distill="sampled")
    q, k, v, w = inputs()
    out = _UnrecognisedReentrantCheckpoint.apply(layer(module), q, k, v)
    assert module.selector_loss is None
    with pytest.warns(UserWarning, match=r"use_reentrant=False"):
        (out * w).sum().backward()
    assert module.stats()["replay/misses"] == 1.0 and q.grad is not None


# ---------------------------------------------------------------------------------------------- Hugging Face
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).to(torch.float64)


def _enable_gradient_checkpointing(model, reentrant=False):
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hf_grads(replay, checkpointing, scramble_between):
    from sparse_train.integrations import hf

    model = _tiny_llama()
    cfg = st.SparseAttentionConfig(
        block_q=16,
        block_k=16,
        top_k=1,
        window=1,
        sinks=1,
        selector_dim=8,
        dense_warmup_steps=0,
        replay=replay,
        dense_fallback=False,
        distill="sparse",
    )
    hf.enable(model, cfg)
    model.train()
    if checkpointing:
        _enable_gradient_checkpointing(model)
    ids = torch.randint(0, 97, (2, 128), generator=torch.Generator().manual_seed(3))
    loss = model(ids, labels=ids).loss + st.collect_selector_losses(model)
    if scramble_between:
        for layer in hf.attention_layers(model):
            scramble(layer.sparse_attention)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if "sparse_attention" not in name}, model


def test_hf_gradient_checkpointing_replays_selection_and_fails_without_replay():
    reference, _ = _hf_grads(replay=True, checkpointing=False, scramble_between=False)
    replayed, model = _hf_grads(replay=True, checkpointing=True, scramble_between=True)
    stats = st.collect_attention_stats(model)
    assert stats["replay/hits"] == 2.0, "each of the two layers must have replayed its selection"
    for name, grad in reference.items():
        torch.testing.assert_close(replayed[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    fresh, _ = _hf_grads(replay=False, checkpointing=True, scramble_between=True)
    worst = max(float((fresh[name] - grad).abs().max()) for name, grad in reference.items())
    assert worst > 1e-4, f"without replay the gradients should differ, max diff {worst:.2e}"


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_hf_gradient_checkpointing_trains_the_selectors_as_without_checkpointing(reentrant):
    """Two optimizer steps of a tiny Llama under Hugging Face gradient checkpointing, reentrant or not: at
    each step every gradient (the model's and the selectors') equals that of the same model trained without
    checkpointing, and the selectors' gradients are not zero."""
    from sparse_train.integrations import hf

    cfg = st.SparseAttentionConfig(
        block_q=16, block_k=16, top_k=2, window=1, sinks=1, selector_dim=8, dense_warmup_steps=1, distill="sparse"
    )
    models = []
    for checkpointing in (False, True):
        model = _tiny_llama()
        hf.enable(model, cfg)
        model.train()
        if checkpointing:
            _enable_gradient_checkpointing(model, reentrant)
        models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    for step in range(2):
        ids = torch.randint(0, 97, (2, 128), generator=torch.Generator().manual_seed(step))
        grads = []
        for model, optimizer in models:
            optimizer.zero_grad(set_to_none=True)
            (model(ids, labels=ids).loss + st.collect_selector_losses(model)).backward()
            grads.append({name: p.grad for name, p in model.named_parameters()})
            optimizer.step()
        plain, checkpointed = grads
        selector = sorted(name for name in plain if "sparse_attention" in name)
        assert selector and all(checkpointed[name] is not None for name in selector), f"step {step}"
        for prefix in {name.split("sparse_attention.")[0] for name in selector}:  # every layer's selector learns
            layer_grads = [checkpointed[name] for name in selector if name.startswith(prefix)]
            assert sum(float(g.abs().sum()) for g in layer_grads) > 0, f"step {step}: {prefix}"
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-10, atol=1e-12, msg=f"step {step}: {name}")
    stats = st.collect_attention_stats(models[1][0])
    assert stats["replay/hits"] == 4.0 and stats["replay/misses"] == 0.0, stats


def _all_grads(reentrant, distill, dropout_p, warmup):
    """Input and selector gradients of one step (selector loss included, through ``collect_selector_losses`` as
    a training loop adds it): plain (``reentrant`` None) or checkpointed, reentrant or not. Also the module."""
    module = make(distill=distill, dropout_p=dropout_p, dense_warmup_steps=warmup, distill_query_blocks=2)
    q, k, v, w = inputs()
    torch.manual_seed(123)  # the dropout seed draw reads the global generator
    run = layer(module)
    out = run(q, k, v) if reentrant is None else checkpoint(run, q, k, v, use_reentrant=reentrant)
    ((out * w).sum() + st.collect_selector_losses(module)).backward()
    selector = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.scorer.parameters()]
    return [t.grad for t in (q, k, v)] + selector, module


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("warmup", [0, 1, 5], ids=["sparse-path", "last-dense-warmup-step", "dense-warmup-path"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("distill", ["off", "sparse", "sampled", "dense"])
def test_checkpointed_gradients_equal_plain_for_every_distill_mode(distill, dropout_p, warmup, reentrant):
    """Every random draw of the forward (dropout seed, the sampled distillation query blocks) and its path
    (the last warm-up step is dense, while the recompute runs after the step count has passed the warm-up)
    are replayed by the checkpoint recompute: gradients of inputs and selector equal the plain run's. Under
    reentrant checkpointing the first forward runs under torch.no_grad; the selector still gets its loss."""
    plain, _ = _all_grads(None, distill, dropout_p, warmup)
    checkpointed, module = _all_grads(reentrant, distill, dropout_p, warmup)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    if distill != "off":
        assert any(g.abs().sum() > 0 for g in plain[3:]), "the selector must receive a gradient"
    assert module.stats()["replay/hits"] == 1.0 and module.stats()["replay/misses"] == 0.0


@pytest.mark.parametrize("distill", ["sampled", "dense", "sparse"])
def test_recompute_reuses_the_first_forwards_distillation_target(distill, monkeypatch):
    """The target is detached and a function of the same q and k: the checkpoint recompute takes the first
    forward's instead of running the block-mass computation again (once per step, not twice), and the
    gradients still equal the plain run's (``test_checkpointed_gradients_equal_plain_for_every_distill_mode``)."""
    import sparse_train.module.attention as attention_module

    calls = []
    for name in ("dense_block_mass", "sparse_block_mass"):
        original = getattr(attention_module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention_module, name, counted)
    module = make(distill=distill, selector="pooled")  # the block-mass targets (the token KL's: below)
    q, k, v, w = inputs()
    out = checkpoint(layer(module), q, k, v, use_reentrant=False)
    ((out * w).sum() + module.selector_loss).backward()
    assert module.stats()["replay/hits"] == 1
    assert calls == ["sparse_block_mass" if distill == "sparse" else "dense_block_mass"]


@pytest.mark.parametrize("distill", ["sampled", "off"])
def test_recompute_reuses_the_first_forwards_pooled_inputs(distill, monkeypatch):
    """The selector's pooled inputs come from detached q and k: a distilling recompute scores from the first
    forward's instead of pooling again (one pooling per step), and a record that will not distill keeps none.
    Gradients equal the plain run's (``test_checkpointed_gradients_equal_plain_for_every_distill_mode``)."""
    module = make(distill=distill)
    calls = []
    original = module.scorer.pool

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module.scorer, "pool", counted)
    q, k, v, w = inputs()
    out = checkpoint(layer(module), q, k, v, use_reentrant=False)
    (record,) = module._replay.live_records()
    assert (record.pooled is not None) == (distill != "off")
    loss = (out * w).sum() + (module.selector_loss if module.selector_loss is not None else 0)
    loss.backward()
    assert module.stats()["replay/hits"] == 1
    assert len(calls) == 1, calls


@pytest.mark.parametrize("selector_distill", ["block", "token"])
def test_token_selector_recompute_scores_only_what_its_loss_needs(selector_distill):
    """The token selector's sampled distillation scores its few query blocks apart: a checkpoint recompute, which
    replays the selection, scores no other block (the full scores only serve a selection), its record keeps the
    indexer's queries of those blocks only, and its gradients (inputs and selector) equal the plain run's."""
    grads = {}
    for checkpointed in (False, True):
        module = make(
            selector="token",
            selector_distill=selector_distill,
            selector_candidates=None,
            distill="sampled",
            distill_query_blocks=2,
        )
        calls = []
        original = type(module.scorer).forward

        def counted(self, *args, _original=original, **kwargs):
            calls.append(torch.is_grad_enabled())
            return _original(self, *args, **kwargs)

        q, k, v, w = inputs()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(module.scorer), "forward", counted)
            run = layer(module)
            out = checkpoint(run, q, k, v, use_reentrant=False) if checkpointed else run(q, k, v)
            first = len(calls)
            if checkpointed:  # the record keeps the indexer's queries of the two sampled blocks, not of all N rows
                (record,) = module._replay.live_records()
                assert record.pooled[0] is None and record.distill_queries.shape == (1, HQ, 2 * 16, D)
            ((out * w).sum() + module.selector_loss).backward()
        selector = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.scorer.parameters()]
        grads[checkpointed] = [t.grad for t in (q, k, v)] + selector
        if checkpointed:
            assert module.stats()["replay/hits"] == 1
            # first forward: every block without gradients (the selection), and with block-level KL the sampled
            # blocks with them; the recompute: the sampled blocks again only where the loss needs their graph
            assert calls[:first] == ([False, True] if selector_distill == "block" else [False]), calls
            assert calls[first:] == ([True] if selector_distill == "block" else []), calls
    assert any(g.abs().sum() > 0 for g in grads[False][3:]), "the selector must receive a gradient"
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_token_level_distillation_recompute_reuses_the_kernels_forward(monkeypatch):
    """selector_distill="token" on CUDA (bf16, the streaming kernels): the checkpoint recompute passes back the
    first forward's statistics, so the kernels' forward runs once per step, not twice, and the gradients (inputs
    and selector) equal the plain run's up to the order of the backward's atomic additions."""
    calls = []
    original = token_kl_kernels.token_kl_forward_launch

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(token_kl_kernels, "token_kl_forward_launch", counted)
    grads = {}
    for checkpointed in (False, True):
        calls.clear()
        module = make(
            selector="token",
            selector_distill="token",
            selector_candidates=None,
            distill="sampled",
            distill_query_blocks=3,
        ).cuda()
        q, k, v, w = (t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in inputs())
        run = layer(module)
        out = checkpoint(run, q, k, v, use_reentrant=False) if checkpointed else run(q, k, v)
        ((out.float() * w.float()).sum() + module.selector_loss).backward()
        grads[checkpointed] = [t.grad for t in (q, k, v)] + [p.grad for p in module.scorer.parameters()]
        assert calls == [1], calls
    # trained by the token-level KL alone, the selector has no distance bias (that loss never reads it): three
    # parameters, each with a gradient in both runs
    assert module.scorer.distance_bias is None
    assert [g is None for g in grads[True]] == [g is None for g in grads[False]] == [False] * 6
    assert all(g.abs().sum() > 0 for g in grads[False][3:6]), "the selector must receive a gradient"
    for a, b in zip(grads[False][:3], grads[True][:3]):  # bf16: torch's bf16 tolerances
        torch.testing.assert_close(b, a)
    for a, b in zip(grads[False][3:6], grads[True][3:6]):  # float32 parameters
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_scoring_listed_query_blocks_equals_the_rows_of_every_blocks_scores():
    """Scoring only some query blocks (``BlockScorer(..., query_blocks=rows)``, what a context-parallel rank
    does with its own blocks): values and parameter gradients, distance bias included, equal those of scoring
    every block and taking the rows. The scorer computes in
    float32 whatever its inputs (its matmuls of 4 rows and of every row may sum in another order), hence a
    float32 tolerance: 1e-6 relative is that rounding, a wrong row or bucket would differ by O(1)."""
    module = make(selector="pooled", distill="sampled", selector_distance_bias=True, query_pooling="mean_max")
    with torch.no_grad():
        for p in module.scorer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    q, k, _, _ = inputs()
    geometry = selection_geometry(N, 16, 16, 2, 1, 1)
    qbar, kbar = module.scorer.pool(q, k, 16, 16)
    rows = torch.tensor([7, 2, 9, 0])
    weight = torch.randn(1, HKV, rows.numel(), kbar.shape[2], dtype=torch.float64)

    def value_and_grads(scores):
        module.scorer.zero_grad(set_to_none=True)
        (scores * weight).sum().backward()
        return [scores.detach()] + [p.grad.clone() for p in module.scorer.parameters()]

    listed = value_and_grads(module.scorer(qbar.index_select(2, rows), kbar, 0.25, geometry, query_blocks=rows))
    every = value_and_grads(module.scorer(qbar, kbar, 0.25, geometry).index_select(2, rows))
    assert listed[-1].abs().sum() > 0, "the distance bias must receive a gradient"
    for a, b in zip(listed, every):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
