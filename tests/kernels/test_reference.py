"""The PyTorch reference against a naive dense masked softmax (fp64), SDPA, and autograd checks."""

import math

import builders
import pytest
import torch
import torch.nn.functional as F
from builders import make_qkv

import sparse_train as st
from sparse_train.kernels.reference.attention import (
    dense_block_mask_attention,
    dropout_keep_mask,
    reference_sparse_attention,
)


def uniform_index(b, hkv, n, bq, bk, k, window, sinks, seed=0, empty_rows=False):
    """Uniform candidates (duplicates common), 30% of the slots empty; optionally empty rows."""
    return builders.random_index(
        b, hkv, n, bq, bk, k, window, sinks, seed=seed, distinct=False, drop=0.3, empty_rows=empty_rows
    )


CASES = [
    # (b, hq, hkv, n, d, bq, bk, topk, window, sinks)
    pytest.param(1, 2, 2, 128, 16, 32, 32, 2, 1, 1, id="mha-aligned"),
    pytest.param(2, 4, 2, 203, 16, 32, 32, 3, 1, 1, id="gqa2-odd"),
    pytest.param(1, 6, 2, 257, 8, 64, 32, 3, 2, 0, id="gqa3-bq64-bk32"),
    pytest.param(1, 4, 1, 190, 8, 32, 64, 2, 0, 1, id="mqa-bq32-bk64"),
    pytest.param(1, 2, 1, 1, 8, 64, 64, 1, 1, 0, id="N1"),
]


@pytest.mark.parametrize("b,hq,hkv,n,d,bq,bk,topk,window,sinks", CASES)
def test_matches_dense_masked_softmax_fp64(b, hq, hkv, n, d, bq, bk, topk, window, sinks):
    q, k, v = make_qkv(b, hq, hkv, n, d, requires_grad=True, dtype=torch.float64)
    idx = uniform_index(b, hkv, n, bq, bk, topk, window, sinks, seed=n)
    o, lse = reference_sparse_attention(q, k, v, idx, chunk_q_blocks=2)
    o_ref, lse_ref = dense_block_mask_attention(q, k, v, idx)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), grad)
    g_ref = torch.autograd.grad(o_ref, (q, k, v), grad)
    for name, a, r in zip("qkv", g, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_gradcheck_small():
    q, k, v = make_qkv(1, 4, 2, 45, 4, requires_grad=True, seed=3, dtype=torch.float64)
    idx = uniform_index(1, 2, 45, 16, 16, 2, 1, 1, seed=3)
    seq_lens = torch.tensor([40])

    def fn(q, k, v):
        o, lse = reference_sparse_attention(q, k, v, idx, seq_lens=seq_lens)
        return o, lse

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


def test_full_selection_equals_causal_sdpa():
    q, k, v = make_qkv(2, 4, 2, 300, 16, seed=1, dtype=torch.float64)
    idx = st.BlockIndex.full(2, 2, 300, block_q=64, block_k=32)
    o, _ = reference_sparse_attention(q, k, v, idx)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)


def test_empty_rows_are_zero_with_zero_grads_and_no_nan():
    q, k, v = make_qkv(1, 4, 2, 200, 8, requires_grad=True, seed=2, dtype=torch.float64)
    idx = uniform_index(1, 2, 200, 32, 32, 2, 0, 0, seed=2, empty_rows=True)
    assert bool((idx.counts == 0).any())
    o, lse = reference_sparse_attention(q, k, v, idx)
    (o.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    empty = (idx.counts[0] == 0).repeat_interleave(32, dim=-1)[..., :200]  # [HKV, N]
    empty = empty.repeat_interleave(2, dim=0)  # [HQ, N]
    assert torch.all(o[0][empty] == 0)
    assert torch.all(torch.isneginf(lse[0][empty]))
    assert torch.all(q.grad[0][empty] == 0)
    for t in (o, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()


def test_lse_gradient_is_finite_on_empty_rows():
    q, k, v = make_qkv(1, 2, 1, 96, 8, requires_grad=True, seed=4, dtype=torch.float64)
    idx = uniform_index(1, 1, 96, 32, 32, 1, 0, 0, seed=4, empty_rows=True)
    _, lse = reference_sparse_attention(q, k, v, idx)
    lse.masked_fill(torch.isinf(lse), 0).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_seq_lens_mask_keys_like_truncation():
    q, k, v = make_qkv(2, 2, 1, 160, 8, seed=5, dtype=torch.float64)
    idx = uniform_index(2, 1, 160, 32, 32, 3, 1, 1, seed=5)
    lens = torch.tensor([160, 97])
    o, _ = reference_sparse_attention(q, k, v, idx, seq_lens=lens)
    o_ref, _ = dense_block_mask_attention(q, k, v, idx, seq_lens=lens)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    # Garbage past the length cannot leak into rows before it.
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 97:] = 1e4
    v2[1, :, 97:] = float("nan")
    o2, _ = reference_sparse_attention(q, k2, v2, idx, seq_lens=lens)
    torch.testing.assert_close(o2[1, :, :97], o[1, :, :97], rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.2, 0.6], ids=lambda p: f"p{p}")
