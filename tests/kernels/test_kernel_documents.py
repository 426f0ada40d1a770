"""The Triton kernels with packed documents (``document_ids``): forward, backward (dQ, atomic and
KV-centric dK/dV, chunked KV rows) and block mass against the float64 references with the document
mask (CPU: Triton interpreter, fp32 with IEEE dots); the same on the GPU at a real size (marker ``gpu``,
bf16/fp16 against the reference in fp32).

Tolerance: err(kernel vs reference) <= c * err(PyTorch reference in the kernel's dtype vs reference) +
floor (tests/builders.py check_close), c = 4 on the interpreter, c = 3 on the GPU.
"""

import os

import pytest
import torch
from builders import check_close, make_qkv, random_index, rel_err
from test_documents import ids_from_lengths

from sparse_train.documents import block_document_ranges, document_ids_from_cu_seqlens, random_document_lengths
from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.kernels.reference.block_mass import reference_dense_block_mass, reference_sparse_block_mass

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from sparse_train.kernels.triton import forward as kf  # noqa: E402
from sparse_train.kernels.triton.block_mass import triton_block_mass, triton_dense_block_mass  # noqa: E402
from sparse_train.kernels.triton.op import triton_sparse_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs", "small_kv_chunks")  # conftest.py


def _index(kind, B, HKV, N, BQ, BK, seed, device=DEV):
    if kind == "full":
        return BlockIndex.full(B, HKV, N, block_q=BQ, block_k=BK, device=device)
    return random_index(B, HKV, N, BQ, BK, 2, 1, 1, seed=seed, device=device)


def _run(fn, q, k, v, do):
    """(o, lse, dq, dk, dv) of ``fn(q, k, v) -> (o, lse)`` with loss sum(o * do)."""
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = fn(*xs)
    return (o, lse, *torch.autograd.grad((o * do).sum(), xs))


def _check_against_reference(idx, q, k, v, do, ids, *, dtype, c=4.0, floor=None, ref_dtype=torch.float64, **kw):
    """Kernel forward + backward (``kw`` includes kernel_options) vs the reference in ``ref_dtype`` and in
    the kernel's dtype, all with the same document ids."""
    ref_kw = {x: kw[x] for x in ("dropout_p", "dropout_seed", "seq_lens") if x in kw}
    got = _run(lambda a, b, c_: triton_sparse_attention(a, b, c_, idx, document_ids=ids, **kw), q, k, v, do)
    ref = _run(
        lambda a, b, c_: reference_sparse_attention(a, b, c_, idx, document_ids=ids, **ref_kw),
        q.to(ref_dtype),
        k.to(ref_dtype),
        v.to(ref_dtype),
        do.to(ref_dtype),
    )
    low = _run(
        lambda a, b, c_: reference_sparse_attention(a, b, c_, idx, document_ids=ids, upcast=False, **ref_kw),
        q,
        k,
        v,
        do,
    )
    for name, a, r, lp in zip(("o", "lse", "dq", "dk", "dv"), got, ref, low):
        assert not torch.isnan(a).any(), f"{name} has NaN (unwritten or 0/0)"
        check_close(name, a, r, lp.to(a.dtype), dtype, c=c, floor=floor)
    return got


