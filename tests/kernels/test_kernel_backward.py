"""Backward Triton kernels (dQ query-centric, hybrid atomic / KV-centric dK,dV, deterministic mode)
vs the PyTorch reference in fp64 (CPU: Triton interpreter, fp32); the forward + backward GPU tests
(marker ``gpu``: real sizes in bf16/fp16 against the reference in fp32 on the GPU).

Tolerance: err(kernel vs reference) <= c * err(PyTorch reference in the kernel's dtype vs reference) +
floor, c = 4 on the interpreter (fp64 reference), c = 3 on the GPU (fp32 reference).
"""

import os

import pytest
import torch
from builders import check_close, make_qkv, random_index, rel_err

from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import reference_sparse_attention

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from sparse_train.kernels.triton import backward as kb  # noqa: E402
from sparse_train.kernels.triton import op as kop  # noqa: E402
from sparse_train.kernels.triton.op import triton_sparse_attention  # noqa: E402
from sparse_train.plan import plan as plan_mod  # noqa: E402
from sparse_train.plan import tuning  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("poison_fresh_outputs", "small_kv_chunks")  # conftest.py


def _grads(fn, q, k, v, do, dlse_w=0.0):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(qs, ks, vs)
    loss = (o * do).sum()
    if dlse_w:
        loss = loss + dlse_w * torch.where(torch.isfinite(lse), lse, 0).sum()
    return torch.autograd.grad(loss, (qs, ks, vs))


def _compare(idx, q, k, v, *, dtype, dlse_w=0.0, kernel_options=None, **kw):
    """Gradients of the Triton op (``kw`` and ``kernel_options``) against the fp64 reference (``kw``)."""
    ref_kw = {x: kw[x] for x in ("dropout_p", "dropout_seed", "seq_lens") if x in kw}
    kw["kernel_options"] = kernel_options
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(99)).to(q)
    g = _grads(lambda a, b, c: triton_sparse_attention(a, b, c, idx, **kw), q, k, v, do, dlse_w)
    g64 = _grads(
        lambda a, b, c: reference_sparse_attention(a, b, c, idx, **ref_kw),
        q.double(),
        k.double(),
        v.double(),
        do.double(),
        dlse_w,
    )
    glp = _grads(lambda a, b, c: reference_sparse_attention(a, b, c, idx, upcast=False, **ref_kw), q, k, v, do, dlse_w)
    for name, a, r, l in zip(("dq", "dk", "dv"), g, g64, glp):
        assert not torch.isnan(a).any(), f"{name} has NaN (unwritten or 0/0)"
        check_close(name, a, r, l, dtype)
    return g


BWD_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, topk, window, sinks, r0, dropout_p
    pytest.param(1, 4, 2, 150, 16, 32, 16, 3, 1, 1, 1, 0.0, id="gqa2-odd150-bq32-bk16-r0_1-allKV"),
    pytest.param(1, 4, 2, 150, 16, 16, 32, 3, 1, 1, 3, 0.0, id="gqa2-odd150-bq16-bk32-r0_mid-hybrid"),
    pytest.param(1, 4, 1, 120, 16, 16, 16, 3, 2, 1, 10**6, 0.0, id="gqa4-odd120-r0_huge-allatomic"),
    pytest.param(2, 2, 2, 97, 32, 16, 16, 2, 1, 1, 3, 0.25, id="mha-b2-odd97-r0_mid-dropout"),
    pytest.param(1, 4, 2, 128, 64, 64, 64, 2, 1, 1, 2, 0.1, id="gqa2-d64-b64-dropout"),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,topk,window,sinks,r0,dropout_p", BWD_CASES)
def test_backward_vs_fp64_reference(B, HQ, HKV, N, D, BQ, BK, topk, window, sinks, r0, dropout_p):
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N + BQ, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    _compare(idx, q, k, v, dtype=torch.float32, dropout_p=dropout_p, dropout_seed=77, kernel_options={"r0": r0})


@pytest.mark.parametrize("r0", [1, 10**6], ids=["hot-kv-centric-chunked", "cold-atomics"])
def test_block_selected_by_every_query_block(r0):
    """Key block 0 (sink) and, with a full index, every early block is selected by many query
    blocks: the worst case for atomics (r0 huge) and the chunked KV-centric path (r0 = 1)."""
    B, HQ, HKV, N, D = 1, 2, 1, 128, 16
    idx = BlockIndex.full(B, HKV, N, block_q=16, block_k=16, device=DEV)
    assert int(idx.plan(1).max_reuse) == 8
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=4, device=DEV)
    _compare(idx, q, k, v, dtype=torch.float32, kernel_options={"r0": r0})


def test_fp16_backward():
    idx = random_index(1, 1, 80, 16, 16, 2, 1, 1, seed=8, device=DEV)
    q, k, v = make_qkv(1, 2, 1, 80, 16, torch.float16, seed=8, device=DEV)
    _compare(idx, q, k, v, dtype=torch.float16, kernel_options={"r0": 2})


def test_lse_gradient_and_seq_lens():
    B, HQ, HKV, N, D = 2, 2, 1, 70, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=6, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=6, device=DEV)
    _compare(
        idx,
        q,
        k,
        v,
        dtype=torch.float32,
        dlse_w=0.3,
        seq_lens=torch.tensor([70, 41], device=DEV),
        kernel_options={"r0": 2},
    )


def test_empty_rows_have_zero_grads():
    B, HQ, HKV, N, D = 1, 2, 1, 64, 16
    mask = torch.zeros(B, HKV, 4, 4, dtype=torch.bool)
    mask[0, 0, 2, :3] = True
    idx = BlockIndex.from_dense(mask.to(DEV), seq_len=N, block_q=16, block_k=16)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=2, device=DEV)
    dq, dk, dv = _compare(idx, q, k, v, dtype=torch.float32, kernel_options={"r0": 1})
    assert (dq[:, :, :32] == 0).all() and (dq[:, :, 48:] == 0).all()
    assert (dk[:, :, 48:] == 0).all() and (dv[:, :, 48:] == 0).all()


