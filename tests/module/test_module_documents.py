"""SparseAttention with packed documents: every path (sparse, dense fallback, dense with dropout) equals
running each document alone; the selection, the candidates and the distillation target never cross a
document; the selector's RoPE un-rotation takes the restarting positions; checkpoint replay."""

import math

import pytest
import torch
import torch.nn.functional as F
from builders import check_close, ids_from_lengths, make_qkv
from torch.utils.checkpoint import checkpoint

import sparse_train as st
from sparse_train.index.block_index import shares_document
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.selection import selection_geometry
from sparse_train.selection.scorer import (
    allowed_dynamic_blocks,
    rope_inverse_frequencies,
    selection_candidates,
    unrotate,
)

HQ, HKV, D = 4, 2, 16


def make(**overrides):
    base = dict(block_q=16, block_k=16, top_k=2, window=2, sinks=1, selector_dim=8, dense_warmup_steps=0)
    base.update(overrides)
    return st.SparseAttention(st.SparseAttentionConfig(**base), num_heads=HQ, num_kv_heads=HKV, head_dim=D)


def per_document_sdpa(q, k, v, lengths_per_row, scale=None):
    """Each document run alone through causal SDPA, concatenated back: the packing oracle."""
    out = torch.empty_like(q)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            out[b, :, sl] = F.scaled_dot_product_attention(
                q[b : b + 1, :, sl],
                k[b : b + 1, :, sl],
                v[b : b + 1, :, sl],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )[0]
            start += n
    return out


LENGTHS = [[40, 3, 70, 37], [150]]  # N = 150: short documents, a document shorter than a block, one long row


def test_sparse_path_with_full_selection_equals_each_document_alone():
    attn = make(top_k=100, dense_fallback=False, distill="off")
    q, k, v = make_qkv(2, HQ, HKV, 150, D, dtype=torch.float64, seed=1)
    ids = ids_from_lengths(*LENGTHS)
    out = attn(q, k, v, document_ids=ids)
    assert attn.stats()["dense_path"] == 0.0
    torch.testing.assert_close(out, per_document_sdpa(q, k, v, LENGTHS))
    # without document_ids the same module attends across documents (the case this guards)
    assert not torch.allclose(attn(q, k, v), per_document_sdpa(q, k, v, LENGTHS))


def test_dense_full_selection_fallback_equals_each_document_alone():
    attn = make()  # N = 80 with 5 blocks selected: a full selection -> dense path
    lengths = [[10, 30, 40], [79, 1]]
    q, k, v = make_qkv(2, HQ, HKV, 80, D, dtype=torch.float64, seed=2)
    out = attn(q, k, v, document_ids=ids_from_lengths(*lengths).to(torch.int32))
    assert attn.fallback_counts == {"dense_full_selection": 1}
    torch.testing.assert_close(out, per_document_sdpa(q, k, v, lengths))


def test_dense_path_with_dropout_attends_the_document_index():
    attn = make(dropout_p=0.3)
    attn.train()
    lengths = [[20, 60]]
    q, k, v = make_qkv(1, HQ, HKV, 80, D, dtype=torch.float64, seed=3)
    ids = ids_from_lengths(*lengths)
    torch.manual_seed(5)
    out = attn(q, k, v, document_ids=ids)
    torch.manual_seed(5)
    seed = st.validation.draw_dropout_seed()
    full = st.BlockIndex.full(1, HKV, 80, 16, 16, document_ids=ids)
    ref, _ = reference_sparse_attention(
        q, k, v, full, scale=attn.scale, dropout_p=0.3, dropout_seed=seed, document_ids=ids
    )
    torch.testing.assert_close(out, ref)


