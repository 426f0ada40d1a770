"""GPU tests of the Triton block-sparse attention kernels (marker `gpu`, skipped without CUDA).

Real sizes in bf16/fp16 against the PyTorch reference computed in fp32 on the GPU (chunked by the
reference itself); error-ratio tolerance: err(kernel) <= C * err(reference run in the kernel's dtype)
+ floor, both measured against the fp32 reference on the same inputs.
"""
import math

import pytest
import torch

from sparse_train.index import BlockIndex

pytestmark = pytest.mark.gpu
DEV = "cuda"
C = 3.0


def _random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    nqb, nkb = math.ceil(N / BQ), math.ceil(N / BK)
    last = ((torch.clamp((torch.arange(nqb) + 1) * BQ, max=N) - 1) // BK)
    scores = torch.rand(B, HKV, nqb, nkb, generator=g)
    causal = torch.arange(nkb).view(1, 1, 1, -1) <= last.view(1, 1, -1, 1)
    scores = scores.masked_fill(~causal, -1.0)
    val, sel = scores.topk(min(topk, nkb), dim=-1)
    sel = torch.where(val >= 0, sel, -1)
    return BlockIndex.from_selection(sel.to(DEV), seq_len=N, block_q=BQ, block_k=BK, window=window, sinks=sinks)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _inputs(B, HQ, HKV, N, D, dtype, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(B, HQ, N, D, device=DEV, dtype=dtype)
    k = torch.randn(B, HKV, N, D, device=DEV, dtype=dtype)
    v = torch.randn(B, HKV, N, D, device=DEV, dtype=dtype)
    return q, k, v


def _check(name, got, ref32, ref_lowp, floor=1e-4):
    e_k, e_r = _rel(got, ref32), _rel(ref_lowp, ref32)
    print(f"{name}: kernel rel err {e_k:.3e}  torch-lowp rel err {e_r:.3e}")
    assert math.isfinite(e_k)
    assert e_k <= C * e_r + floor, f"{name}: {e_k:.3e} > {C} * {e_r:.3e} + {floor}"


CASES = [
    # id, B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks
    pytest.param(2, 8, 2, 4099, 128, 64, 64, torch.bfloat16, 8, 4, 1, id="bf16-d128-b64-odd4099-gqa4"),
    pytest.param(1, 8, 8, 8192, 64, 128, 128, torch.float16, 6, 2, 1, id="fp16-d64-b128-8k-mha"),
    pytest.param(1, 8, 2, 5000, 128, 128, 64, torch.bfloat16, 8, 4, 1, id="bf16-d128-bq128-bk64-odd"),
    pytest.param(1, 4, 1, 3000, 64, 64, 128, torch.float16, 5, 2, 1, id="fp16-d64-bq64-bk128-gqa4"),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks", CASES)
def test_forward_backward_vs_reference(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks):
    from sparse_train.kernels.op import triton_sparse_attention
    from sparse_train.kernels.reference import reference_sparse_attention

    idx = _random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N)
    q, k, v = _inputs(B, HQ, HKV, N, D, dtype)
    do = torch.randn(B, HQ, N, D, device=DEV, dtype=dtype)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = triton_sparse_attention(qs, ks, vs, idx)
    assert torch.isfinite(o).all()
    dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32, lse32 = reference_sparse_attention(q32, k32, v32, idx)
    g32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ol, _ = reference_sparse_attention(ql, kl, vl, idx, upcast=False)
    gl = torch.autograd.grad(ol, (ql, kl, vl), do)
    _check("o", o, o32, ol)
    fin = torch.isfinite(lse32)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - lse32[fin]).abs().max().item() < 2e-2
    for name, a, r, l in zip(("dq", "dk", "dv"), (dq, dk, dv), g32, gl):
        _check(name, a, r, l)


def test_long_sequence_131072_forward_backward():
    """N = 131072 (int64 dropout counters and addressing past 2^31 elements of the score space)."""
    from sparse_train.kernels.op import triton_sparse_attention
    from sparse_train.kernels.reference import reference_sparse_attention

    B, HQ, HKV, N, D, BQ, BK = 1, 4, 1, 131072, 128, 128, 128
    idx = _random_index(B, HKV, N, BQ, BK, 8, 4, 1, seed=1)
    q, k, v = _inputs(B, HQ, HKV, N, D, torch.bfloat16, seed=1)
    do = torch.randn_like(q)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = triton_sparse_attention(qs, ks, vs, idx, dropout_p=0.1, dropout_seed=7)
    dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32, _ = reference_sparse_attention(q32, k32, v32, idx, dropout_p=0.1, dropout_seed=7)
    g32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ol, _ = reference_sparse_attention(ql, kl, vl, idx, dropout_p=0.1, dropout_seed=7, upcast=False)
    gl = torch.autograd.grad(ol, (ql, kl, vl), do)
    _check("o", o, o32, ol)
    for name, a, r, l in zip(("dq", "dk", "dv"), (dq, dk, dv), g32, gl):
        _check(name, a, r, l)


@pytest.mark.parametrize("r0", [1, 4, 10**6], ids=["r0-1", "r0-4", "r0-huge"])
def test_bitwise_determinism_and_hybrid_agree(r0):
    from sparse_train.kernels.op import triton_sparse_attention

    B, HQ, HKV, N, D = 1, 16, 4, 16384, 128
    idx = _random_index(B, HKV, N, 64, 64, 16, 8, 1, seed=3)
    q, k, v = _inputs(B, HQ, HKV, N, D, torch.bfloat16, seed=3)
    do = torch.randn_like(q)

    def grads(det):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = triton_sparse_attention(qs, ks, vs, idx, deterministic=det, kernel_options={"r0": r0})
        return torch.autograd.grad(o, (qs, ks, vs), do)

    a, b = grads(True), grads(True)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic mode must be bitwise reproducible"
    h = grads(False)
    for x, y in zip(a, h):
        assert _rel(x, y) < 1e-2


def test_torch_compile_no_graph_break():
    from sparse_train.kernels.op import triton_sparse_attention

    B, HQ, HKV, N, D = 1, 8, 2, 4096, 128
    idx = _random_index(B, HKV, N, 64, 64, 8, 4, 1, seed=5)
    plan = idx.plan(4)
    q, k, v = _inputs(B, HQ, HKV, N, D, torch.bfloat16, seed=5)

    def f(q, k, v):
        o, lse = triton_sparse_attention(q, k, v, idx, kernel_options={"plan": plan})
        return (o.float() ** 2).sum() + lse.sum()

    cf = torch.compile(f, fullgraph=True)  # fullgraph: any graph break raises
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = cf(qs, ks, vs)
    g = torch.autograd.grad(out, (qs, ks, vs))
    qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
    oute = f(qe, ke, ve)
    ge = torch.autograd.grad(oute, (qe, ke, ve))
    assert torch.allclose(out, oute, rtol=1e-3)
    for x, y in zip(g, ge):
        assert _rel(x, y) < 1e-2


def test_opcheck_on_gpu():
    from sparse_train.plan import backward_config, cold_slots, forward_config

    B, HQ, HKV, N, D = 1, 4, 2, 512, 64
    idx = _random_index(B, HKV, N, 64, 64, 3, 2, 1, seed=9)
    plan = idx.plan(2)
    q, k, v = _inputs(B, HQ, HKV, N, D, torch.float16, seed=9)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    slots = cold_slots(plan.hot, plan.reuse, False)
    launch_config = [*forward_config(HQ // HKV, 64, 64, D), *backward_config(HQ // HKV, 64, 64, D, plan.num_cold > 0)]
    args = (q, k, v, idx.indices, idx.counts, plan.kv_indptr, plan.kv_qblocks, slots, None,
            plan.num_cold, 64, 64, 0.125, 0.0, 0, 1, launch_config)
    torch.library.opcheck(torch.ops.sparse_train.sparse_attn_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("seed", [2**63 + 12345, 2**64 - 1], ids=["seed-2^63+12345", "seed-2^64-1"])
def test_strided_seq_lens_nan_padding_and_top_seeds(seed):
    """Issue 11 on the GPU: seq_lens as a strided int32 column (the kernels index it without a stride),
    NaN in k/v past it (never loaded), and dropout seeds at the top of [0, 2**64) (a u64 kernel
    argument): forward and backward against the fp32 reference on the clean inputs."""
    from sparse_train.kernels.op import triton_sparse_attention
    from sparse_train.kernels.reference import reference_sparse_attention

    B, HQ, HKV, N, D, cut = 2, 8, 2, 2051, 64, 1300
    idx = _random_index(B, HKV, N, 64, 64, 6, 2, 1, seed=11)
    lens = torch.tensor([[N, 7], [cut, 7]], dtype=torch.int32, device=DEV)[:, 0]
    assert not lens.is_contiguous()
    q, k, v = _inputs(B, HQ, HKV, N, D, torch.bfloat16, seed=11)
    do = torch.randn_like(q)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[1, :, cut:] = float("nan")
    v_nan[1, :, cut:] = float("nan")
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k_nan, v_nan))
    o, _ = triton_sparse_attention(qs, ks, vs, idx, seq_lens=lens, dropout_p=0.1, dropout_seed=seed)
    grads = torch.autograd.grad(o, (qs, ks, vs), do)
    for t in (o, *grads):
        assert torch.isfinite(t).all()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32, _ = reference_sparse_attention(q32, k32, v32, idx, seq_lens=lens, dropout_p=0.1, dropout_seed=seed)
    g32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ol, _ = reference_sparse_attention(ql, kl, vl, idx, seq_lens=lens, dropout_p=0.1, dropout_seed=seed, upcast=False)
    gl = torch.autograd.grad(ol, (ql, kl, vl), do)
    _check("o", o, o32, ol)
    for name, a, r, l in zip(("dq", "dk", "dv"), grads, g32, gl):
        _check(name, a, r, l)


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1], ids=["seed-2^63", "seed-2^64-1"])
def test_dropout_bits_at_the_top_of_the_seed_domain(seed):
    """The u64 seed path of the kernels gives the reference's keep bits exactly: with q = 0 (uniform P)
    and V = identity, o[b, h, q, j] > 0 iff key j was kept."""
    from sparse_train.kernels.op import triton_sparse_attention
    from sparse_train.kernels.reference import dropout_keep_mask

    B, HQ, HKV, N, D, p = 1, 4, 2, 128, 64, 0.3
    idx = BlockIndex.full(B, HKV, N, 64, 64, device=DEV)
    q = torch.zeros(B, HQ, N, D, device=DEV, dtype=torch.float16)
    k = torch.randn(B, HKV, N, D, device=DEV, dtype=torch.float16)
    v = torch.eye(N, D, device=DEV, dtype=torch.float16).expand(B, HKV, N, D).contiguous()
    o, _ = triton_sparse_attention(q, k, v, idx, dropout_p=p, dropout_seed=seed)
    pos = torch.arange(N, device=DEV)
    keep = dropout_keep_mask(seed, torch.zeros(1, 1, 1, 1, dtype=torch.long, device=DEV),
                             torch.arange(HQ, device=DEV).view(1, HQ, 1, 1), pos.view(1, 1, N, 1),
                             pos.view(1, 1, 1, N), HQ, N, p) & (pos.view(1, 1, 1, N) <= pos.view(1, 1, N, 1))
    got = o > 0
    assert torch.equal(got, keep[..., :D]), f"{(got != keep[..., :D]).sum().item()} keep bits differ"