def test_split_forward_then_backward():
    idx = random_index(1, 1, 96, 16, 16, 4, 1, 1, seed=12, device=DEV)
    q, k, v = make_qkv(1, 2, 1, 96, 16, torch.float32, seed=12, device=DEV)
    _compare(idx, q, k, v, dtype=torch.float32, kernel_options={"num_splits": 4, "r0": 2})


def test_deterministic_bitwise_and_auto_switch(monkeypatch):
    B, HQ, HKV, N, D = 1, 4, 2, 96, 16
    idx = random_index(B, HKV, N, 16, 16, 3, 1, 1, seed=21, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=21, device=DEV)
    do = torch.randn_like(q)
    seen = []
    real = kop.sparse_attn_backward

    def spy(*args, **kw):
        seen.append(args[11])  # num_cold
        return real(*args, **kw)

    monkeypatch.setattr(kop, "sparse_attn_backward", spy)
    f = lambda a, b, c: triton_sparse_attention(a, b, c, idx, deterministic=True, kernel_options={"r0": 4})  # noqa: E731
    g1, g2 = _grads(f, q, k, v, do), _grads(f, q, k, v, do)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert seen == [0, 0]
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        g3 = _grads(lambda a, b, c: triton_sparse_attention(a, b, c, idx, kernel_options={"r0": 4}), q, k, v, do)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert seen[-1] == 0, "use_deterministic_algorithms must route every block KV-centric"
    for a, b in zip(g1, g3):
        assert torch.equal(a, b)
    g4 = _grads(lambda a, b, c: triton_sparse_attention(a, b, c, idx, kernel_options={"r0": 4}), q, k, v, do)
    assert seen[-1] > 0, "default mode at r0=4 should use the atomic path for cold blocks"
    for a, b in zip(g1, g4):
        assert rel_err(a, b) < 1e-5


def test_kernel_options_reach_the_launchers_and_keep_the_result(monkeypatch):
    """Every tile option travels through the custom op to its launcher; other tiles (stacked heads in
    the dQ and KV-centric kernels, one-block chunks, split rows) give the same function."""
    from sparse_train.plan.tuning import BackwardConfig, ForwardConfig

    B, HQ, HKV, N, D = 1, 4, 1, 96, 16
    idx = random_index(B, HKV, N, 16, 16, 3, 1, 1, seed=23, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=23, device=DEV)
    seen = {}
    real_fwd, real_bwd = kop.sparse_attn_forward, kop.sparse_attn_backward

    def fwd(*args, **kw):
        seen["fwd"] = (kw["config"], kw["num_splits"])
        return real_fwd(*args, **kw)

    def bwd(*args, **kw):
        seen["bwd"] = kw["config"]
        return real_bwd(*args, **kw)

    monkeypatch.setattr(kop, "sparse_attn_forward", fwd)
    monkeypatch.setattr(kop, "sparse_attn_backward", bwd)
    options = dict(
        r0=2,
        num_splits=2,
        fwd_heads_per_program=2,
        fwd_num_warps=2,
        fwd_num_stages=1,
        dq_heads_per_program=4,
        dq_num_warps=2,
        dq_num_stages=1,
        kv_heads_per_program=2,
        kv_num_warps=2,
        kv_num_stages=1,
        kv_chunk=1,
        kv_tile_rows=16,
        fwd_tma=False,
        dq_tma=True,
        kv_tma=False,
    )
    _compare(idx, q, k, v, dtype=torch.float32, kernel_options=options)
    assert seen["fwd"] == (ForwardConfig(2, 2, 1, tma_loads=0, gluon_heads_per_program=2), 2)
    assert seen["bwd"] == BackwardConfig(
        4, 2, 1, 2, 2, 1, 1, 16, fused_dq=0, dq_tma=1, kv_tma=0, dq_gluon_heads_per_program=4
    )


TILE_ROW_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, kv_heads_per_program, kv_tile_rows, dropout_p, seq_lens
    pytest.param(1, 4, 2, 150, 16, 32, 16, 1, 16, 0.0, None, id="gqa2-odd150-bq32-two-slices"),
    pytest.param(1, 4, 1, 97, 16, 16, 32, 2, 16, 0.2, None, id="gqa4-odd97-stacked2-slice-per-head-dropout"),
    pytest.param(2, 4, 1, 111, 32, 32, 16, 2, 16, 0.0, [111, 70], id="gqa4-b2-stacked2-four-slices-seq_lens"),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,heads,tile_rows,dropout_p,seq_lens", TILE_ROW_CASES)
