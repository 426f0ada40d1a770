"""SparseAttention module: config validation, input errors, the sparse path against the reference,
fallbacks (full selection -> SDPA, CPU -> reference) with counted reasons, hysteresis, padding,
stats/profiling and the collect helpers. GPU-only: torch.compile of the module."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from builders import make_qkv

import sparse_train as st
from sparse_train.functional import dense_causal_attention
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.module.attention import FALLBACK_REASONS
from sparse_train.selection import selection_geometry

HQ, HKV, D = 4, 2, 16


def make(**overrides):
    base = dict(block_q=16, block_k=16, top_k=2, window=2, sinks=1, selector_dim=8, dense_warmup_steps=0)
    base.update(overrides)
    return st.SparseAttention(st.SparseAttentionConfig(**base), num_heads=HQ, num_kv_heads=HKV, head_dim=D)


def qkv(batch, n, dtype=torch.float32, seed=0, grad=False):
    return make_qkv(batch, HQ, HKV, n, D, dtype=dtype, seed=seed, requires_grad=grad)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "field,value",
    [
        pytest.param("block_q", 0, id="block_q-zero"),
        pytest.param("top_k", -1, id="top_k-negative"),
        pytest.param("selector_dim", 2.5, id="selector_dim-float"),
        pytest.param("backend", "cuda", id="backend-unknown"),
        pytest.param("distill", "both", id="distill-unknown"),
        pytest.param("dropout_p", 1.0, id="dropout-one"),
        pytest.param("dense_exit_density", 0.95, id="exit-above-enter"),
        pytest.param("distill_query_rows", 100, id="rows-above-block"),
        pytest.param("replay", "yes", id="replay-not-bool"),
        pytest.param("index_check", "some", id="index-check-unknown"),
    ],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        st.SparseAttentionConfig(**{field: value})


def test_config_rejects_empty_selection_and_documents_fields():
    with pytest.raises(ValueError, match="top_k \\+ window \\+ sinks"):
        st.SparseAttentionConfig(top_k=0, window=0, sinks=0)
    source = open(st.config.__file__ if hasattr(st, "config") else "sparse_train/config.py").read()
    for name in st.SparseAttentionConfig.__dataclass_fields__:
        assert f"    {name}:" in source
        block = source.split(f"    {name}:", 1)[1].split("\n", 2)
        assert block[1].strip().startswith('"""'), f"field {name} has no docstring"


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "mutate,message",
    [
        pytest.param(lambda q, k, v: (q[:, :3], k, v), "num_heads", id="wrong-query-heads"),
        pytest.param(lambda q, k, v: (q, k[:, :1], v[:, :1]), "HKV", id="wrong-kv-heads"),
        pytest.param(lambda q, k, v: (q, k, v[..., :8]), "same shape", id="k-v-mismatch"),
        pytest.param(lambda q, k, v: (q.double(), k, v), "dtype", id="mixed-dtypes"),
        pytest.param(lambda q, k, v: (q.int(), k.int(), v.int()), "dtype", id="integer-dtype"),
        pytest.param(lambda q, k, v: (q[0], k[0], v[0]), "4-D", id="three-dims"),
        pytest.param(lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), "head dim", id="wrong-head-dim"),
    ],
)
def test_bad_inputs_raise(mutate, message):
    attn = make()
    with pytest.raises(ValueError, match=message):
        attn(*mutate(*qkv(1, 40)))


@pytest.mark.parametrize(
    "seq_lens,message",
    [
        pytest.param(torch.tensor([10.0, 3.0]), "integer", id="float-lengths"),
        pytest.param(torch.tensor([10]), "entries", id="wrong-batch"),
        pytest.param(torch.tensor([41, 3]), "lie in", id="too-long"),
    ],
)
@pytest.mark.parametrize("n", [40, 150], ids=["dense-path", "sparse-path"])
def test_bad_seq_lens_raise(seq_lens, message, n):
    if message == "lie in":
        seq_lens = torch.tensor([n + 1, 3])
    with pytest.raises(ValueError, match=message):
        make()(*qkv(2, n), seq_lens=seq_lens)


