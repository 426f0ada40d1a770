"""Forward Triton kernel vs the PyTorch reference in fp64 (CPU: Triton interpreter, fp32/fp16).

Tolerance: err(kernel vs fp64) <= 4 * err(PyTorch reference in the kernel's dtype vs fp64) + floor.
"""

import math
import os

import pytest
import torch
from builders import check_close, make_qkv, random_index, rel_err

from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import dropout_keep_mask, reference_sparse_attention

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from sparse_train.kernels.triton import forward as kf  # noqa: E402
from sparse_train.kernels.triton.op import triton_sparse_attention, triton_supports  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh outputs start as NaN


def _run_launcher(q, k, v, idx, **kw):
    """The launcher alone; its fresh (NaN-poisoned) outputs must be written everywhere."""
    o, lse = kf.sparse_attn_forward(q, k, v, idx.indices, idx.counts, block_q=idx.block_q, block_k=idx.block_k, **kw)
    assert not torch.isnan(o).any(), "unwritten (NaN) output elements"
    assert not torch.isnan(lse).any(), "unwritten (NaN) lse elements"
    return o, lse


def test_fresh_outputs_start_as_nan():
    """The poisoning this module relies on is active: a fresh floating-point buffer holds NaN, so an
    element a kernel does not write stays NaN and fails the checks below."""
    assert torch.isnan(torch.empty(8, device=DEV)).all()
    assert torch.empty(3, dtype=torch.int32).shape == (3,)  # integer buffers are left alone


FWD_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks
    pytest.param(1, 4, 2, 150, 16, 32, 16, torch.float32, 3, 1, 1, id="gqa2-fp32-odd150-bq32-bk16"),
    pytest.param(2, 2, 2, 97, 32, 16, 32, torch.float16, 2, 1, 1, id="mha-fp16-odd97-bq16-bk32"),
    pytest.param(1, 4, 1, 128, 64, 64, 64, torch.float32, 2, 1, 0, id="gqa4-fp32-d64-b64"),
    pytest.param(1, 8, 2, 200, 16, 16, 16, torch.float16, 4, 2, 1, id="gqa4-fp16-odd200-b16"),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks", FWD_CASES)
def test_forward_vs_fp64_reference(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks):
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N + D, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, seed=N, device=DEV)
    scale = 1 / math.sqrt(D)
    o, lse = _run_launcher(q, k, v, idx, scale=scale)
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx)
    olp, lselp = reference_sparse_attention(q, k, v, idx, upcast=False)
    check_close("o", o, o64, olp, dtype)
    check_close("lse", lse, lse64, lselp.float(), dtype)


def test_public_op_matches_launcher_and_strides():
    """Arbitrary strides: q/k/v as transposed views of [B, N, H, D] storage."""
    B, HQ, HKV, N, D = 1, 4, 2, 70, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=3, device=DEV)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, HQ, D, generator=g).to(DEV).transpose(1, 2)
    k = torch.randn(B, N, HKV, D, generator=g).to(DEV).transpose(1, 2)
    v = torch.randn(B, N, HKV, D, generator=g).to(DEV).transpose(1, 2)
    assert not q.is_contiguous()
    o, lse = triton_sparse_attention(q, k, v, idx)
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx)
    assert rel_err(o, o64) < 1e-5 and rel_err(lse, lse64) < 1e-5


def test_empty_rows_zero_output_and_neg_inf_lse():
    B, HKV, HQ, N, D, BS = 2, 1, 2, 64, 16, 16
    mask = torch.zeros(B, HKV, 4, 4, dtype=torch.bool)
    mask[0, 0, 1, :2] = True  # batch 0: only query block 1 selects something
    mask[1, 0, 3, 3] = True  # batch 1: only query block 3
    idx = BlockIndex.from_dense(mask.to(DEV), seq_len=N, block_q=BS, block_k=BS)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=1, device=DEV)
    o, lse = _run_launcher(q, k, v, idx, scale=0.25)
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx, scale=0.25)
    empty = torch.isinf(lse64)
    assert empty.sum() > 0
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty)
    assert (o[empty.unsqueeze(-1).expand_as(o)] == 0).all()
    assert rel_err(o, o64) < 1e-5


def test_seq_lens_mask_keys_past_length():
    B, HQ, HKV, N, D = 2, 2, 1, 90, 16
    idx = random_index(B, HKV, N, 16, 16, 3, 1, 1, seed=5, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=5, device=DEV)
    seq_lens = torch.tensor([90, 53], device=DEV)
    o, lse = triton_sparse_attention(q, k, v, idx, seq_lens=seq_lens)
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx, seq_lens=seq_lens)
    assert rel_err(o, o64) < 1e-5 and rel_err(lse, lse64) < 1e-5
    # keys >= 53 of batch 1 must not matter, even NaN garbage there (loads are masked, not just logits)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 53:] = float("nan")
    v2[1, :, 53:] = float("nan")
    q2 = q.clone().requires_grad_()
    k2.requires_grad_()
    v2.requires_grad_()
    o2, _ = triton_sparse_attention(q2, k2, v2, idx, seq_lens=seq_lens)
    assert torch.equal(o2[1], o[1])
    o2.sum().backward()
    assert torch.isfinite(q2.grad).all()
    assert torch.isfinite(k2.grad[1, :, :53]).all() and torch.isfinite(v2.grad[1, :, :53]).all()
    assert torch.all(k2.grad[1, :, 53:] == 0) and torch.all(v2.grad[1, :, 53:] == 0)