def test_kv_centric_row_slices_match_the_reference(B, HQ, HKV, N, D, BQ, BK, heads, tile_rows, dropout_p, seq_lens):
    """The KV-centric kernel walking each query tile in slices of kv_tile_rows rows (slices inside one
    head, one per head, and across a head boundary of stacked heads) gives the reference's dK/dV; every
    block KV-centric (r0 = 1), chunked rows included."""
    idx = random_index(B, HKV, N, BQ, BK, 3, 1, 1, seed=N + BQ, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    _compare(
        idx,
        q,
        k,
        v,
        dtype=torch.float32,
        dropout_p=dropout_p,
        dropout_seed=5,
        seq_lens=lens,
        kernel_options={"r0": 1, "kv_heads_per_program": heads, "kv_tile_rows": tile_rows, "kv_chunk": 2},
    )


FUSED_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, kv_heads_per_program, kv_tile_rows, dropout_p, seq_lens, dlse_w
    pytest.param(1, 4, 2, 150, 16, 32, 16, 1, None, 0.0, None, 0.0, id="gqa2-odd150-bq32-bk16"),
    pytest.param(1, 4, 1, 97, 16, 16, 32, 2, 16, 0.2, None, 0.0, id="gqa4-odd97-stacked2-slices-dropout"),
    pytest.param(2, 4, 1, 111, 32, 32, 16, 2, 16, 0.0, [111, 70], 0.5, id="gqa4-b2-seq_lens-lse-grad"),
    pytest.param(2, 2, 2, 97, 32, 16, 16, 1, None, 0.25, None, 0.0, id="mha-b2-odd97-dropout"),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,heads,tile_rows,dropout_p,seq_lens,dlse_w", FUSED_CASES)
def test_fused_backward_matches_the_reference(
    B, HQ, HKV, N, D, BQ, BK, heads, tile_rows, dropout_p, seq_lens, dlse_w, monkeypatch
):
    """``kernel_options.fused_dq``: the KV-centric kernel adds dQ by atomics and the dQ kernel never runs; dQ, dK
    and dV against the fp64 reference, with stacked heads, row slices, chunked rows, dropout, padding and an
    lse gradient."""
    launched = []
    real_launch = kb.launch
    monkeypatch.setattr(kb, "launch", lambda kernel, *a, **kw: launched.append(kernel) or real_launch(kernel, *a, **kw))
    idx = random_index(B, HKV, N, BQ, BK, 3, 1, 1, seed=N + BQ, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    _compare(
        idx,
        q,
        k,
        v,
        dtype=torch.float32,
        dlse_w=dlse_w,
        dropout_p=dropout_p,
        dropout_seed=5,
        seq_lens=lens,
        kernel_options={"fused_dq": True, "kv_heads_per_program": heads, "kv_tile_rows": tile_rows, "kv_chunk": 2},
    )
    assert kb._dkdv_kernel in launched and kb._dq_kernel not in launched


@pytest.mark.parametrize("dq_mode", [{"fused_dq": True}, {"stored_ds": True}], ids=["fused-dq", "stored-ds"])
def test_dq_from_the_kv_centric_kernel_is_zero_for_empty_rows(dq_mode):
    """Query blocks that select nothing get dQ = 0: in fused mode the float32 buffer starts at zero and no program
    adds to it; in stored-dS mode the dQ pass reads no tile for them (NaN-poisoned outputs: it writes them)."""
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=3, device=DEV)
    indices = torch.full((1, 1, 4, 2), -1, dtype=torch.int32, device=DEV)
    indices[0, 0, 1, 0], indices[0, 0, 3, :] = 0, torch.tensor([1, 3], dtype=torch.int32)
    counts = (indices >= 0).sum(-1).to(torch.int32)
    idx = BlockIndex(indices=indices, counts=counts, seq_len=64, block_q=16, block_k=16)
    dq, _, _ = _compare(idx, q, k, v, dtype=torch.float32, kernel_options=dq_mode)
    assert torch.count_nonzero(dq[:, :, 0:16]) == 0 and torch.count_nonzero(dq[:, :, 32:48]) == 0


def test_fused_backward_refuses_deterministic():
    idx = random_index(1, 1, 64, 16, 16, 2, 1, 1, seed=1, device=DEV)
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=1, device=DEV)
    with pytest.raises(ValueError, match="fused_dq sums dQ with atomics in no fixed order"):
        triton_sparse_attention(q, k, v, idx, deterministic=True, kernel_options={"fused_dq": True})
    with pytest.raises(ValueError, match="kernel_options.fused_dq must be a bool"):
        triton_sparse_attention(q, k, v, idx, kernel_options={"fused_dq": 1})
    from sparse_train import sparse_attention

    for backend in ("triton", "reference"):  # the same refusal on both backends, also when asked globally
        with pytest.raises(ValueError, match="fused_dq sums dQ with atomics"):
            sparse_attention(q, k, v, idx, deterministic=True, backend=backend, kernel_options={"fused_dq": True})
        torch.use_deterministic_algorithms(True)
        try:
            with pytest.raises(ValueError, match="fused_dq sums dQ with atomics"):
                sparse_attention(q, k, v, idx, backend=backend, kernel_options={"fused_dq": True})
        finally:
            torch.use_deterministic_algorithms(False)


STORED_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, kv_heads_per_program, kv_tile_rows, dropout_p, seq_lens, dlse_w
    pytest.param(1, 4, 2, 150, 16, 32, 16, 1, None, 0.0, None, 0.0, id="gqa2-odd150-bq32-bk16"),
    pytest.param(1, 4, 2, 150, 16, 32, 16, 1, 16, 0.0, None, 0.0, id="gqa2-odd150-bq32-slices16-tma-store-offsets"),
    pytest.param(1, 4, 1, 97, 16, 16, 32, 2, 16, 0.2, None, 0.0, id="gqa4-odd97-bk32-stacked2-slices-dropout"),
    pytest.param(2, 4, 1, 111, 32, 32, 16, 2, 16, 0.0, [111, 70], 0.5, id="gqa4-b2-seq_lens-lse-grad"),
    pytest.param(2, 2, 2, 97, 32, 16, 16, 1, None, 0.25, None, 0.0, id="mha-b2-odd97-dropout"),
]