# Each case: B, HQ, HKV, N, D, BQ, BK, document lengths per row, seq_lens, selection, dropout_p, r0
CASES = [
    pytest.param(
        1,
        2,
        2,
        97,
        16,
        16,
        16,
        [[7, 3, 9, 5, 8, 6, 4, 9, 3, 7, 5, 8, 6, 4, 13]],
        None,
        "full",
        0.0,
        2,
        id="many-short-odd97-full-hybrid",
    ),
    pytest.param(
        1,
        4,
        2,
        101,
        16,
        16,
        16,
        [[61, 5, 3, 7, 2, 20, 3]],
        None,
        "random",
        0.0,
        2,
        id="long-plus-short-gqa2-random-hybrid",
    ),
    pytest.param(
        1,
        2,
        1,
        45,
        16,
        32,
        16,
        [[1, 2, 3, 1, 5, 2, 4, 1, 3, 2]],
        None,
        "full",
        0.2,
        1,
        id="shorter-than-block-gqa2-bq32-bk16-dropout-kvcentric",
    ),
    pytest.param(
        2,
        4,
        1,
        83,
        16,
        16,
        32,
        [[20, 30, 33], [5, 60, 18]],
        [83, 51],
        "random",
        0.0,
        10**6,
        id="seq_lens-gqa4-bq16-bk32-random-atomics",
    ),
    pytest.param(
        2,
        2,
        2,
        70,
        32,
        16,
        16,
        [[30, 25], [50, 20]],
        [64, 50],
        "full",
        0.25,
        2,
        id="seq_lens-padding-own-document-d32-dropout",
    ),
    pytest.param(
        1, 2, 2, 77, 16, 16, 16, [[10, 17, 23, 27]], None, "random", 0.0, 1, id="inside-blocks-random-kvcentric"
    ),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,lengths,seq_lens,selection,dropout_p,r0", CASES)
def test_forward_backward_vs_fp64_reference(B, HQ, HKV, N, D, BQ, BK, lengths, seq_lens, selection, dropout_p, r0):
    idx = _index(selection, B, HKV, N, BQ, BK, seed=N)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q)
    ids = ids_from_lengths(lengths, N).to(DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    _check_against_reference(
        idx,
        q,
        k,
        v,
        do,
        ids,
        dtype=torch.float32,
        seq_lens=lens,
        dropout_p=dropout_p,
        dropout_seed=11,
        kernel_options={"r0": r0, "num_splits": 1},
    )


@pytest.mark.parametrize(
    "dq_mode", [{}, {"fused_dq": True}, {"stored_ds": True}], ids=["dq-kernel", "fused-dq", "stored-ds"]
)
def test_kv_centric_row_slices_with_documents(dq_mode):
    """dK/dV of the KV-centric kernel walking its tiles in 16-row slices, with boundaries inside blocks
    and documents shorter than a block, against the fp64 reference; also with dQ from the same kernel
    (atomics) or from the dS tiles it stores."""
    B, HQ, HKV, N, D, BQ, BK = 1, 4, 2, 90, 16, 32, 16
    idx = _index("full", B, HKV, N, BQ, BK, seed=N)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    ids = ids_from_lengths([[9, 31, 4, 5, 25, 16]], N).to(DEV)
    _check_against_reference(
        idx,
        q,
        k,
        v,
        do,
        ids,
        dtype=torch.float32,
        kernel_options={"r0": 1, "kv_heads_per_program": 2, "kv_tile_rows": 16, **dq_mode},
    )


def test_split_forward_launcher_with_documents():
    """Split-KV forward (partials + merge) with documents, through the launcher (its NaN-poisoned outputs
    must be written everywhere)."""
    B, HQ, HKV, N, D = 1, 4, 2, 93, 16
    idx = _index("full", B, HKV, N, 16, 16, seed=0)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=3, device=DEV)
    ids = ids_from_lengths([[13, 2, 40, 9, 21]], N).to(DEV)
    o, lse = kf.sparse_attn_forward(
        q, k, v, idx.indices, idx.counts, block_q=16, block_k=16, scale=0.25, num_splits=3, document_ids=ids
    )
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    o64, lse64 = reference_sparse_attention(q.double(), k.double(), v.double(), idx, scale=0.25, document_ids=ids)
    olp, lselp = reference_sparse_attention(q, k, v, idx, scale=0.25, document_ids=ids, upcast=False)
    check_close("o", o, o64, olp, torch.float32)
    check_close("lse", lse, lse64, lselp, torch.float32)