def test_partial_selection_never_crosses_documents_and_equals_the_reference():
    attn = make(dense_fallback=False, distill="off", top_k=2, window=2, sinks=1)
    lengths = [[33, 5, 90, 9, 63], [7] * 28 + [4]]
    n = 200
    q, k, v = make_qkv(2, HQ, HKV, n, D, dtype=torch.float64, seed=4, requires_grad=True)
    ids = ids_from_lengths(*lengths)
    out = attn(q, k, v, document_ids=ids)
    index = attn.last_selection
    assert index is not None and not index.is_full()
    nkb = math.ceil(n / 16)
    keys = torch.arange(nkb).view(1, 1, 1, nkb).expand(2, 1, index.num_q_blocks, nkb)
    same = shares_document(ids, keys, block_q=16, block_k=16)
    assert not (index.to_dense() & ~same).any()
    ref, _ = reference_sparse_attention(q, k, v, index, scale=attn.scale, document_ids=ids)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_candidates_and_distillation_support_exclude_other_documents():
    geometry = selection_geometry(200, 16, 16, 3, 1, 1)
    ids = ids_from_lengths([33, 5, 90, 9, 63], [200])
    allowed = allowed_dynamic_blocks(geometry, 1, 1, None, ids)  # [B, NQB, NKB]
    keys = torch.arange(geometry.num_k_blocks).view(1, 1, 1, -1).expand(2, 1, geometry.num_q_blocks, -1)
    same = shares_document(ids, keys, block_q=16, block_k=16)[:, 0]
    assert allowed.shape == (2, geometry.num_q_blocks, geometry.num_k_blocks)
    assert not (allowed & ~same).any()
    # the single-document row is the plain mask
    assert torch.equal(allowed[1], allowed_dynamic_blocks(geometry, 1, 1))
    scores = torch.randn(2, HKV, geometry.num_q_blocks, geometry.num_k_blocks)
    picks = selection_candidates(scores, geometry, window=1, sinks=1, document_ids=ids)
    valid = picks >= 0
    picked_same = same.unsqueeze(1).expand(-1, HKV, -1, -1).gather(-1, picks.clamp(min=0))
    assert valid.any() and not (valid & ~picked_same).any()


@pytest.mark.parametrize("distill", ["dense", "sampled", "sparse"])
def test_distillation_target_is_document_masked(distill, monkeypatch):
    # the block-level KL's target (the pooled selector's)
    attn = make(
        selector="pooled", dense_fallback=False, distill=distill, distill_support="causal", distill_query_blocks=64
    )
    attn.train()
    lengths = [[60, 4, 86]]
    q, k, v = make_qkv(1, HQ, HKV, 150, D, seed=6)
    ids = ids_from_lengths(*lengths)
    seen = {}
    import sparse_train.selection.distill as distill_mod

    real_kl = distill_mod.block_kl_sum

    def spy(target, logits, allowed, row_valid):
        seen["target"], seen["allowed"] = target, allowed.expand_as(logits)
        return real_kl(target, logits, allowed, row_valid)

    monkeypatch.setattr(st.module.attention, "block_kl_sum", spy)
    attn(q, k, v, document_ids=ids)
    loss = attn.selector_loss
    assert loss is not None and torch.isfinite(loss)
    loss.backward()
    assert attn.scorer.query_proj.grad.abs().sum() > 0
    target, allowed = seen["target"], seen["allowed"]
    if distill != "sparse":
        keys = torch.arange(10).view(1, 1, 1, -1).expand(1, 1, 10, -1)
        same = shares_document(ids, keys, block_q=16, block_k=16).expand(-1, HKV, -1, -1)
        assert not (allowed & ~same).any()
        assert (target[~same] == 0).all()
        # a cross-document block that is causal carries no target mass (e.g. query block 5 holds doc 2
        # only, so block 0 is not allowed)
        assert not allowed[0, :, 5, 0].any()
    else:
        slots = attn.last_selection.indices.to(torch.int64)
        assert (target[slots < 0] == 0).all()


def test_unrotate_takes_restarting_positions():
    inv_freq = rope_inverse_frequencies(10000.0, D)
    x = torch.randn(2, 3, 50, D, dtype=torch.float64)
    pos = torch.cat([torch.arange(20), torch.arange(30)]).view(1, -1).expand(2, -1)
    angles = pos.unsqueeze(-1).double() * inv_freq.double()
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    torch.testing.assert_close(unrotate(rotated, inv_freq, pos).double(), x, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unrotate(rotated, inv_freq).double(), x, atol=1e-3)
    with pytest.raises(ValueError, match="positions"):
        unrotate(rotated, inv_freq, torch.arange(49))


def test_module_unrotates_with_positions_restarting_per_document():
    attn = make(selector_rope_theta=10000.0, dense_fallback=False, distill="off")
    q, k, _ = make_qkv(1, HQ, HKV, 64, D, seed=7)
    ids = ids_from_lengths([24, 40])
    restart = torch.cat([torch.arange(24), torch.arange(40)]).view(1, -1)
    seen = []
    real_pool = attn.scorer.pool

    def spy(q_, k_, bq, bk, seq_lens=None, positions=None, query_blocks=None):
        seen.append(positions)
        return real_pool(q_, k_, bq, bk, seq_lens, positions, query_blocks)

    attn.scorer.pool = spy
    attn(q, k, k.clone(), document_ids=ids)
    assert torch.equal(seen[-1], restart)
    explicit = torch.arange(64).view(1, -1) + 5
    attn(q, k, k.clone(), document_ids=ids, position_ids=explicit)
    assert seen[-1] is explicit