def _launches(monkeypatch, meta=None):
    """Record every kernel the backward launcher launches (and, into ``meta``, the constexprs of each)."""
    launched = []
    real_launch = kb.launch

    def spy(kernel, *a, **kw):
        launched.append(kernel)
        if meta is not None:
            meta[kernel] = kw
        return real_launch(kernel, *a, **kw)

    monkeypatch.setattr(kb, "launch", spy)
    return launched


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,heads,tile_rows,dropout_p,seq_lens,dlse_w", STORED_CASES)
def test_stored_ds_backward_matches_the_reference(
    B, HQ, HKV, N, D, BQ, BK, heads, tile_rows, dropout_p, seq_lens, dlse_w, monkeypatch
):
    """``kernel_options.stored_ds``: the KV-centric kernel files every dS tile and the dQ pass reads them (the
    recomputing dQ kernel never runs); dQ, dK and dV against the fp64 reference, with stacked heads, row slices,
    chunked rows (kv_chunk 2), dropout, padding and an lse gradient. dK and dV come from the same KV-centric
    kernel as in deterministic mode, so they are bitwise those of that mode. One head per step files dS through
    a TMA descriptor (the interpreter emulates it), stacked heads by pointer stores."""
    meta = {}
    launched = _launches(monkeypatch, meta)
    idx = random_index(B, HKV, N, BQ, BK, 3, 1, 1, seed=N + BQ, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    tiles = {"kv_heads_per_program": heads, "kv_tile_rows": tile_rows, "kv_chunk": 2}
    kw = dict(dtype=torch.float32, dlse_w=dlse_w, dropout_p=dropout_p, dropout_seed=5, seq_lens=lens)
    _, dk, dv = _compare(idx, q, k, v, kernel_options={"stored_ds": True, **tiles}, **kw)
    assert kb._dkdv_kernel in launched and kb._dq_from_ds_kernel in launched and kb._dq_kernel not in launched
    assert meta[kb._dkdv_kernel]["STORE_DS"] and meta[kb._dkdv_kernel]["TMA_STORE_DS"] == (heads == 1)
    _, dk_det, dv_det = _compare(idx, q, k, v, deterministic=True, kernel_options=tiles, **kw)
    assert torch.equal(dk, dk_det) and torch.equal(dv, dv_det)


def test_stored_ds_backward_is_allowed_with_deterministic():
    """``deterministic=True`` accepts the stored-dS backward (it has no atomics) and runs the same path: the same
    bits as without the flag. (The interpreter runs programs in order, so run-to-run reproducibility itself is
    checked on the GPU: ``test_stored_ds_backward_on_gpu``.)"""
    idx = random_index(1, 2, 130, 16, 16, 4, 1, 1, seed=7, device=DEV)
    q, k, v = make_qkv(1, 4, 2, 130, 16, torch.float32, seed=7, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    runs = [
        _grads(
            lambda a, b, c: triton_sparse_attention(
                a, b, c, idx, deterministic=det, kernel_options={"stored_ds": True, "kv_chunk": 2}
            ),
            q,
            k,
            v,
            do,
        )
        for det in (False, True)
    ]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_stored_ds_refuses_fused_dq_and_a_missing_pair_map():
    idx = random_index(1, 1, 64, 16, 16, 2, 1, 1, seed=1, device=DEV)
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=1, device=DEV)
    with pytest.raises(ValueError, match="fused_dq and kernel_options.stored_ds are two ways"):
        triton_sparse_attention(q, k, v, idx, kernel_options={"fused_dq": True, "stored_ds": True})
    with pytest.raises(ValueError, match="kernel_options.stored_ds must be a bool"):
        triton_sparse_attention(q, k, v, idx, kernel_options={"stored_ds": "yes"})
    o, lse = triton_sparse_attention(q, k, v, idx)
    plan = idx.plan(1)
    config = tuning.backward_config(2, 16, 16, 16, False, {"stored_ds": True})
    args = (
        torch.ones_like(o),
        q,
        k,
        v,
        o,
        lse,
        idx.indices,
        idx.counts,
        plan.kv_indptr,
        plan.kv_qblocks,
        plan_mod.cold_slots(plan.hot, plan.reuse, True),
        0,
    )
    with pytest.raises(ValueError, match="needs the plan's kv_pairs"):
        kb.sparse_attn_backward(*args, block_q=16, block_k=16, scale=0.25, config=config)
    with pytest.raises(ValueError, match="fused_dq and config.stored_ds are two ways"):
        kb.sparse_attn_backward(
            *args, block_q=16, block_k=16, scale=0.25, config=config._replace(fused_dq=1), kv_pairs=plan.kv_pairs
        )


def test_plan_pairs_point_at_their_index_slots():
    """``BlockPlan.kv_pairs``: each transposed entry (key block j of row r, query block kv_qblocks[e]) names the
    index slot that holds j in that query block's row; -1 past the pairs."""
    idx = random_index(2, 2, 150, 16, 32, 3, 1, 1, seed=4, device=DEV)
    plan = idx.plan(1)
    flat = idx.indices.reshape(-1)
    nkb, nqb, cap = idx.num_k_blocks, idx.num_q_blocks, idx.capacity
    nnz = plan.nnz
    for row in range(plan.kv_indptr.numel() - 1):
        for e in range(int(plan.kv_indptr[row]), int(plan.kv_indptr[row + 1])):
            slot = int(plan.kv_pairs[e])
            assert int(flat[slot]) == row % nkb, (row, e)
            assert slot // cap == (row // nkb) * nqb + int(plan.kv_qblocks[e])
    assert (plan.kv_pairs[nnz:] == -1).all() and plan.kv_pairs.numel() == flat.numel()


def test_caller_index_mutation_after_forward_does_not_change_grads():
    B, HQ, HKV, N, D = 1, 2, 1, 80, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=31, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=31, device=DEV)
    do = torch.randn_like(q)
    g_ref = _grads(lambda a, b, c: triton_sparse_attention(a, b, c, idx, kernel_options={"r0": 2}), q, k, v, do)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, _ = triton_sparse_attention(qs, ks, vs, idx, kernel_options={"r0": 2})
    idx.indices.fill_(0)  # caller scribbles over its index between forward and backward
    idx.counts.fill_(1)
    g = torch.autograd.grad(o, (qs, ks, vs), do)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ strides and stale state