def test_cross_document_blocks_contribute_nothing():
    """A selection holding blocks that share no document with the query block gives the result of the
    selection without them: forward bitwise (adding a fully masked block rescales by exactly 1 and adds
    0), gradients up to the order of the dK/dV reductions (the two selections have different plans)."""
    B, HQ, HKV, N, D, BS = 2, 4, 2, 89, 16, 16
    ids = ids_from_lengths([[20, 9, 30, 30], [50, 3, 36]], N).to(DEV)
    full = BlockIndex.full(B, HKV, N, block_q=BS, block_k=BS, device=DEV)
    ranges = block_document_ranges(ids, BS)  # [B, NB, 2]
    shares = ranges[:, None, :, 0, None] <= ranges[:, None, None, :, 1]  # query block's first doc <= key block's last
    pruned = BlockIndex.from_dense(full.to_dense() & shares, seq_len=N, block_q=BS, block_k=BS)
    assert int(pruned.counts.sum()) < int(full.counts.sum()), "the case must hold cross-document blocks"
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=5, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q)
    opts = {"r0": 2, "num_splits": 1}
    a = _run(lambda x, y, z: triton_sparse_attention(x, y, z, full, document_ids=ids, kernel_options=opts), q, k, v, do)
    b = _run(
        lambda x, y, z: triton_sparse_attention(x, y, z, pruned, document_ids=ids, kernel_options=opts), q, k, v, do
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for name, x, y in zip(("dq", "dk", "dv"), a[2:], b[2:]):
        assert rel_err(x, y) < 1e-6, name


def test_one_document_equals_no_documents_and_dtypes_strides():
    """All tokens in one document is the plain causal mask (bitwise: every block skips the check); int64
    and strided int32 ids give the int32 contiguous result."""
    B, HQ, HKV, N, D = 2, 2, 1, 70, 16
    idx = _index("random", B, HKV, N, 16, 16, seed=4)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=4, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    lens = torch.tensor([70, 45], device=DEV)
    opts = {"r0": 2, "num_splits": 1}
    plain = _run(lambda x, y, z: triton_sparse_attention(x, y, z, idx, seq_lens=lens, kernel_options=opts), q, k, v, do)
    zeros = torch.zeros(B, N, dtype=torch.int64, device=DEV)
    one = _run(
        lambda x, y, z: triton_sparse_attention(x, y, z, idx, seq_lens=lens, document_ids=zeros, kernel_options=opts),
        q,
        k,
        v,
        do,
    )
    for x, y in zip(plain, one):
        assert torch.equal(x, y)
    ids = ids_from_lengths([[9, 30, 31], [40, 30]], N).to(DEV)
    table = torch.stack([ids.to(torch.int32), torch.full_like(ids, 5, dtype=torch.int32)], dim=-1)
    strided = table[..., 0]
    assert not strided.is_contiguous()
    results = [
        _run(
            lambda x, y, z: triton_sparse_attention(x, y, z, idx, seq_lens=lens, document_ids=d, kernel_options=opts),
            q,
            k,
            v,
            do,
        )
        for d in (ids.to(torch.int32), ids, strided)
    ]
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y)


def test_caller_document_ids_mutation_after_forward_does_not_change_grads():
    B, HQ, HKV, N, D = 1, 2, 1, 64, 16
    idx = _index("full", B, HKV, N, 16, 16, seed=0)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=8, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q)
    ids = ids_from_lengths([[10, 30, 24]], N).to(DEV).to(torch.int32)
    want = _run(lambda x, y, z: triton_sparse_attention(x, y, z, idx, document_ids=ids), q, k, v, do)
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, _ = triton_sparse_attention(*xs, idx, document_ids=ids)
    ids.zero_()  # the caller reuses its buffer before the backward
    got = torch.autograd.grad(o, xs, do)
    for x, y in zip(got, want[2:]):
        assert torch.equal(x, y)


def test_sparse_attention_dispatches_documents_to_the_kernels():
    import sparse_train as st

    B, HQ, HKV, N, D = 1, 2, 1, 50, 16
    idx = _index("random", B, HKV, N, 16, 16, seed=9)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=9, device=DEV)
    ids = document_ids_from_cu_seqlens(torch.tensor([0, 12, 13, 40], device=DEV), N)
    o = st.sparse_attention(q, k, v, idx, document_ids=ids, backend="triton")
    o_ref = st.sparse_attention(q.double(), k.double(), v.double(), idx, document_ids=ids, backend="reference")
    assert rel_err(o, o_ref) < 1e-5
    with pytest.raises(ValueError, match="non-decreasing"):
        st.sparse_attention(q, k, v, idx, document_ids=ids.flip(-1), backend="triton")