def test_full_selection_equals_causal_sdpa():
    B, HQ, HKV, N, D = 1, 4, 2, 100, 32
    idx = BlockIndex.full(B, HKV, N, block_q=32, block_k=16, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=7, device=DEV)
    o, _ = triton_sparse_attention(q, k, v, idx)
    G = HQ // HKV
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1), is_causal=True
    )
    assert rel_err(o, ref) < 1e-5


def test_duplicate_candidates_count_once():
    """Duplicates in the input selection go through from_selection and must not double-count keys:
    compare with SDPA under the explicit element mask of the unique block set."""
    B, HQ, HKV, N, D, BS = 1, 2, 1, 80, 16, 16
    idx = random_index(B, HKV, N, BS, BS, 2, 1, 0, seed=11, device=DEV, duplicates=True)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=11, device=DEV)
    o, _ = triton_sparse_attention(q, k, v, idx)
    blocks = idx.to_dense()[0, 0]  # [NQB, NKB]
    elem = blocks.repeat_interleave(BS, 0).repeat_interleave(BS, 1)[:N, :N]
    elem &= torch.ones(N, N, dtype=torch.bool, device=DEV).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().expand(B, HQ, N, D), v.double().expand(B, HQ, N, D), attn_mask=elem
    )
    assert rel_err(o, ref) < 1e-5


def test_dropout_mask_bits_exact():
    """Recover the kernel's keep mask: q = 0 makes P uniform over valid keys, V = identity makes
    o[q, k] = keep(q, k) / ((1 - p) * count_q).  The mask must equal the reference bits exactly."""
    B, HQ, HKV, N, D, BS, p, seed = 2, 4, 2, 64, 64, 16, 0.3, 1234
    idx = BlockIndex.full(B, HKV, N, block_q=BS, block_k=BS, device=DEV)
    q = torch.zeros(B, HQ, N, D, device=DEV)
    k = torch.randn(B, HKV, N, D, device=DEV)
    v = torch.eye(N, D, device=DEV).expand(B, HKV, N, D).contiguous()
    o, _ = triton_sparse_attention(q, k, v, idx, dropout_p=p, dropout_seed=seed)
    bb = torch.arange(B, device=DEV).view(B, 1, 1, 1)
    hh = torch.arange(HQ, device=DEV).view(1, HQ, 1, 1)
    qq = torch.arange(N, device=DEV).view(1, 1, N, 1)
    kk = torch.arange(N, device=DEV).view(1, 1, 1, N)
    keep = dropout_keep_mask(seed, bb, hh, qq, kk, HQ, N, p) & (kk <= qq)
    got = o > 0
    assert torch.equal(got, keep), f"{(got != keep).sum().item()} mask bits differ"
    expect = keep.double() / ((1 - p) * (qq + 1).double())
    assert rel_err(o, expect) < 1e-6
    o_other, _ = triton_sparse_attention(q, k, v, idx, dropout_p=p, dropout_seed=seed + 1)
    assert not torch.equal(o_other > 0, got)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["nodrop", "drop0.2"])
def test_split_counts_agree_with_unsplit(dropout_p):
    B, HQ, HKV, N, D = 1, 2, 1, 160, 16
    idx = random_index(B, HKV, N, 16, 16, 8, 2, 1, seed=13, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=13, device=DEV)
    outs = {}
    for s in (1, 2, 8):
        outs[s] = _run_launcher(q, k, v, idx, scale=0.25, num_splits=s, dropout_p=dropout_p, dropout_seed=9)
    o64, lse64 = reference_sparse_attention(
        q.double(), k.double(), v.double(), idx, scale=0.25, dropout_p=dropout_p, dropout_seed=9
    )
    for s in (2, 8):
        assert rel_err(outs[s][0], outs[1][0]) < 1e-6
        assert rel_err(outs[s][1], outs[1][1]) < 1e-6
    for s in (1, 2, 8):
        assert rel_err(outs[s][0], o64) < 1e-5