def test_strided_seq_lens_column():
    """seq_lens = t[:, 0] of an int32 [B, 2] tensor (stride 2) is read with its stride (read as
    contiguous, outputs are off by ~70%). Forward and backward against the fp64 reference."""
    B, HQ, HKV, N, D = 3, 2, 1, 80, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=41, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=41, device=DEV)
    table = torch.tensor([[80, 5], [33, 5], [57, 5]], dtype=torch.int32, device=DEV)
    lens = table[:, 0]
    assert not lens.is_contiguous()
    o, lse = triton_sparse_attention(q, k, v, idx, seq_lens=lens)
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx, seq_lens=lens)
    olp, lselp = reference_sparse_attention(q, k, v, idx, seq_lens=lens, upcast=False)
    check_close("o", o, o64, olp, torch.float32)
    check_close("lse", lse, lse64, lselp, torch.float32)
    _compare(idx, q, k, v, dtype=torch.float32, seq_lens=lens, kernel_options={"r0": 2})


@pytest.mark.parametrize("used", ["o", "lse", "both"])
def test_direct_eager_call_equals_the_custom_op(monkeypatch, used):
    """Eager calls on plain tensors bypass the custom op's dispatch (kernels/triton/op.py, _EagerSparseAttention): same
    launchers, so bitwise the same outputs and gradients as through the op, whichever outputs the loss uses
    (an unused lse gives dlse = None directly, zeros through the op)."""
    idx = random_index(1, 2, 100, 16, 16, 2, 1, 1, seed=5, device=DEV)
    q, k, v = make_qkv(1, 4, 2, 100, 16, torch.float32, seed=5, device=DEV)
    do = torch.randn_like(q)
    applied = []
    real_apply = torch.autograd.Function.apply.__func__
    monkeypatch.setattr(
        kop._EagerSparseAttention, "apply", classmethod(lambda cls, *a: applied.append(1) or real_apply(cls, *a))
    )

    def run(direct):
        monkeypatch.setattr(kop, "_direct_call", lambda *t: direct)
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, lse = triton_sparse_attention(qs, ks, vs, idx, deterministic=True)
        finite_lse = torch.where(torch.isfinite(lse), lse, 0)
        loss = {"o": (o * do).sum(), "lse": finite_lse.sum(), "both": (o * do).sum() + 0.5 * finite_lse.sum()}[used]
        return (o, lse, *torch.autograd.grad(loss, (qs, ks, vs)))

    through_op = run(False)
    assert not applied
    direct = run(True)
    assert applied == [1]
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), direct, through_op):
        assert torch.equal(a, b), name


def test_direct_call_only_outside_tracing_and_dispatch_modes():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv(1, 2, 1, 32, 16, torch.float32, seed=1, device=DEV)
    assert kop._direct_call(q, k, v)
    assert kop._direct_call(torch.nn.Parameter(q), k, v)
    idx = random_index(1, 1, 32, 16, 16, 1, 1, 0, seed=1, device=DEV)
    with Names() as mode:  # e.g. selective checkpointing, which keeps the op's outputs by its name
        assert not kop._direct_call(q, k, v)
        triton_sparse_attention(q, k, v, idx)
    assert "sparse_train.sparse_attn_fwd.default" in mode.names