def test_opcheck_with_document_ids():
    """Schema, fake impl and autograd registration of the custom op with its document_ids input."""
    from sparse_train.plan.plan import cold_slots
    from sparse_train.plan.tuning import backward_config, forward_config

    B, HQ, HKV, N, D = 1, 2, 1, 48, 16
    idx = random_index(B, HKV, N, 16, 16, 1, 1, 1, seed=2, device=DEV)
    plan = idx.plan(2)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, device=DEV)
    q.requires_grad_()
    ids = ids_from_lengths([[5, 30, 13]], N).to(device=DEV, dtype=torch.int32)
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
        ids,
    )
    torch.library.opcheck(
        torch.ops.sparse_train.sparse_attn_fwd.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


# ---------------------------------------------------------------------------------------------- block mass
@pytest.mark.parametrize("row_pool", ["max", "mean"], ids=["row-max", "row-mean"])
@pytest.mark.parametrize(
    "B,HQ,HKV,N,D,BQ,BK,lengths,seq_lens",
    [
        pytest.param(1, 4, 2, 101, 16, 16, 16, [[61, 5, 3, 7, 2, 20, 3]], None, id="gqa2-long-plus-short"),
        pytest.param(2, 2, 1, 83, 16, 32, 16, [[20, 30, 33], [5, 60, 18]], [83, 51], id="seq_lens-bq32-bk16"),
    ],
)
def test_block_mass_with_documents(B, HQ, HKV, N, D, BQ, BK, lengths, seq_lens, row_pool):
    idx = _index("random", B, HKV, N, BQ, BK, seed=N)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    ids = ids_from_lengths(lengths, N).to(DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    scale = D**-0.5
    _, lse = reference_sparse_attention(q, k, v, idx, scale=scale, seq_lens=lens, document_ids=ids)
    target, valid = triton_block_mass(q, k, lse, idx, scale=scale, seq_lens=lens, row_pool=row_pool, document_ids=ids)
    ref, ref_valid = reference_sparse_block_mass(
        q.double(), k.double(), idx, scale=scale, lse=lse.double(), seq_lens=lens, row_pool=row_pool, document_ids=ids
    )
    assert torch.equal(valid, ref_valid)
    assert (target.double() - ref).abs().max().item() < 1e-5
    # without the document mask the target differs (the case holds cross-document keys)
    other, _ = triton_block_mass(q, k, lse, idx, scale=scale, seq_lens=lens, row_pool=row_pool)
    assert (other - target).abs().max().item() > 1e-3


def test_dense_block_mass_with_documents():
    B, HQ, HKV, N, D = 1, 2, 1, 75, 16
    q, k, _ = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=12, device=DEV)
    ids = ids_from_lengths([[11, 30, 4, 22]], N).to(DEV)
    picks = torch.tensor([0, 2, 4], device=DEV)
    target, valid = triton_dense_block_mass(q, k, picks, block_q=16, block_k=16, scale=0.25, document_ids=ids)
    ref, ref_valid = reference_dense_block_mass(
        q.double(), k.double(), block_q=16, block_k=16, scale=0.25, query_blocks=picks, document_ids=ids
    )
    assert torch.equal(valid, ref_valid)
    assert (target.double() - ref).abs().max().item() < 1e-5
    assert float(target[0, 0, 2, 0]) == 0.0  # query block 2 (32..47) is in documents 1 and 2 only


# ---------------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    pytest.param(1, 8, 2, 4099, 128, 64, 64, "random", None, id="gqa4-odd4099-d128-random"),
    pytest.param(1, 8, 2, 4099, 128, 64, 64, "full", None, id="gqa4-odd4099-d128-full"),
    pytest.param(2, 4, 4, 2053, 64, 64, 64, "random", (2053, 1500), id="mha-b2-seq_lens-d64-random"),
    pytest.param(1, 4, 2, 3001, 64, 128, 64, "random", None, id="gqa2-bq128-bk64-random"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,selection,seq_lens", GPU_CASES)
def test_documents_on_gpu(B, HQ, HKV, N, D, BQ, BK, selection, seq_lens, dtype):
    idx = (
        random_index(B, HKV, N, BQ, BK, 8, 4, 1, seed=N, device="cuda")
        if selection == "random"
        else BlockIndex.full(B, HKV, N, block_q=BQ, block_k=BK, device="cuda")
    )
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, seed=N, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    ids = ids_from_lengths([random_document_lengths(N, 1, 900, seed=N + b) for b in range(B)], N).to("cuda")
    lens = None if seq_lens is None else torch.tensor(seq_lens, device="cuda")
    for kw in ({}, {"dropout_p": 0.1, "dropout_seed": 5}):
        _check_against_reference(
            idx, q, k, v, do, ids, dtype=dtype, c=3.0, floor=1e-4, ref_dtype=torch.float32, seq_lens=lens, **kw
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block_mass_with_documents_on_gpu(dtype):
    B, HQ, HKV, N, D = 1, 8, 2, 4099, 128
    idx = random_index(B, HKV, N, 64, 64, 8, 4, 1, seed=7, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, seed=7, device="cuda")
    ids = ids_from_lengths([random_document_lengths(N, 1, 900, seed=3)], N).to("cuda")
    _, lse = triton_sparse_attention(q, k, v, idx, document_ids=ids)
    target, valid = triton_block_mass(q, k, lse, idx, scale=D**-0.5, document_ids=ids)
    ref, ref_valid = reference_sparse_block_mass(
        q.double(), k.double(), idx, scale=D**-0.5, lse=lse.double(), document_ids=ids
    )
    assert torch.equal(valid, ref_valid)
    assert (target.double() - ref).abs().max().item() < 1e-3  # same inputs: only fp32 accumulation order differs