@pytest.mark.parametrize(
    "override,message",
    [
        pytest.param({"scale": float("nan")}, "scale must be a finite number > 0, got nan", id="scale-nan"),
        pytest.param({"scale": -1.0}, "scale must be a finite number > 0, got -1.0", id="scale-negative"),
        pytest.param({"dropout_p": float("nan")}, r"dropout_p must lie in \[0, 1\)", id="dropout-nan"),
        pytest.param({"dropout_p": 1.0}, r"dropout_p must lie in \[0, 1\)", id="dropout-one"),
        pytest.param({"dropout_p": -0.5}, r"dropout_p must lie in \[0, 1\)", id="dropout-negative"),
    ],
)
def test_per_call_overrides_are_validated(override, message):
    """The Hugging Face integration passes the model's own scale and dropout per call: a bad value is
    an error naming it, not a NaN output or an unrelated SDPA message."""
    with pytest.raises(ValueError, match=message):
        make()(*qkv(1, 150), **override)


def test_constructor_rejects_bad_heads():
    with pytest.raises(ValueError, match="multiple"):
        st.SparseAttention(st.SparseAttentionConfig(), num_heads=6, num_kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="SparseAttentionConfig"):
        st.SparseAttention({"top_k": 2}, num_heads=4, num_kv_heads=2, head_dim=16)