def test_rejects_bad_input():
    B, HQ, HKV, N, D = 1, 2, 1, 32, 16
    idx = random_index(B, HKV, N, 16, 16, 1, 1, 0, seed=0, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, device=DEV)
    with pytest.raises(ValueError, match="N"):
        triton_sparse_attention(q[:, :, :16], k[:, :, :16], v[:, :, :16], idx)
    with pytest.raises(ValueError, match="head dim"):
        q3, k3, v3 = make_qkv(B, HQ, HKV, N, 24, torch.float32, device=DEV)
        triton_sparse_attention(q3, k3, v3, idx)
    with pytest.raises(ValueError):
        triton_sparse_attention(q.double(), k.double(), v.double(), idx)
    with pytest.raises(ValueError, match="dropout"):
        triton_sparse_attention(q, k, v, idx, dropout_p=1.0)
    with pytest.raises(ValueError, match="multiple"):
        q3, k3, v3 = make_qkv(B, 3, 2, N, D, torch.float32, device=DEV)
        triton_sparse_attention(q3, k3, v3, BlockIndex.full(1, 2, N, 16, 16, device=DEV))
    support = triton_supports(q.to(torch.bfloat16), idx.block_q, idx.block_k)
    if DEV == "cpu":
        assert not support.ok and support.code == "unsupported_dtype" and "bfloat16" in support.message


def test_opcheck_fake_impl():
    """Schema, fake (meta) impl and autograd registration of the custom op (torch.library.opcheck)."""
    from sparse_train.plan.plan import cold_slots
    from sparse_train.plan.tuning import backward_config, forward_config

    B, HQ, HKV, N, D = 1, 2, 1, 48, 16
    idx = random_index(B, HKV, N, 16, 16, 1, 1, 1, seed=2, device=DEV)
    plan = idx.plan(2)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, device=DEV)
    q.requires_grad_()
    slots = cold_slots(plan.hot, plan.reuse, False)
    launch_config = [*forward_config(HQ // HKV, 16, 16, D), *backward_config(HQ // HKV, 16, 16, D, plan.num_cold > 0)]
    args = (
        q,
        k,
        v,
        idx.indices,
        idx.counts,
        plan.kv_indptr,
        plan.kv_qblocks,
        slots,
        None,
        plan.num_cold,
        16,
        16,
        0.25,
        0.0,
        0,
        1,
        launch_config,
    )
    torch.library.opcheck(
        torch.ops.sparse_train.sparse_attn_fwd.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_launcher_clamps_unvalidated_seq_lens():
    """The launchers take seq_lens unvalidated (e.g. under torch.compile, where the range check is
    skipped); values are clamped to [0, N] on the device, so a masked load can never reach past the
    end of K/V (the last key block of N = 70 extends to 80)."""
    B, HQ, HKV, N, D = 2, 2, 1, 70, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=61, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=61, device=DEV)
    wild = torch.tensor([N + 10**6, -5], device=DEV)
    sane = torch.tensor([N, 0], device=DEV)
    got = _run_launcher(q, k, v, idx, scale=0.25, seq_lens=wild)
    want = _run_launcher(q, k, v, idx, scale=0.25, seq_lens=sane)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.all(got[0][1] == 0) and torch.all(torch.isneginf(got[1][1]))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_opcheck_on_gpu():
    from sparse_train.plan.plan import cold_slots
    from sparse_train.plan.tuning import backward_config, forward_config

    B, HQ, HKV, N, D = 1, 4, 2, 512, 64
    idx = random_index(B, HKV, N, 64, 64, 3, 2, 1, seed=9, device="cuda")
    plan = idx.plan(2)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float16, seed=9, device="cuda", requires_grad=True)
    slots = cold_slots(plan.hot, plan.reuse, False)
    launch_config = [*forward_config(HQ // HKV, 64, 64, D), *backward_config(HQ // HKV, 64, 64, D, plan.num_cold > 0)]
    args = (
        q,
        k,
        v,
        idx.indices,
        idx.counts,
        plan.kv_indptr,
        plan.kv_qblocks,
        slots,
        None,
        plan.num_cold,
        64,
        64,
        0.125,
        0.0,
        0,
        1,
        launch_config,
    )
    torch.library.opcheck(
        torch.ops.sparse_train.sparse_attn_fwd.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1], ids=["seed-2^63", "seed-2^64-1"])
def test_dropout_bits_at_the_top_of_the_seed_domain(seed):
    """The u64 seed path of the kernels gives the reference's keep bits exactly: with q = 0 (uniform P)
    and V = identity, o[b, h, q, j] > 0 iff key j was kept."""
    B, HQ, HKV, N, D, p = 1, 4, 2, 128, 64, 0.3
    idx = BlockIndex.full(B, HKV, N, 64, 64, device="cuda")
    q = torch.zeros(B, HQ, N, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, HKV, N, D, device="cuda", dtype=torch.float16)
    v = torch.eye(N, D, device="cuda", dtype=torch.float16).expand(B, HKV, N, D).contiguous()
    o, _ = triton_sparse_attention(q, k, v, idx, dropout_p=p, dropout_seed=seed)
    pos = torch.arange(N, device="cuda")
    keep = dropout_keep_mask(
        seed,
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device="cuda"),
        torch.arange(HQ, device="cuda").view(1, HQ, 1, 1),
        pos.view(1, 1, N, 1),
        pos.view(1, 1, 1, N),
        HQ,
        N,
        p,
    ) & (pos.view(1, 1, 1, N) <= pos.view(1, 1, N, 1))
    got = o > 0
    assert torch.equal(got, keep[..., :D]), f"{(got != keep[..., :D]).sum().item()} keep bits differ"