@pytest.mark.parametrize(
    "ids,match",
    [
        pytest.param(torch.zeros(2, 64, dtype=torch.int64), r"document_ids must have shape", id="batch"),
        pytest.param(torch.zeros(1, 64), "document_ids must be int32 or int64", id="float"),
        pytest.param(torch.tensor([[1] * 32 + [0] * 32]), "non-decreasing", id="decreasing"),
        pytest.param(torch.full((1, 64), -1), r"\[0, 2\*\*31\)", id="negative"),
    ],
)
@pytest.mark.parametrize("n_path", ["sparse", "dense"])
def test_bad_document_ids_raise(ids, match, n_path):
    attn = make(dense_fallback=n_path == "dense", top_k=100 if n_path == "dense" else 1)
    q, k, v = make_qkv(1, HQ, HKV, 64, D)
    with pytest.raises(ValueError, match=match):
        attn(q, k, v, document_ids=ids)


def test_bad_position_ids_raise():
    attn = make()
    q, k, v = make_qkv(1, HQ, HKV, 64, D)
    with pytest.raises(ValueError, match="position_ids"):
        attn(q, k, v, position_ids=torch.arange(63))


def test_checkpoint_replay_with_documents_gives_the_gradients_of_the_first_selection():
    ids = ids_from_lengths([45, 5, 100])
    torch.manual_seed(0)
    q0, k0, v0 = make_qkv(1, HQ, HKV, 150, D, dtype=torch.float64, seed=8)

    def run(use_checkpoint):
        module = make(dense_fallback=False, top_k=1)
        module.train()
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))

        def core(q_, k_, v_):
            return module(q_, k_, v_, document_ids=ids)

        out = checkpoint(core, q, k, v, use_reentrant=False) if use_checkpoint else core(q, k, v)
        index = module.last_selection
        if use_checkpoint:  # scramble the selector: a fresh selection in the recompute would differ
            with torch.no_grad():
                module.scorer.query_proj.normal_()
        (out.square().sum() + module.selector_loss).backward()
        return [t.grad for t in (q, k, v)], index, module

    plain, plain_index, _ = run(False)
    replayed, index, module = run(True)
    assert torch.equal(plain_index.indices, index.indices)
    assert module.stats()["replay/hits"] == 1.0
    for a, b in zip(plain, replayed):
        torch.testing.assert_close(a, b)