# ---------------------------------------------------------------------------------------------- paths
def test_sparse_path_equals_reference_on_its_own_index():
    attn = make(dense_fallback=False, distill="off")
    q, k, v = qkv(2, 150, dtype=torch.float64, grad=True)
    out = attn(q, k, v)
    index = attn._last_index
    assert not index.is_full() and attn.stats()["dense_path"] == 0.0
    ref, _ = reference_sparse_attention(q, k, v, index, scale=attn.scale)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_fused_and_stored_ds_backward_configs_reach_the_kernels(monkeypatch):
    """``kernel_options.fused_dq`` (Triton interpreter): the dQ kernel does not run; ``kernel_options.stored_ds``: the
    dQ pass reads stored dS (``_dq_from_ds_kernel``); in both the output, the selector loss and the q/k/v
    gradients equal the two-kernel backward's (the same index; dQ summed in another order)."""
    from sparse_train.kernels.triton import backward as kb

    launched = []
    real_launch = kb.launch
    monkeypatch.setattr(kb, "launch", lambda kernel, *a, **kw: launched.append(kernel) or real_launch(kernel, *a, **kw))
    results = []
    for mode, dq_kernel in (
        ({}, kb._dq_kernel),
        ({"kernel_options": {"fused_dq": True}}, None),
        ({"kernel_options": st.KernelOptions(stored_ds=True)}, kb._dq_from_ds_kernel),
    ):
        attn = make(backend="triton", dense_fallback=False, distill="sampled", **mode)
        attn.load_state_dict(make().state_dict())
        torch.manual_seed(3)
        q, k, v = qkv(2, 83, grad=True)
        launched.clear()
        out = attn(q, k, v)
        (out.square().sum() + attn.selector_loss).backward()
        assert kb._dkdv_kernel in launched
        assert {kb._dq_kernel, kb._dq_from_ds_kernel} & set(launched) == ({dq_kernel} if dq_kernel else set())
        results.append((out.detach(), attn.selector_loss.detach(), q.grad, k.grad, v.grad))
    for other in results[1:]:
        for name, got, want in zip(("out", "selector_loss", "dq", "dk", "dv"), other, results[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("gluon,expected", [(None, 0), (False, 0), (True, 1)], ids=["default", "off", "on"])
def test_gluon_kernel_options_reach_the_launch_schedule(monkeypatch, gluon, expected):
    """``kernel_options`` ``fwd_gluon`` / ``dq_gluon`` / ``kv_gluon`` set the launch schedule's Gluon switches
    (None: each kernel's default, which on
    this CPU is off); where the Gluon kernels do not apply (here: no Hopper GPU) the Triton kernels run and the
    output is the same."""
    from sparse_train.kernels.triton import op

    schedules = []
    real_schedule = op.attention_schedule
    monkeypatch.setattr(
        op, "attention_schedule", lambda *a, **kw: schedules.append(real_schedule(*a, **kw)) or schedules[-1]
    )
    options = {"fwd_gluon": gluon, "dq_gluon": gluon, "kv_gluon": gluon}
    attn = make(backend="triton", dense_fallback=False, kernel_options=options)
    attn.load_state_dict(make().state_dict())
    torch.manual_seed(3)
    q, k, v = qkv(2, 83)
    out = attn(q, k, v)
    assert len(schedules) == 1
    schedule = schedules[0]
    assert (schedule.forward.gluon, schedule.backward.dq_gluon, schedule.backward.kv_gluon) == (expected,) * 3
    reference = make(backend="triton", dense_fallback=False)
    reference.load_state_dict(make().state_dict())
    torch.testing.assert_close(out, reference(q, k, v), rtol=0, atol=0)


def test_gluon_kernel_options_take_a_bool_or_none():
    assert st.SparseAttentionConfig(kernel_options={"kv_gluon": None}).kernel_options.kv_gluon is None
    with pytest.raises(ValueError, match="SparseAttentionConfig: kernel_options.kv_gluon"):
        st.SparseAttentionConfig(kernel_options={"kv_gluon": "yes"})


@pytest.mark.parametrize("n", [30, 64, 80], ids=["n30", "n64", "n80"])
def test_full_selection_takes_sdpa_and_equals_sparse_reference(n):
    attn = make()  # capacity 5 blocks of 16 -> N <= 80 is a full selection
    assert selection_geometry(n, 16, 16, 2, 2, 1).is_full
    q, k, v = qkv(2, n, dtype=torch.float64)
    out = attn(q, k, v)
    assert attn.fallback_counts == {"dense_full_selection": 1}
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, sdpa)
    full = st.BlockIndex.full(2, HKV, n, 16, 16)
    ref, _ = reference_sparse_attention(q, k, v, full)
    torch.testing.assert_close(out, ref)


def test_cpu_reference_fallback_is_counted_and_explicit_reference_is_not():
    auto = make(distill="off")
    auto(*qkv(1, 200))
    assert auto.fallback_counts == {"reference_cpu": 1}
    explicit = make(distill="off", backend="reference")
    explicit(*qkv(1, 200))
    assert explicit.fallback_counts == {}


def test_hysteresis_keeps_the_path_between_thresholds():
    attn = make(dense_enter_density=0.9, dense_exit_density=0.75, distill="off")
    lengths = [128, 80, 128, 112, 160, 128, 96]
    expected = ["sparse", "dense", "dense", "dense", "sparse", "sparse", "dense"]
    densities = [selection_geometry(n, 16, 16, 2, 2, 1).block_density for n in lengths]
    # the lengths sit where the test needs them: inside the band, full, below exit, above enter
    assert 0.75 < densities[0] < 0.9 and densities[1] == 1.0 and densities[4] <= 0.75 and densities[6] >= 0.9
    paths = []
    for n in lengths:
        attn(*qkv(1, n))
        paths.append("dense" if attn.stats()["dense_path"] else "sparse")
    assert paths == expected
    counts = attn.fallback_counts
    assert counts["dense_full_selection"] == 1 and counts["dense_hysteresis"] == 3
    no_band = make(dense_enter_density=1.0, dense_exit_density=1.0, distill="off")
    for n in lengths:
        no_band(*qkv(1, n))
    assert no_band.fallback_counts.get("dense_hysteresis", 0) == 0


@pytest.mark.parametrize("n_pad", [130, 60], ids=["sparse-path", "dense-path"])
def test_padded_rows_equal_unpadded_sequences(n_pad):
    # thresholds at 1.0: only full selections go dense, so padded and unpadded lengths take the same
    # path (inside the hysteresis band, a shorter unpadded length could legitimately run dense)
    attn = make(distill="off", dense_enter_density=1.0, dense_exit_density=1.0)
    lengths = [n_pad, n_pad - 37]
    q, k, v = qkv(2, n_pad, dtype=torch.float64)
    out = attn(q, k, v, seq_lens=torch.tensor(lengths))
    for b, length in enumerate(lengths):
        alone = attn(q[b : b + 1, :, :length], k[b : b + 1, :, :length], v[b : b + 1, :, :length])
        torch.testing.assert_close(out[b : b + 1, :, :length], alone)


def test_padded_index_matches_unpadded_selection():
    """Pooling ignores padding rows, so the selection of the real query blocks is unchanged."""
    attn = make(distill="off", dense_fallback=False)
    q, k, v = qkv(2, 160, dtype=torch.float64)
    attn(q, k, v, seq_lens=torch.tensor([160, 100]))
    padded = attn._last_index.indices[1:2, :, :7]
    attn(q[1:2, :, :100], k[1:2, :, :100], v[1:2, :, :100])
    alone = attn._last_index.indices[..., :7]
    width = min(padded.shape[-1], alone.shape[-1])
    assert torch.equal(padded[..., :width], alone[..., :width])


@pytest.mark.parametrize("n", [150, 50], ids=["sparse-path", "dense-path"])
def test_empty_rows_give_zeros_without_nan(n):
    attn = make()
    q, k, v = qkv(2, n, grad=True)
    out = attn(q, k, v, seq_lens=torch.tensor([0, n]))
    assert torch.isfinite(out).all()
    assert out[0].abs().sum() == 0
    (out.sum() + attn.selector_loss).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(attn.scorer.query_proj.grad).all()


def test_dense_helper_with_lengths_matches_reference():
    q, k, v = qkv(2, 45, dtype=torch.float64)
    lengths = torch.tensor([45, 20])
    got = dense_causal_attention(q, k, v, scale=0.3, seq_lens=lengths)
    ref, _ = reference_sparse_attention(q, k, v, st.BlockIndex.full(2, HKV, 45, 16, 16), scale=0.3, seq_lens=lengths)
    torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------------------------------------- training signals
def test_selector_loss_only_trains_the_selector():
    attn = make(dense_fallback=False)
    q, k, v = qkv(1, 150, grad=True)
    attn(q, k, v)
    loss = attn.selector_loss
    assert loss is not None and loss.dim() == 0 and loss.requires_grad
    loss.backward()
    assert q.grad is None and k.grad is None and v.grad is None
    assert attn.scorer.query_proj.grad.abs().sum() > 0
    attn.eval()
    attn(q, k, v)
    assert attn.selector_loss is None


def test_distill_every_and_off():
    attn = make(distill_every=2)
    seen = []
    for _ in range(4):
        attn(*qkv(1, 150))
        seen.append(attn.selector_loss is not None)
    assert seen == [True, False, True, False]
    off = make(distill="off")
    off(*qkv(1, 150))
    assert off.selector_loss is None


def test_dense_distill_mode_targets_all_causal_blocks():
    attn = make(distill="dense", dense_fallback=False)
    attn(*qkv(1, 150))
    sparse_mode = make(distill="sparse", dense_fallback=False)
    sparse_mode.load_state_dict(attn.state_dict())
    sparse_mode(*qkv(1, 150))
    assert float(attn.selector_loss.detach()) > 0 and float(sparse_mode.selector_loss.detach()) > 0
    assert float(attn.selector_loss.detach()) != pytest.approx(float(sparse_mode.selector_loss.detach()))


def test_sampled_distill_covering_every_block_equals_dense():
    q, k, v = qkv(1, 150, grad=True)
    # the block-level KL's target (the pooled selector's; the token selector's sampled loss is per row)
    dense = make(selector="pooled", distill="dense", dense_fallback=False)
    sampled = make(selector="pooled", distill="sampled", distill_query_blocks=64, dense_fallback=False)
    sampled.load_state_dict(dense.state_dict())
    dense(q, k, v)
    sampled(q, k, v)
    torch.testing.assert_close(sampled.selector_loss, dense.selector_loss)
    few = make(selector="pooled", distill="sampled", distill_query_blocks=2, dense_fallback=False)
    few(q, k, v)
    few.selector_loss.backward()
    assert torch.isfinite(few.selector_loss) and q.grad is None
    assert few.scorer.query_proj.grad.abs().sum() > 0


def test_profile_reports_the_checkpoint_recompute_apart():
    """Under activation checkpointing the recomputed forward is timed as phases of its own
    (``time/attn_fwd_recompute_ms``), so the first forward's times stay what they were and the recompute's cost is
    visible; the backward is timed once (its gradient flows through the first forward's graph)."""
    attn = make(profile=True)
    q, k, v = qkv(1, 150, grad=True)
    out = torch.utils.checkpoint.checkpoint(attn, q, k, v, use_reentrant=False)
    out.sum().backward()
    stats = attn.stats()
    for key in (
        "time/selector_ms",
        "time/plan_ms",
        "time/attn_fwd_ms",
        "time/attn_bwd_ms",
        "time/selector_recompute_ms",
        "time/plan_recompute_ms",
        "time/attn_fwd_recompute_ms",
    ):
        assert key in stats and math.isfinite(stats[key]) and stats[key] >= 0, key
    assert "time/attn_bwd_recompute_ms" not in stats
    plain = make(profile=True)
    plain(q, k, v).sum().backward()
    assert not any(key.endswith("_recompute_ms") for key in plain.stats())


def test_stats_metrics_profile_and_collect():
    model = torch.nn.ModuleDict({"a": make(metrics_every=1, profile=True), "b": make(metrics_every=1, profile=True)})
    q, k, v = qkv(1, 150, grad=True)
    out = model["a"](q, k, v) + model["b"](q, k, v)
    total = st.collect_selector_losses(model)
    torch.testing.assert_close(total, model["a"].selector_loss + model["b"].selector_loss)
    (out.sum() + total).backward()
    stats = model["a"].stats()
    for key in (
        "density",
        "selector_loss",
        "mass_recall_mean",
        "mass_recall_p5",
        "time/selector_ms",
        "time/plan_ms",
        "time/attn_fwd_ms",
        "time/attn_bwd_ms",
    ):
        assert key in stats and math.isfinite(stats[key]), key
    assert 0.0 < stats["mass_recall_p5"] <= stats["mass_recall_mean"] <= 1.0 + 1e-6
    assert 0.0 < stats["density"] < 1.0
    assert stats["time/attn_bwd_ms"] > 0 and stats["time/attn_fwd_ms"] > 0
    for reason in FALLBACK_REASONS:
        assert f"fallbacks/{reason}" in stats
    merged = st.collect_attention_stats(model)
    assert merged["fallbacks/reference_cpu"] == 2.0
    for layer, name in enumerate(("a", "b")):
        assert merged[f"layers/{layer}/mass_recall_p5"] == model[name].stats()["mass_recall_p5"]
    assert merged["mass_recall_mean"] == pytest.approx(
        (stats["mass_recall_mean"] + model["b"].stats()["mass_recall_mean"]) / 2
    )
    assert merged["selector_loss"] == pytest.approx((stats["selector_loss"] + model["b"].stats()["selector_loss"]) / 2)
    empty = st.collect_selector_losses(torch.nn.Linear(2, 2))
    assert empty.item() == 0.0
    model["a"].reset_stats()
    assert model["a"].fallback_counts == {}


def test_state_dict_holds_the_selector_and_the_resume_state():
    keys = {
        "scorer.query_proj",
        "scorer.key_proj",
        "scorer.log_temperature",
        "scorer.distance_bias",
        "scorer.lr_multiplier",
        "selector_steps",
        "distill_draws",
        "dense_mode",
        "dropout_base",
        "dropout_draws",
    }
    assert set(make(selector="pooled").state_dict()) == keys
    # the default token selector trained by the token-level KL: no distance bias (that loss never reads it)
    assert set(make().state_dict()) == keys - {"scorer.distance_bias"}


def test_every_backend_reason_is_a_counted_fallback():
    """resolve_backend's codes are the fallback keys: a reference run is counted under its code."""
    for code in st.functional.BACKEND_REASONS:
        if code not in ("requested", "supported"):
            assert f"reference_{code}" in FALLBACK_REASONS
    module = make(dense_fallback=False)
    module(*qkv(1, 150))
    assert module.fallback_counts == {"reference_cpu": 1}


def test_input_checks_trace_without_graph_breaks():
    """The module's input checks (shared validators, per-call overrides) are shape/Python-level:
    dynamo traces the dense path in one graph (backend "eager": tracing only, no compiler needed)."""
    torch._dynamo.reset()
    module = make(distill="off", block_q=16, block_k=16)
    q, k, v = qkv(2, 48)
    lens = torch.tensor([48, 30])
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, seq_lens=lens, scale=0.3), module(q, k, v, seq_lens=lens, scale=0.3))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 256], ids=["sparse-path", "dense-path"])
def test_compiled_module_matches_eager_on_gpu(n):
    """torch.compile(fullgraph=True) of the module (training step, bf16), on the sparse and the dense path
    (the plan has shape-fixed arrays and no host reads, so the sparse path has no graph break)."""
    torch._dynamo.reset()
    device = torch.device("cuda")
    # the default selector with candidate blocks (the default from CANDIDATES_MIN_SEQ_LEN tokens up; exact scores
    # below, compiled in tests/test_compile.py): compiled and eager run the same kernels (custom ops)
    cfg = st.SparseAttentionConfig(
        top_k=8, window=4, sinks=1, distill="off", dense_warmup_steps=0, selector_candidates=16
    )
    eager = st.SparseAttention(cfg, num_heads=8, num_kv_heads=2, head_dim=64).to(device)
    compiled_mod = st.SparseAttention(cfg, num_heads=8, num_kv_heads=2, head_dim=64).to(device)
    compiled_mod.load_state_dict(eager.state_dict())
    dense = selection_geometry(n, 64, 64, 8, 4, 1).is_full
    compiled = torch.compile(compiled_mod, fullgraph=True)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 8, n, 64, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, n, 64, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, n, 64, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    ref = eager(q, k, v)
    (ref.float().square().sum()).backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = compiled(q, k, v)
    out.float().square().sum().backward()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    expected = {"dense_full_selection": 1} if dense else {}
    assert eager.fallback_counts == expected
    assert compiled_mod.fallback_counts == expected, "fallback counting must work inside the compiled graph"