def test_dropout_equals_masked_probabilities(p):
    b, hq, hkv, n, d = 1, 4, 2, 150, 8
    q, k, v = make_qkv(b, hq, hkv, n, d, seed=6, dtype=torch.float64)
    idx = uniform_index(b, hkv, n, 32, 32, 2, 1, 1, seed=6)
    seed = 2**40 + 99
    o, lse = reference_sparse_attention(q, k, v, idx, dropout_p=p, dropout_seed=seed, chunk_q_blocks=3)
    _, lse_nodrop = reference_sparse_attention(q, k, v, idx)
    torch.testing.assert_close(lse, lse_nodrop, rtol=0, atol=0)  # denominator excludes dropout
    # Dense recomputation: probabilities from the dense mask, keep bits from the coordinates.
    dense = idx.to_dense().repeat_interleave(32, 2)[:, :, :n].repeat_interleave(32, 3)[..., :n]
    dense = dense.repeat_interleave(hq // hkv, 1)
    pos = torch.arange(n)
    allowed = dense & (pos.view(1, 1, 1, n) <= pos.view(1, 1, n, 1))
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(d)
    probs = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    keep = dropout_keep_mask(
        seed,
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(hq).view(1, hq, 1, 1),
        pos.view(1, 1, n, 1),
        pos.view(1, 1, 1, n),
        hq,
        n,
        p,
    )
    expected = (probs * keep / (1 - p)) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)


def test_dropout_needs_seed_and_valid_p():
    q, k, v = make_qkv(1, 2, 1, 64, 8, dtype=torch.float64)
    idx = st.BlockIndex.full(1, 1, 64)
    with pytest.raises(ValueError, match="dropout_seed"):
        reference_sparse_attention(q, k, v, idx, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        st.sparse_attention(q, k, v, idx, dropout_p=1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_upcast_close_to_fp64(dtype):
    q, k, v = make_qkv(1, 4, 2, 130, 16, dtype=torch.float64, seed=7)
    idx = uniform_index(1, 2, 130, 32, 32, 2, 1, 1, seed=7)
    o64, _ = reference_sparse_attention(q, k, v, idx)
    o_lp, lse_lp = reference_sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), idx)
    assert o_lp.dtype == dtype and lse_lp.dtype == torch.float32
    err = (o_lp.double() - o64).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), err


def test_functional_dispatch_reference_on_cpu():
    q, k, v = make_qkv(1, 4, 2, 100, 8, dtype=torch.float32, seed=8)
    idx = uniform_index(1, 2, 100, 32, 32, 2, 1, 1, seed=8)
    o, lse = st.sparse_attention(q, k, v, idx, return_lse=True)
    o_ref, lse_ref = reference_sparse_attention(q, k, v, idx)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert st.functional.resolve_backend(q, k, v, idx)[0] == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        st.sparse_attention(q, k, v, idx, backend="cuda")


def test_functional_draws_reproducible_seed():
    q, k, v = make_qkv(1, 2, 1, 64, 8, dtype=torch.float32, seed=9)
    idx = st.BlockIndex.full(1, 1, 64, block_q=32, block_k=32)
    torch.manual_seed(5)
    a = st.sparse_attention(q, k, v, idx, dropout_p=0.5)
    torch.manual_seed(5)
    b = st.sparse_attention(q, k, v, idx, dropout_p=0.5)
    c = st.sparse_attention(q, k, v, idx, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    "poison", [float("nan"), float("inf"), float("-inf"), 1e300], ids=["nan", "inf", "neg-inf", "huge"]
)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=["nodrop", "drop0.3"])
def test_nonfinite_padding_reaches_no_output_or_gradient(poison, dropout_p):
    """NaN in k/v past seq_lens reaches no dQ of valid rows (masking by multiplication would give 0 x NaN
    in the backward of the gathered keys). Outputs and q/k/v gradients must equal a run with clean padding, bit for bit,
    and
    the padded keys get zero gradient."""
    b, hq, hkv, n, d = 2, 4, 2, 150, 8
    q, k, v = make_qkv(b, hq, hkv, n, d, seed=12, dtype=torch.float64)
    idx = uniform_index(b, hkv, n, 32, 16, 3, 1, 1, seed=12)
    lens = torch.tensor([150, 61])
    do = torch.randn(b, hq, n, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(kk, vv):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, kk, vv))
        o, lse = reference_sparse_attention(qs, ks, vs, idx, seq_lens=lens, dropout_p=dropout_p, dropout_seed=5)
        return (o, lse, *torch.autograd.grad((o * do).sum() + lse.sum(), (qs, ks, vs)))

    clean = run(k, v)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 61:] = poison
    v2[1, :, 61:] = poison
    dirty = run(k2, v2)
    for name, a, c in zip(("o", "lse", "dq", "dk", "dv"), dirty, clean):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        assert torch.equal(a, c), name
    assert torch.all(dirty[3][1, :, 61:] == 0) and torch.all(dirty[4][1, :, 61:] == 0)


def test_dense_oracle_ignores_nonfinite_padding():
    """The naive dense oracle too: NaN keys/values past seq_lens reach neither o nor dq."""
    q, k, v = make_qkv(2, 2, 1, 96, 8, seed=13, dtype=torch.float64)
    idx = uniform_index(2, 1, 96, 32, 32, 2, 1, 1, seed=13)
    lens = torch.tensor([96, 50])
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 50:] = float("nan")
    v2[1, :, 50:] = float("nan")
    qs = q.clone().requires_grad_()
    o, _ = dense_block_mask_attention(qs, k2, v2, idx, seq_lens=lens)
    (dq,) = torch.autograd.grad(o.sum(), qs)
    o_ref, _ = reference_sparse_attention(q, k, v, idx, seq_lens=lens)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(dq).all()