def test_output_and_gradients_keep_the_projection_layout():
    """o comes back as a view of [B, N, HQ, D] memory, so ``o.transpose(1, 2).reshape(B, N, HQ * D)`` (the
    output projection's input) is a view, not a copy; dq / dk / dv take the layouts of q / k / v, so inputs that
    are the transposed [B, N, H, D] views of a projection get their gradients back without a copy either.
    The values still equal the fp64 reference."""
    B, HQ, HKV, N, D = 2, 4, 2, 70, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=5, device=DEV)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, h, D, generator=g).to(DEV).transpose(1, 2).requires_grad_() for h in (HQ, HKV, HKV))
    o, _ = triton_sparse_attention(q, k, v, idx)
    flat = o.transpose(1, 2).reshape(B, N, HQ * D)
    assert flat.data_ptr() == o.data_ptr() and flat.is_contiguous()
    do = torch.randn(B, N, HQ * D, generator=g).to(DEV)
    grads = torch.autograd.grad(flat, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, _ = reference_sparse_attention(q64, k64, v64, idx)
    grads64 = torch.autograd.grad(o64.transpose(1, 2).reshape(B, N, HQ * D), (q64, k64, v64), do.double())
    assert rel_err(o, o64) < 1e-5
    for name, grad, grad64, x in zip(("dq", "dk", "dv"), grads, grads64, (q, k, v)):
        assert grad.stride() == x.stride(), f"{name} strides {grad.stride()} differ from its input's {x.stride()}"
        assert rel_err(grad, grad64) < 1e-5, name


def _strided(t, filler):
    """The same values in a non-contiguous tensor (stride 2 in every dim, `filler` in between), so a
    kernel that ignores strides reads `filler`."""
    both = torch.stack([t, torch.full_like(t, filler)], dim=-1)
    out = both[..., 0]
    assert torch.equal(out, t) and (t.numel() <= 1 or not out.is_contiguous())
    return out


# argument of a launcher -> filler value that is in range (a stride bug reads it instead of the value)
LAUNCHER_ARGS = ["seq_lens", "indices", "counts", "kv_indptr", "kv_qblocks", "slots", "lse", "o", "do", "dlse"]
FILLERS = {
    "seq_lens": 5,
    "indices": 0,
    "counts": 1,
    "kv_indptr": 0,
    "kv_qblocks": 0,
    "slots": -1,
    "lse": 0.0,
    "o": 0.0,
    "do": 0.0,
    "dlse": 0.0,
}


B_, HQ_, HKV_, N_, D_, BS_ = 2, 2, 1, 56, 16, 16


def _launch_all(args, strided=None):
    """Forward + backward launchers on `args`; `strided` names one argument (or output of the forward,
    "o" / "lse") to hand over as a strided copy."""
    from sparse_train.kernels.triton.forward import sparse_attn_forward

    a = dict(args)
    if strided in a:
        a[strided] = _strided(a[strided], FILLERS[strided])
    o, lse = sparse_attn_forward(
        a["q"],
        a["k"],
        a["v"],
        a["indices"],
        a["counts"],
        block_q=BS_,
        block_k=BS_,
        scale=0.25,
        seq_lens=a["seq_lens"],
        dropout_p=0.2,
        dropout_seed=3,
        num_splits=2,
    )
    if strided in ("o", "lse"):
        o, lse = (_strided(o, FILLERS["o"]), lse) if strided == "o" else (o, _strided(lse, FILLERS["lse"]))
    grads = kb.sparse_attn_backward(
        a["do"],
        a["q"],
        a["k"],
        a["v"],
        o,
        lse,
        a["indices"],
        a["counts"],
        a["kv_indptr"],
        a["kv_qblocks"],
        a["slots"],
        a["num_cold"],
        block_q=BS_,
        block_k=BS_,
        scale=0.25,
        seq_lens=a["seq_lens"],
        dlse=a["dlse"],
        dropout_p=0.2,
        dropout_seed=3,
    )
    return (o, lse, *grads)


@pytest.fixture(scope="module")
def launcher_baseline():
    idx = random_index(B_, HKV_, N_, BS_, BS_, 2, 1, 1, seed=43, device=DEV)
    plan = idx.plan(2)
    assert plan.num_cold > 0 and plan.num_hot > 0, "both dK/dV paths must run"
    q, k, v = make_qkv(B_, HQ_, HKV_, N_, D_, torch.float32, seed=43, device=DEV)
    g = torch.Generator().manual_seed(44)
    args = dict(
        q=q,
        k=k,
        v=v,
        seq_lens=torch.tensor([56, 37], dtype=torch.int32, device=DEV),
        indices=idx.indices,
        counts=idx.counts,
        kv_indptr=plan.kv_indptr,
        kv_qblocks=plan.kv_qblocks,
        slots=plan_mod.cold_slots(plan.hot, plan.reuse, False),
        num_cold=plan.num_cold,
        do=torch.randn(q.shape, generator=g).to(DEV),
        dlse=torch.randn(q.shape[:3], generator=g).to(DEV),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "KV_CHUNK", 2)
        return args, _launch_all(args)


@pytest.mark.parametrize("name", LAUNCHER_ARGS)
def test_launchers_honour_strides_of_every_tensor_argument(launcher_baseline, name):
    """Every tensor a launcher hands to a kernel is either passed with its strides or made contiguous:
    a strided copy of any argument gives bitwise the same forward and backward (seq_lens, kv_qblocks
    and slots included)."""
    args, want = launcher_baseline
    got = _launch_all(args, strided=name)
    for label, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{label} differs with a strided {name}"


def test_block_mass_launcher_honours_strides():
    from sparse_train.kernels.triton.block_mass import block_mass_launch

    B, HQ, HKV, N, D, BS = 2, 4, 2, 70, 16, 16
    idx = random_index(B, HKV, N, BS, BS, 3, 1, 1, seed=45, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=45, device=DEV)
    lens = torch.tensor([70, 37], dtype=torch.int32, device=DEV)
    _, lse = reference_sparse_attention(q, k, v, idx, seq_lens=lens)
    want = block_mass_launch(q, k, lse, idx.indices, idx.counts, block_q=BS, block_k=BS, scale=0.25, seq_lens=lens)
    got = block_mass_launch(
        q,
        k,
        _strided(lse, 0.0),
        _strided(idx.indices, 0),
        _strided(idx.counts, 1),
        block_q=BS,
        block_k=BS,
        scale=0.25,
        seq_lens=_strided(lens, 5),
    )
    assert torch.equal(got, want)


def test_from_canonical_buffer_rewritten_in_place_gives_fresh_gradients():
    """from_canonical caches no plan of its buffers: after buf.copy_(new) the gradients must equal
    those of an index built from `new` (a stale plan puts dK off by ~110%)."""
    B, HQ, HKV, N, D = 1, 2, 1, 96, 16
    a = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=51, device=DEV)
    b = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=52, device=DEV)
    assert a.indices.shape == b.indices.shape and not torch.equal(a.indices, b.indices)
    buf_i, buf_c = a.indices.clone(), a.counts.clone()
    idx = BlockIndex.from_canonical(buf_i, buf_c, seq_len=N, block_q=16, block_k=16)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=51, device=DEV)
    do = torch.randn_like(q)
    f = lambda i: lambda x, y, z: triton_sparse_attention(x, y, z, i, kernel_options={"r0": 2})  # noqa: E731
    for x, y in zip(_grads(f(idx), q, k, v, do), _grads(f(a), q, k, v, do)):
        assert torch.equal(x, y)
    buf_i.copy_(b.indices)
    buf_c.copy_(b.counts)
    for x, y in zip(_grads(f(idx), q, k, v, do), _grads(f(b), q, k, v, do)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "neg-inf"])