# ------------------------------------------------------------------------------------ padding garbage
def _poison_padding(t, seq_lens, value):
    t = t.detach().clone()
    for b, length in enumerate(seq_lens.tolist()):
        t[b, :, length:] = value
    return t


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30], ids=["nan", "inf", "huge"])
@pytest.mark.parametrize(
    "n,distill",
    [(48, "sampled"), (150, "sampled"), (150, "sparse"), (150, "dense")],
    ids=["dense-path", "sparse-sampled", "sparse-sparse", "sparse-dense"],
)
def test_garbage_past_seq_lens_never_reaches_outputs_gradients_or_selector_loss(n, distill, value):
    """Whatever sits past seq_lens (NaN, inf, huge) changes nothing: valid outputs, input gradients
    and the selector loss equal those of a run with clean (zero) padding."""
    seq_lens = torch.tensor([n, n - 37])
    clean = qkv(2, n, dtype=torch.float64)
    clean = [_poison_padding(t, seq_lens, 0.0) for t in clean]
    dirty = [_poison_padding(t, seq_lens, value) for t in clean]

    def run(tensors):
        torch.manual_seed(0)
        module = make(distill=distill, distill_query_blocks=3).double()
        q, k, v = [t.clone().requires_grad_(True) for t in tensors]
        o = module(q, k, v, seq_lens=seq_lens)
        valid = torch.arange(n).view(1, 1, n, 1) < seq_lens.view(-1, 1, 1, 1)
        (torch.where(valid, o, 0.0).sum() + module.selector_loss).backward()
        return torch.where(valid, o, 0.0), module.selector_loss, [torch.where(valid, t.grad, 0.0) for t in (q, k, v)]

    o_clean, loss_clean, grads_clean = run(clean)
    o_dirty, loss_dirty, grads_dirty = run(dirty)
    assert torch.isfinite(loss_dirty) and torch.isfinite(o_dirty).all()
    torch.testing.assert_close(o_dirty, o_clean)
    torch.testing.assert_close(loss_dirty, loss_clean)
    for a, b in zip(grads_dirty, grads_clean):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("distill", ["sampled", "sparse", "dense"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [48, 150], ids=["dense-path", "sparse-path"])
def test_batch_of_zero_sequences(n, training, distill):
    module = make(metrics_every=1, distill=distill).train(training)
    q, k, v = qkv(0, n, grad=True)
    o = module(q, k, v)
    assert o.shape == (0, HQ, n, D)
    loss = o.sum() + st.collect_selector_losses(module)
    loss.backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "after-a-training-step"])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_inference_mode_equals_no_grad(trained, mode):
    """Under torch.inference_mode (inference tensors: no version counters, nothing saved for a backward) the
    module gives the no_grad output, with inputs made outside and inside inference mode, and decodes."""
    module = make(dense_fallback=False, metrics_every=1)
    q, k, v = qkv(2, 150)
    seq_lens = torch.tensor([150, 101])
    docs = (torch.arange(150) >= 70).long().view(1, -1).expand(2, -1)
    if trained:
        module.train()
        q_grad = q.clone().requires_grad_()
        (module(q_grad, k, v, seq_lens, document_ids=docs).sum() + module.selector_loss).backward()
    module.train(mode == "train")
    with torch.no_grad():
        want = module(q, k, v, seq_lens, document_ids=docs)
        want_decode = module.decode(q[:, :, -3:], k, v)
    with torch.inference_mode():
        outside = module(q, k, v, seq_lens, document_ids=docs)
        made_inside = [t.clone() for t in (q, k, v, seq_lens, docs)]
        inside = module(*made_inside[:4], document_ids=made_inside[4])
        again = module(*made_inside[:4], document_ids=made_inside[4])
        decoded = module.decode(made_inside[0][:, :, -3:], made_inside[1], made_inside[2])
    for got in (outside, inside, again):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(decoded, want_decode, rtol=0, atol=0)
    assert module.stats()["dense_path"] == 0.0