def check_module_against_reference(attn, q, k, v, ids, dtype, upcast_low):
    """The module's output and q/k/v gradients against the float64 reference on the module's own
    selection, by error ratio against the reference run in the inputs' precision (``upcast_low``: as
    the reference computes by default; False: without its upcast, the low-precision baseline)."""
    out = attn(q, k, v, document_ids=ids)
    index = attn.last_selection
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = reference_sparse_attention(*ref_inputs, index, scale=attn.scale, document_ids=ids)
    (ref * grad_out.double()).sum().backward()
    low_inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    low_kwargs = {} if upcast_low else {"upcast": False}
    low, _ = reference_sparse_attention(*low_inputs, index, scale=attn.scale, document_ids=ids, **low_kwargs)
    (low * grad_out).sum().backward()
    check_close("o", out, ref, low, dtype)
    for name, got, r, lo in zip("qkv", (q, k, v), ref_inputs, low_inputs):
        check_close(f"d{name}", got.grad, r.grad, lo.grad, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_module_with_documents_on_gpu_matches_the_float64_reference(dtype):
    """The whole module on CUDA (selector, document index, Triton kernels forward and backward) against
    the float64 reference on the same selection, odd length, GQA, many short documents."""
    attn = st.SparseAttention(
        st.SparseAttentionConfig(
            block_q=64, block_k=64, top_k=4, window=2, sinks=1, dense_warmup_steps=0, dense_fallback=False
        ),
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    ).cuda()
    attn.train()
    lengths = [[700, 37, 1, 900, 64, 600, 697], [3000 - 1]]
    n = sum(lengths[0])
    ids = ids_from_lengths(*lengths).cuda()
    q, k, v = make_qkv(2, 8, 2, n, 64, dtype=dtype, seed=9, device="cuda", requires_grad=True)
    check_module_against_reference(attn, q, k, v, ids, dtype, upcast_low=False)
    assert attn.fallback_counts == {}  # the Triton path ran
    assert attn.selector_loss is not None and torch.isfinite(attn.selector_loss)


@pytest.mark.parametrize("target", ["sparse", "dense"])
def test_distillation_targets_pass_documents_to_the_block_mass_kernels(target, monkeypatch):
    """The selector's target wrappers hand document_ids to the Triton block-mass kernels (run here in the
    interpreter by forcing the kernel route) and agree with the document-masked reference."""
    import sparse_train.selection.distill as distill_mod
    from sparse_train.kernels.reference.block_mass import reference_dense_block_mass, reference_sparse_block_mass

    n = 80
    ids = ids_from_lengths([20, 3, 40, 17])
    q, k, v = make_qkv(1, HQ, HKV, n, D, seed=10)
    scale = D**-0.5
    monkeypatch.setattr(distill_mod, "choose_backend", lambda *args, **kwargs: ("triton", "requested"))
    if target == "sparse":
        sel = torch.full((1, HKV, 5, 1), -1)
        index = st.BlockIndex.from_selection(
            sel, seq_len=n, block_q=16, block_k=16, window=2, sinks=1, document_ids=ids
        )
        _, lse = reference_sparse_attention(q, k, v, index, scale=scale, document_ids=ids)
        got, got_ok = distill_mod.sparse_block_mass(q, k, index, scale=scale, lse=lse, document_ids=ids)
        want, want_ok = reference_sparse_block_mass(q, k, index, scale=scale, lse=lse, document_ids=ids)
    else:
        blocks = torch.tensor([1, 3, 4])
        got, got_ok = distill_mod.dense_block_mass(
            q, k, block_q=16, block_k=16, scale=scale, query_blocks=blocks, document_ids=ids
        )
        want, want_ok = reference_dense_block_mass(
            q, k, block_q=16, block_k=16, scale=scale, query_blocks=blocks, document_ids=ids
        )
    assert torch.equal(got_ok, want_ok)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # without the document mask the target differs: the ids really reached the kernel
    if target == "dense":
        plain, _ = reference_dense_block_mass(q, k, block_q=16, block_k=16, scale=scale, query_blocks=blocks)
        assert not torch.allclose(got, plain, atol=1e-3)


def test_module_with_documents_through_the_triton_kernels_in_the_interpreter():
    """The module's kernel route (backend="triton"; the interpreter on CPU) with documents, forward and
    backward, against the float64 reference on the module's own selection."""
    attn = make(dense_fallback=False, distill="off", backend="triton")
    lengths = [[30, 2, 50, 15]]
    ids = ids_from_lengths(*lengths)
    q, k, v = make_qkv(1, HQ, HKV, 97, D, seed=11, requires_grad=True)
    check_module_against_reference(attn, q, k, v, ids, torch.float32, upcast_low=True)


@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 32), (48, 16)], ids=lambda x: str(x))
def test_document_capacity_bounds_every_row(bq, bk):
    """The capacity the module gives the index with documents holds the longest row the selection can
    produce (a too-small capacity raises in canonicalize), over random layouts and budgets."""
    g = torch.Generator().manual_seed(bq * 100 + bk)
    for trial in range(12):
        n = int(torch.randint(40, 260, (1,), generator=g))
        top_k, window, sinks = (int(torch.randint(0, 4, (1,), generator=g)) for _ in range(3))
        if top_k + window + sinks == 0:
            continue
        cuts = torch.rand(2, n, generator=g) < 0.05
        ids = torch.cumsum(cuts.to(torch.int64), dim=1)
        geometry = selection_geometry(n, bq, bk, top_k, window, sinks)
        scores = torch.randn(2, HKV, geometry.num_q_blocks, geometry.num_k_blocks, generator=g)
        picks = selection_candidates(scores, geometry, window=window, sinks=sinks, document_ids=ids)
        index = st.BlockIndex.from_selection(
            picks,
            seq_len=n,
            block_q=bq,
            block_k=bk,
            window=window,
            sinks=sinks,
            capacity=geometry.document_capacity,
            document_ids=ids,
        )
        assert index.capacity == geometry.document_capacity, trial