def test_nonfinite_padding_reaches_no_output_or_gradient(poison):
    """Keys/values past seq_lens are never loaded: outputs and gradients equal a clean-padding run."""
    B, HQ, HKV, N, D = 2, 2, 1, 64, 16
    idx = random_index(B, HKV, N, 16, 32, 2, 1, 1, seed=53, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=53, device=DEV)
    lens = torch.tensor([64, 45], device=DEV)
    do = torch.randn_like(q)

    def f(x, y, z):
        return triton_sparse_attention(
            x, y, z, idx, seq_lens=lens, dropout_p=0.1, dropout_seed=8, kernel_options={"r0": 2}
        )

    clean = _grads(f, q, k, v, do)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 45:] = poison
    v2[1, :, 45:] = poison
    dirty = _grads(f, q, k2, v2, do)
    for name, x, y in zip(("dq", "dk", "dv"), dirty, clean):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_caller_seq_lens_mutation_after_forward_does_not_change_grads(dtype):
    """seq_lens is copied at forward time like the index, int32 as well as int64."""
    B, HQ, HKV, N, D = 2, 2, 1, 64, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=33, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=33, device=DEV)
    do = torch.randn_like(q)
    lens = torch.tensor([64, 29], dtype=dtype, device=DEV)
    g_ref = _grads(lambda a, b, c: triton_sparse_attention(a, b, c, idx, seq_lens=lens), q, k, v, do)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, _ = triton_sparse_attention(qs, ks, vs, idx, seq_lens=lens)
    lens.fill_(3)
    g = torch.autograd.grad(o, (qs, ks, vs), do)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks
    pytest.param(2, 8, 2, 4099, 128, 64, 64, torch.bfloat16, 8, 4, 1, id="bf16-d128-b64-odd4099-gqa4"),
    pytest.param(1, 8, 8, 8192, 64, 128, 128, torch.float16, 6, 2, 1, id="fp16-d64-b128-8k-mha"),
    pytest.param(1, 8, 2, 5000, 128, 128, 64, torch.bfloat16, 8, 4, 1, id="bf16-d128-bq128-bk64-odd"),
    pytest.param(1, 4, 1, 3000, 64, 64, 128, torch.float16, 5, 2, 1, id="fp16-d64-bq64-bk128-gqa4"),
]


def _gpu_compare(idx, q, k, v, do, **kw):
    """Triton forward + backward against the reference in fp32 and in the inputs' dtype (c = 3)."""
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = triton_sparse_attention(qs, ks, vs, idx, **kw)
    grads = torch.autograd.grad(o, (qs, ks, vs), do)
    ref_kw = {x: kw[x] for x in ("dropout_p", "dropout_seed", "seq_lens") if x in kw}
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32, lse32 = reference_sparse_attention(q32, k32, v32, idx, **ref_kw)
    g32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ol, _ = reference_sparse_attention(ql, kl, vl, idx, upcast=False, **ref_kw)
    gl = torch.autograd.grad(ol, (ql, kl, vl), do)
    for name, a, r, l in zip(("o", "dq", "dk", "dv"), (o, *grads), (o32, *g32), (ol, *gl)):
        check_close(name, a, r, l, q.dtype, c=3.0, floor=1e-4)
    return o, lse, lse32, grads


@pytest.mark.gpu
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks", GPU_CASES)
def test_fused_backward_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks):
    """``kernel_options.fused_dq`` compiled for the GPU (float32 atomics into dQ, the dQ kernel skipped): o, dq,
    dk, dv against the fp32 reference at real sizes."""
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    _gpu_compare(idx, q, k, v, do, kernel_options={"fused_dq": True})


@pytest.mark.gpu
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks", GPU_CASES)
def test_stored_ds_backward_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks):
    """``kernel_options.stored_ds`` compiled for the GPU (dS filed by the KV-centric kernel, dQ from it): o, dq,
    dk, dv against the fp32 reference at real sizes, dropout on; dK/dV bitwise those of deterministic mode; all
    three gradients bitwise equal run to run (no atomics)."""
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    kw = dict(dropout_p=0.1, dropout_seed=3)
    _, _, _, (dq, dk, dv) = _gpu_compare(idx, q, k, v, do, kernel_options={"stored_ds": True}, **kw)
    _, _, _, (_, dk_det, dv_det) = _gpu_compare(idx, q, k, v, do, deterministic=True, **kw)
    assert torch.equal(dk, dk_det) and torch.equal(dv, dv_det)
    _, _, _, again = _gpu_compare(idx, q, k, v, do, kernel_options={"stored_ds": True}, **kw)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again)), "stored-dS gradients differ run to run"


@pytest.mark.gpu
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks", GPU_CASES)
def test_forward_backward_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks):
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    o, lse, lse32, _ = _gpu_compare(idx, q, k, v, do)
    assert torch.isfinite(o).all()
    fin = torch.isfinite(lse32)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - lse32[fin]).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_long_sequence_131072_forward_backward():
    """N = 131072 (int64 dropout counters and addressing past 2^31 elements of the score space)."""
    B, HQ, HKV, N, D, BQ, BK = 1, 4, 1, 131072, 128, 128, 128
    idx = random_index(B, HKV, N, BQ, BK, 8, 4, 1, seed=1, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.bfloat16, seed=1, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q)
    _gpu_compare(idx, q, k, v, do, dropout_p=0.1, dropout_seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("r0", [1, 4, 10**6], ids=["r0-1", "r0-4", "r0-huge"])
def test_bitwise_determinism_and_hybrid_agree(r0):
    B, HQ, HKV, N, D = 1, 16, 4, 16384, 128
    idx = random_index(B, HKV, N, 64, 64, 16, 8, 1, seed=3, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.bfloat16, seed=3, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)

    def grads(det):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = triton_sparse_attention(qs, ks, vs, idx, deterministic=det, kernel_options={"r0": r0})
        return torch.autograd.grad(o, (qs, ks, vs), do)

    a, b = grads(True), grads(True)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic mode must be bitwise reproducible"
    h = grads(False)
    for x, y in zip(a, h):
        assert rel_err(x, y) < 1e-2


@pytest.mark.gpu
def test_torch_compile_no_graph_break():
    B, HQ, HKV, N, D = 1, 8, 2, 4096, 128
    idx = random_index(B, HKV, N, 64, 64, 8, 4, 1, seed=5, device="cuda")
    plan = idx.plan(4)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.bfloat16, seed=5, device="cuda")

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
        assert rel_err(x, y) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [2**63 + 12345, 2**64 - 1], ids=["seed-2^63+12345", "seed-2^64-1"])