@pytest.mark.parametrize("num_queries", [1, 5], ids=["one-token", "chunk-of-5"])
@pytest.mark.parametrize("with_padding", [False, True], ids=["no-padding", "key-padding"])
def test_decode_is_end_aligned_causal_attention(num_queries, with_padding):
    module = make()
    num_keys = 37
    q, _, _ = make_qkv(2, HQ, HKV, num_queries, D, dtype=torch.float64, seed=3)
    _, k, v = make_qkv(2, HQ, HKV, num_keys, D, dtype=torch.float64, seed=4)
    keep = torch.ones(2, num_keys, dtype=torch.bool)
    if with_padding:
        keep[1, :6] = False  # left padding of the second row
    got = module.decode(q, k, v, key_padding_mask=keep if with_padding else None, scale=0.3)
    group = HQ // HKV
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(group, 1)) * 0.3
    query_pos = torch.arange(num_keys - num_queries, num_keys).view(-1, 1)
    allowed = (torch.arange(num_keys).view(1, -1) <= query_pos) & keep.view(2, 1, 1, num_keys)
    want = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(group, 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert module.fallback_counts == {"decode": 1}


def test_decode_rejects_bad_shapes_and_empty_rows():
    module = make()
    q, k, v = make_qkv(1, HQ, HKV, 4, D)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        module.decode(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match=r"k and v must both be \[B, HKV, Nk, D\]"):
        module.decode(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        module.decode(q, k, v, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no real key"):
        module.decode(q, k, v, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "gpu"])
def test_dense_path_dropout_uses_the_counter_bits_of_the_sparse_path(device):
    """A full selection with dropout: the dense path (fallback) and the sparse path (fallback off)
    drop the same probabilities, so outputs and gradients are bitwise equal for one seed (float64
    reference on CPU; bf16 Triton kernels, deterministic backward, on the GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the H200 with -m gpu)")
    n = 48  # 3 query blocks: top_k 2 + window 2 + sink covers every causal block
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    results = []
    for dense_fallback in (True, False):
        module = make(dropout_p=0.3, dense_fallback=dense_fallback, deterministic=True).to(device).train()
        q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in qkv(2, n, dtype=torch.float64, seed=9))
        torch.manual_seed(1234)  # the dropout seed is drawn from the global generator
        out = module(q, k, v)
        out.square().sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, module.fallback_counts))
    (dense_out, *dense_grads, dense_counts), (sparse_out, *sparse_grads, sparse_counts) = results
    assert dense_counts == {"dense_full_selection": 1}
    assert sparse_counts == ({"reference_cpu": 1} if device == "cpu" else {})
    assert torch.equal(dense_out, sparse_out)
    for a, b in zip(dense_grads, sparse_grads):
        assert torch.equal(a, b)
    module = make(dropout_p=0.3).to(device).eval()
    q, k, v = (t.to(device, dtype) for t in qkv(2, n, dtype=torch.float64, seed=9))
    assert not torch.equal(module(q, k, v), dense_out)  # dropout did act in training mode


def test_autocast_casts_q_k_v_to_the_autocast_dtype():
    """A model whose RoPE runs in fp32 hands fp32 q and k beside a bf16 v under bf16 autocast (the Hugging
    Face Llama under Lightning's bf16-mixed did): the layer computes in the autocast dtype, as SDPA
    does, and gives what it gives on bf16 inputs; without autocast mixed dtypes still raise."""
    torch.manual_seed(0)
    cfg = st.SparseAttentionConfig(
        block_q=16, block_k=16, top_k=2, window=1, sinks=1, dense_warmup_steps=0, backend="reference"
    )
    layer = st.SparseAttention(cfg, num_heads=4, num_kv_heads=2, head_dim=16).eval()
    q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(q, k, v)
    want = layer(q.bfloat16(), k.bfloat16(), v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="must share a dtype"):
        layer(q, k, v)
    for bad in ((q.tolist(), k, v), (q, "k", v)):  # bad input is still named, under autocast too
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="must be a 4-D tensor"):
            layer(*bad)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "overrides,masks",
    [
        pytest.param({"dense_fallback": False}, {}, id="sparse-path"),
        pytest.param({}, {}, id="dense-fallback"),
        pytest.param(
            {"dense_fallback": False, "selector": "token", "selector_distill": "token", "selector_candidates": None},
            {},
            id="token-selector",
        ),
        pytest.param(
            {"dense_fallback": False, "distill": "sparse"},
            {"document_ids": torch.zeros(0, 64, dtype=torch.int64)},
            id="documents-sparse-distill",
        ),
        pytest.param(
            {"dense_fallback": False, "top_p": 0.5},
            {"seq_lens": torch.zeros(0, dtype=torch.int64)},
            id="seq_lens-top_p",
        ),
    ],
)
def test_empty_batch_gives_empty_outputs_and_gradients(backend, overrides, masks):
    """B = 0 in training: an empty output and empty gradients, on both backends (the Triton interpreter on the
    CPU), the selector, its distillation and the metrics included."""
    if backend == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    module = make(backend=backend, selector_rope_theta=None, metrics_every=1, **overrides).train().to(device)
    q, k, v = (t.to(device).detach().requires_grad_() for t in qkv(0, 64, dtype=dtype))
    o = module(q, k, v, **{name: mask.to(device) for name, mask in masks.items()})
    assert o.shape == q.shape
    o.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("distill", ["sampled", "sparse"])
def test_blocks_far_longer_than_the_sequence_attend_everything_causally(distill):
    """Blocks of 2**20 tokens on a sequence of 8: one block holds every key, so the sparse path is dense causal
    attention, and the distillation's targets take the 8 keys, not 2**20 columns of padding per row."""
    cfg = st.SparseAttentionConfig(
        selector="pooled",  # any block size
        block_q=2**20,
        block_k=2**20,
        top_k=1,
        window=1,
        sinks=1,
        dense_warmup_steps=0,
        dense_fallback=False,
        distill=distill,
    )
    attn = st.SparseAttention(cfg, 4, 2, 16)
    q, k, v = make_qkv(1, 4, 2, 8, 16, torch.float32, seed=2, requires_grad=True)
    out = attn(q, k, v)
    (out.sum() + attn.selector_loss).backward()
    torch.testing.assert_close(out, dense_causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert attn.stats()["dense_path"] == 0 and torch.isfinite(q.grad).all()