def test_strided_seq_lens_nan_padding_and_top_seeds_on_gpu(seed):
    """On the GPU: seq_lens as a strided int32 column (the kernels index it without a stride),
    NaN in k/v past it (never loaded), and dropout seeds at the top of [0, 2**64) (a u64 kernel
    argument): forward and backward against the fp32 reference on the clean inputs."""
    B, HQ, HKV, N, D, cut = 2, 8, 2, 2051, 64, 1300
    idx = random_index(B, HKV, N, 64, 64, 6, 2, 1, seed=11, device="cuda")
    lens = torch.tensor([[N, 7], [cut, 7]], dtype=torch.int32, device="cuda")[:, 0]
    assert not lens.is_contiguous()
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.bfloat16, seed=11, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(q)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[1, :, cut:] = float("nan")
    v_nan[1, :, cut:] = float("nan")
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k_nan, v_nan))
    o, _ = triton_sparse_attention(qs, ks, vs, idx, seq_lens=lens, dropout_p=0.1, dropout_seed=seed)
    grads = torch.autograd.grad(o, (qs, ks, vs), do)
    for t in (o, *grads):
        assert torch.isfinite(t).all()
    kw = dict(seq_lens=lens, dropout_p=0.1, dropout_seed=seed)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    o32, _ = reference_sparse_attention(q32, k32, v32, idx, **kw)
    g32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ol, _ = reference_sparse_attention(ql, kl, vl, idx, upcast=False, **kw)
    gl = torch.autograd.grad(ol, (ql, kl, vl), do)
    for name, a, r, l in zip(("o", "dq", "dk", "dv"), (o, *grads), (o32, *g32), (ol, *gl)):
        check_close(name, a, r, l, torch.bfloat16, c=3.0, floor=1e-4)


EMPTY_BATCH_CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"seq_lens": torch.zeros(0, dtype=torch.int64)}, id="seq_lens"),
    pytest.param({"document_ids": torch.zeros(0, 32, dtype=torch.int64)}, id="documents"),
    pytest.param({"dropout_p": 0.1, "dropout_seed": 5}, id="dropout"),
    pytest.param({"deterministic": True}, id="deterministic"),
    pytest.param({"kernel_options": {"num_splits": 2}}, id="split-kv"),
    pytest.param({"kernel_options": {"fused_dq": True}}, id="fused-dq"),
    pytest.param({"kernel_options": {"stored_ds": True}}, id="stored-ds"),
    pytest.param({"query_blocks": torch.tensor([1])}, id="query-blocks"),
]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kwargs", EMPTY_BATCH_CASES)
def test_empty_batch_gives_empty_outputs_and_gradients(backend, kwargs):
    """B = 0: o, lse and dq, dk, dv come back empty in their shapes, on both backends, with every option."""
    import sparse_train as st

    n, rows = 32, 16 if "query_blocks" in kwargs else 32
    kwargs = {key: value.to(DEV) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    idx = BlockIndex.from_selection(
        torch.zeros(0, 1, 2, 1, dtype=torch.int64, device=DEV), seq_len=n, block_q=16, block_k=16, window=1, sinks=1
    )
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    q = torch.randn(0, 2, rows, 16, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(0, 1, n, 16, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    o, lse = st.sparse_attention(q, k, v, idx, backend=backend, return_lse=True, **kwargs)
    assert o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(o.sum() + lse.sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def _documented_extreme_logit_exponent():
    """e of the bound ``sqrt(D) * max|lse| * 2**-e`` that sparse_attention's docstring states."""
    import re

    import sparse_train as st

    match = re.search(r"sqrt\(D\) \* max\|lse\| \* 2\*\*-(\d+)", " ".join(st.sparse_attention.__doc__.split()))
    assert match, "sparse_attention's docstring states the gradient error of extreme logits"
    return int(match.group(1))


@pytest.mark.skipif(DEV == "cuda", reason="fp32 inputs: the Triton interpreter only")
@pytest.mark.parametrize("D", [16, 64], ids=["d16", "d64"])
def test_extreme_logit_gradients_stay_within_the_documented_bound(D):
    """fp32 logits of 10 and of 1e4: the gradients' error against the fp64 reference stays below the documented
    ``sqrt(D) * max|lse| * 2**-e`` on top of the usual error-ratio rule. (How much of the bound a given input
    uses depends on where the stored lse rounds, which differs between numpy builds: no lower bound is pinned.)"""
    exponent = _documented_extreme_logit_exponent()
    idx = BlockIndex.full(1, 1, 64, block_q=16, block_k=16, device=DEV)
    q, k, v = make_qkv(1, 2, 1, 64, D, torch.float32, seed=3, device=DEV)
    peak = ((q.double() @ k.double().transpose(-1, -2)).abs().max() / D**0.5).item()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(99)).to(q)
    for largest_logit in (10.0, 1e4):
        qs = q * (largest_logit / peak)
        got = _grads(lambda a, b, c: triton_sparse_attention(a, b, c, idx), qs, k, v, do)
        ref = _grads(
            lambda a, b, c: reference_sparse_attention(a, b, c, idx), qs.double(), k.double(), v.double(), do.double()
        )
        low = _grads(lambda a, b, c: reference_sparse_attention(a, b, c, idx, upcast=False), qs, k, v, do)
        lse = reference_sparse_attention(qs.double(), k.double(), v.double(), idx)[1]
        bound = D**0.5 * lse.abs().max().item() * 2.0**-exponent
        for name, a, r, lp in zip(("dq", "dk", "dv"), got, ref, low):
            err, usual = rel_err(a, r), 4.0 * rel_err(lp, r) + 2e-6
            print(f"largest logit {largest_logit:g}, {name}: err {err:.2e}, documented bound {bound:.2e} + {usual:.2e}")
            assert err <= bound + usual, f"{name}: err {err:.2e} > {bound:.2e} + {usual:.2e}"
