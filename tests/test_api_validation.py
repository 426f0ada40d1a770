"""Argument validation of the public index / attention API: every bad argument gets a
ValueError naming it, the same on both backends; state that does not belong to the call (a plan of
another index, of index tensors modified since) is refused; the dropout seed domain [0, 2**64) gives
the same bits on both backends up to its top."""

import os

import pytest
import torch
from builders import check_close, make_qkv, random_index

import sparse_train as st
from sparse_train.kernels.reference.attention import dropout_keep_mask, reference_sparse_attention
from sparse_train.validation import DROPOUT_SEED_LIMIT

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16 if torch.cuda.is_available() else torch.float32
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param(
        "triton", id="triton", marks=pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
    ),
]


def _inputs(b=2, hq=2, hkv=1, n=64, d=16, block=16, seed=0):
    q, k, v = make_qkv(b, hq, hkv, n, d, DTYPE, seed=seed, device=DEV)
    idx = random_index(b, hkv, n, block, block, 2, 1, 1, seed=seed, device=DEV, distinct=False)
    return q, k, v, idx


# ------------------------------------------------------------------------------ attention arguments
ATTENTION_ERRORS = [
    # (keyword arguments of sparse_attention, text the message must contain)
    pytest.param(
        {"seq_lens": torch.tensor([64, 30]).bool()}, "seq_lens must be a 1-D integer tensor", id="seq_lens-bool"
    ),
    pytest.param(
        {"seq_lens": torch.tensor([64.0, 30.0])}, "seq_lens must be a 1-D integer tensor", id="seq_lens-float"
    ),
    pytest.param({"seq_lens": torch.tensor([[64, 30]])}, "seq_lens must be a 1-D integer tensor", id="seq_lens-2d"),
    pytest.param({"seq_lens": [64, 30]}, "seq_lens must be a 1-D integer tensor", id="seq_lens-list"),
    pytest.param({"seq_lens": torch.tensor([64, -1])}, r"seq_lens\[1\] = -1", id="seq_lens-negative"),
    pytest.param({"seq_lens": torch.tensor([65, 3])}, r"seq_lens\[0\] = 65", id="seq_lens-above-N"),
    pytest.param({"seq_lens": torch.tensor([64])}, "seq_lens has 1 entries for batch 2", id="seq_lens-short"),
    pytest.param({"seq_lens": torch.tensor([64, 30], device="meta")}, "seq_lens is on meta", id="seq_lens-device"),
    pytest.param({"dropout_p": True}, "dropout_p must be a real number", id="dropout_p-bool"),
    pytest.param({"dropout_p": float("nan")}, r"dropout_p must lie in \[0, 1\)", id="dropout_p-nan"),
    pytest.param({"dropout_p": -0.1}, r"dropout_p must lie in \[0, 1\)", id="dropout_p-negative"),
    pytest.param(
        {"dropout_p": 0.1, "dropout_seed": -1}, r"dropout_seed must lie in \[0, 2\*\*64\)", id="seed-negative"
    ),
    pytest.param(
        {"dropout_p": 0.1, "dropout_seed": 2**64},
        r"dropout_seed must lie in \[0, 2\*\*64\), got 18446744073709551616",
        id="seed-2^64",
    ),
    pytest.param({"dropout_p": 0.1, "dropout_seed": 1.5}, "dropout_seed must be an int", id="seed-float"),
    pytest.param({"dropout_p": 0.1, "dropout_seed": True}, "dropout_seed must be an int", id="seed-bool"),
    pytest.param({"dropout_seed": 2**64}, "dropout_seed must lie in", id="seed-checked-without-dropout"),
    pytest.param({"scale": float("nan")}, "scale must be finite, got nan", id="scale-nan"),
    pytest.param({"scale": float("inf")}, "scale must be finite", id="scale-inf"),
    pytest.param({"scale": True}, "scale must be a real number", id="scale-bool"),
    pytest.param({"scale": "0.5"}, "scale must be a real number", id="scale-str"),
    pytest.param({"kernel_options": {"r0": 1.5}}, r"r0 must be (an int|a positive int)\b.*, got 1\.5", id="r0-float"),
    pytest.param({"kernel_options": {"r0": True}}, "r0 must be an int", id="r0-bool"),
    pytest.param({"kernel_options": {"r0": -1}}, "r0 must be an int >= 0, got -1", id="r0-negative"),
    pytest.param({"deterministic": "yes"}, "deterministic must be a bool", id="deterministic-str"),
    pytest.param({"return_lse": 1}, "return_lse must be a bool", id="return_lse-int"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs,match", ATTENTION_ERRORS)
def test_sparse_attention_rejects_bad_argument(backend, kwargs, match):
    q, k, v, idx = _inputs()
    with pytest.raises(ValueError, match=match):
        st.sparse_attention(q, k, v, idx, backend=backend, **kwargs)


TENSOR_ERRORS = [
    # (mutation of (q, k, v, idx), text the message must contain)
    pytest.param(
        lambda q, k, v, i: (q[:, :0], k, v, i), r"query heads \(0\) must be a positive multiple", id="zero-query-heads"
    ),
    pytest.param(
        lambda q, k, v, i: (q[..., :0], k[..., :0], v[..., :0], i), "head dim must be >= 1", id="zero-head-dim"
    ),
    pytest.param(lambda q, k, v, i: (q, k.to("meta"), v, i), "k is on meta", id="k-device"),
    pytest.param(
        lambda q, k, v, i: (q.to(torch.complex64), k, v, i), "q must have a floating-point dtype", id="q-complex"
    ),
    pytest.param(
        lambda q, k, v, i: (q, k, v, "index"), "index must be a sparse_train.BlockIndex, got str", id="index-type"
    ),
    pytest.param(lambda q, k, v, i: (q[:1], k[:1], v[:1], i), "block index is for batch=2", id="index-other-batch"),
    pytest.param(
        lambda q, k, v, i: (q, k, v, st.BlockIndex.full(2, 1, 48, 16, 16, device=DEV)),
        "block index is for seq_len=48",
        id="index-other-N",
    ),
    pytest.param(
        lambda q, k, v, i: (torch.cat([q, q], 1), torch.cat([k, k], 1), torch.cat([v, v], 1), i),
        "kv_heads=1 but k has batch=2, kv_heads=2",
        id="index-other-HKV",
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate,match", TENSOR_ERRORS)
def test_sparse_attention_rejects_bad_tensor(backend, mutate, match):
    q, k, v, idx = mutate(*_inputs())
    with pytest.raises(ValueError, match=match):
        st.sparse_attention(q, k, v, idx, backend=backend)


@pytest.mark.parametrize("backend", [None, ["reference"], "cuda"], ids=["none", "list", "unknown"])
def test_resolve_backend_rejects_bad_backend(backend):
    q, k, v, idx = _inputs()
    with pytest.raises(ValueError, match="backend must be one of"):
        st.functional.resolve_backend(q, k, v, idx, backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        st.sparse_attention(q, k, v, idx, backend=backend)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "num_splits,match",
    [
        (1.5, r"num_splits must be (an int|a positive int)\b.*, got 1\.5"),
        (True, "num_splits must be an int"),
        (0, "num_splits must be an int >= 1 and <= 64, got 0"),
        (65, "num_splits must be an int >= 1 and <= 64, got 65"),
    ],
    ids=["float", "bool", "zero", "65"],
)
def test_triton_rejects_bad_num_splits(num_splits, match):
    from sparse_train.kernels.triton.op import triton_sparse_attention

    q, k, v, idx = _inputs()
    with pytest.raises(ValueError, match=match):
        triton_sparse_attention(q, k, v, idx, kernel_options={"num_splits": num_splits})


KERNEL_OPTION_ERRORS = [
    # (kernel_options, text the message must contain)
    pytest.param(
        {"num_split": 2},
        r"kernel_options has no key 'num_split' \(did you mean 'num_splits'\?\); allowed keys: "
        r"plan, r0, num_splits, fwd_heads_per_program",
        id="unknown-key",
    ),
    pytest.param(
        {"BLOCK_M": 64}, r"kernel_options has no key 'BLOCK_M'.*allowed keys: plan, r0", id="unknown-key-no-hint"
    ),
    pytest.param([("r0", 1)], "kernel_options must be a dict with keys among plan, r0", id="not-a-dict"),
    pytest.param({"num_splits": "2"}, "kernel_options.num_splits must be an int", id="num_splits-str"),
    pytest.param(
        {"num_splits": 65}, r"kernel_options.num_splits must be an int >= 1 and <= 64, got 65", id="num_splits-65"
    ),
    pytest.param({"fwd_num_warps": 3}, "kernel_options.fwd_num_warps must be a power of two, got 3", id="warps-3"),
    pytest.param(
        {"kv_num_warps": 64}, r"kernel_options.kv_num_warps must be one of \(1, 2, 4, 8, 16\), got 64", id="warps-64"
    ),
    pytest.param(
        {"dq_num_stages": 0}, r"kernel_options.dq_num_stages must be an int >= 1 and <= 8, got 0", id="stages-0"
    ),
    pytest.param({"fwd_num_stages": 2.0}, "kernel_options.fwd_num_stages must be an int", id="stages-float"),
    pytest.param(
        {"dq_heads_per_program": 3}, "kernel_options.dq_heads_per_program must be a power of two, got 3", id="heads-3"
    ),
    pytest.param(
        {"kv_heads_per_program": True}, "kernel_options.kv_heads_per_program must be a positive int", id="heads-bool"
    ),
    pytest.param({"kv_chunk": 0}, "kernel_options.kv_chunk must be a positive int, got 0", id="chunk-0"),
    pytest.param({"kv_tile_rows": 24}, "kernel_options.kv_tile_rows must be a power of two, got 24", id="tile-rows-24"),
    pytest.param(
        {"kv_tile_rows": 8}, r"kernel_options.kv_tile_rows must be >= 16 \(tensor-core tile\), got 8", id="tile-rows-8"
    ),
    pytest.param({"plan": "plan"}, "kernel_options.plan must be a sparse_train.BlockPlan", id="plan-str"),
    pytest.param({"fwd_tma": 1}, "kernel_options.fwd_tma must be a bool", id="fwd-tma-int"),
    pytest.param({"kv_tma": "false"}, "kernel_options.kv_tma must be a bool", id="kv-tma-str"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options,match", KERNEL_OPTION_ERRORS)
def test_sparse_attention_rejects_bad_kernel_options(backend, options, match):
    """kernel_options is checked by one function on both backends: unknown keys are named with the
    allowed ones, values of the wrong type or range raise."""
    q, k, v, idx = _inputs()
    with pytest.raises(ValueError, match=match):
        st.sparse_attention(q, k, v, idx, backend=backend, kernel_options=options)


_HEADS = ("fwd_heads_per_program", "dq_heads_per_program", "kv_heads_per_program")
_WARPS = ("fwd_num_warps", "dq_num_warps", "kv_num_warps")
_STAGES = ("fwd_num_stages", "dq_num_stages", "kv_num_stages")
_SWITCHES = ("fwd_tma", "dq_tma", "kv_tma", "fused_dq", "stored_ds", "kv_gluon", "dq_gluon", "fwd_gluon")
# every field of KernelOptions: (field, values at the ends of its range, values just past them with the message)
KERNEL_OPTION_RANGES = [
    ("r0", [0, 10**9], [(-1, "must be an int >= 0, got -1")]),
    (
        "num_splits",
        [1, 64],
        [(0, "must be an int >= 1 and <= 64, got 0"), (65, "must be an int >= 1 and <= 64, got 65")],
    ),
    *(
        (name, [1, 2], [(0, "must be a positive int, got 0"), (-1, "must be a positive int, got -1")])
        for name in _HEADS
    ),
    *(
        (name, [1, 16], [(0, "must be a positive int, got 0"), (32, r"must be one of \(1, 2, 4, 8, 16\), got 32")])
        for name in _WARPS
    ),
    *(
        (name, [1, 8], [(0, "must be an int >= 1 and <= 8, got 0"), (9, "must be an int >= 1 and <= 8, got 9")])
        for name in _STAGES
    ),
    ("kv_chunk", [1, 10**9], [(0, "must be a positive int, got 0"), (-1, "must be a positive int, got -1")]),
    (
        "kv_tile_rows",
        [16, 2**20],
        [(8, r"must be >= 16 \(tensor-core tile\), got 8"), (0, "must be a positive int, got 0")],
    ),
    *((name, [False, True], [(1, r"must be a bool, got 1 \(int\)")]) for name in _SWITCHES),
    ("plan", [], [("plan", "must be a sparse_train.BlockPlan")]),
]
KERNEL_OPTION_ACCEPTED = [
    pytest.param(name, value, id=f"{name}={value}") for name, values, _ in KERNEL_OPTION_RANGES for value in values
]
KERNEL_OPTION_REJECTED = [
    pytest.param(name, value, match, id=f"{name}={value}")
    for name, _, rejected in KERNEL_OPTION_RANGES
    for value, match in rejected
]


def test_kernel_option_ranges_cover_every_field():
    assert sorted(name for name, _, _ in KERNEL_OPTION_RANGES) == sorted(st.options.KERNEL_OPTIONS)


@pytest.mark.parametrize("form", ["typed", "dict"])
@pytest.mark.parametrize("name,value,match", KERNEL_OPTION_REJECTED)
def test_kernel_options_reject_values_past_each_end_in_both_forms(form, name, value, match):
    """A KernelOptions field just past either end of its range raises a ValueError naming the field and the
    range, whether the options come typed or as a dict."""
    q, k, v, idx = _inputs()
    with pytest.raises(ValueError, match=f"kernel_options.{name} {match}"):
        options = st.options.KernelOptions(**{name: value}) if form == "typed" else {name: value}
        st.sparse_attention(q, k, v, idx, backend="reference", kernel_options=options)


@pytest.mark.parametrize("name,value", KERNEL_OPTION_ACCEPTED)
def test_kernel_options_accept_each_end_of_the_range_in_both_forms(name, value):
    typed = st.options.KernelOptions(**{name: value})
    assert getattr(typed, name) == value
    assert st.options.normalize_kernel_options({name: value}) == typed
    assert st.options.normalize_kernel_options(typed) is typed


def test_kernel_options_refuse_fused_dq_with_stored_ds_in_both_forms():
    for make in (st.options.KernelOptions, lambda **kw: st.options.normalize_kernel_options(kw)):
        with pytest.raises(ValueError, match="kernel_options.fused_dq and kernel_options.stored_ds are two ways"):
            make(fused_dq=True, stored_ds=True)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_typed_kernel_options_run_like_the_dict_form():
    q, k, v, idx = _inputs(b=1)
    options = {"num_splits": 2, "fwd_heads_per_program": 2, "kv_chunk": 1}
    typed = st.sparse_attention(q, k, v, idx, backend="triton", kernel_options=st.options.KernelOptions(**options))
    assert torch.equal(typed, st.sparse_attention(q, k, v, idx, backend="triton", kernel_options=options))


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("key", ["fwd_heads_per_program", "dq_heads_per_program", "kv_heads_per_program"])
def test_heads_per_program_must_divide_the_group(key):
    q, k, v, idx = _inputs(hq=2, hkv=1)
    with pytest.raises(ValueError, match=f"kernel_options.{key}=4 must divide the GQA group size 2"):
        st.sparse_attention(q, k, v, idx, backend="triton", kernel_options={key: 4})


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_kv_tile_rows_must_fit_the_kv_centric_tile():
    q, k, v, idx = _inputs(hq=2, hkv=1)
    rows = idx.block_q * 2
    with pytest.raises(
        ValueError,
        match=f"kernel_options.kv_tile_rows={2 * rows} exceeds the KV-centric tile of "
        f"kv_heads_per_program \\* block_q = {rows} rows",
    ):
        st.sparse_attention(
            q, k, v, idx, backend="triton", kernel_options={"kv_heads_per_program": 2, "kv_tile_rows": 2 * rows}
        )


def test_sparse_attention_takes_semantics_by_keyword_and_tuning_in_kernel_options():
    q, k, v, idx = _inputs()
    with pytest.raises(TypeError):
        st.sparse_attention(q, k, v, idx, 0.25)  # scale: keyword-only after the index
    for old in ({"plan": idx.plan()}, {"r0": 1}, {"num_splits": 2}):
        with pytest.raises(TypeError):
            st.sparse_attention(q, k, v, idx, **old)  # tuning goes through kernel_options
    ref = st.sparse_attention(q, k, v, idx, backend="reference")
    options = {"plan": idx.plan(3), "r0": 3, "num_splits": 2, "kv_chunk": 1, "fwd_num_warps": 2, "kv_num_stages": 1}
    assert torch.equal(st.sparse_attention(q, k, v, idx, backend="reference", kernel_options=options), ref)
    assert torch.equal(st.sparse_attention(q, k, v, idx, backend="reference", kernel_options=None), ref)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda i: st.BlockIndex(i.indices.long(), i.counts, i.seq_len, i.block_q, i.block_k),
            "index.indices must be an int32",
        ),
        (
            lambda i: st.BlockIndex(i.indices, i.counts.float(), i.seq_len, i.block_q, i.block_k),
            "index.counts must be an int32",
        ),
        (
            lambda i: st.BlockIndex(i.indices, i.counts[:, :, :2], i.seq_len, i.block_q, i.block_k),
            "index.counts must have shape",
        ),
        (lambda i: st.BlockIndex(i.indices, i.counts, 100, i.block_q, i.block_k), "NQB=7"),
        (lambda i: st.BlockIndex(i.indices[..., :0], i.counts, i.seq_len, i.block_q, i.block_k), "K>=1"),
        (
            lambda i: st.BlockIndex(i.indices, i.counts.to("meta"), i.seq_len, i.block_q, i.block_k),
            "index.counts on meta",
        ),
        (
            lambda i: st.BlockIndex(i.indices, i.counts, i.seq_len, 16.0, i.block_k),
            r"block_q must be (an int|a positive int)\b.*, got 16\.0",
        ),
    ],
    ids=[
        "indices-int64",
        "counts-float",
        "counts-shape",
        "seq_len-nqb",
        "capacity-0",
        "counts-device",
        "block_q-float",
    ],
)
def test_block_index_constructor_checks_metadata(make, match):
    _, _, _, idx = _inputs()
    with pytest.raises(ValueError, match=match):
        make(idx)


# ------------------------------------------------------------------------------ plans bound to their index
@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_of_another_index_is_refused(backend):
    """A plan from another index is refused (the backward would read past its arrays)."""
    q, k, v, idx_a = _inputs(seed=1)
    _, _, _, idx_b = _inputs(seed=2)
    assert idx_a.indices.shape == idx_b.indices.shape
    with pytest.raises(ValueError, match="plan was built from a different BlockIndex"):
        st.sparse_attention(q, k, v, idx_a, kernel_options={"plan": idx_b.plan()}, backend=backend)
    coarser = st.BlockIndex.full(2, 1, 64, 32, 32, device=DEV)
    with pytest.raises(ValueError, match="plan was built for an index of shape"):
        st.sparse_attention(q, k, v, idx_a, kernel_options={"plan": coarser.plan()}, backend=backend)
    with pytest.raises(ValueError, match="plan must be a sparse_train.BlockPlan"):
        st.sparse_attention(q, k, v, idx_a, kernel_options={"plan": (idx_a.plan(),)}, backend=backend)
    with pytest.raises(ValueError, match="plan was built with r0=1 but r0=3"):
        st.sparse_attention(q, k, v, idx_a, kernel_options={"plan": idx_a.plan(1), "r0": 3}, backend=backend)
    st.sparse_attention(q, k, v, idx_a, kernel_options={"plan": idx_a.plan(3), "r0": 3}, backend=backend)
    same_tensors = st.BlockIndex(idx_a.indices, idx_a.counts, 64, 16, 16)
    st.sparse_attention(q, k, v, same_tensors, kernel_options={"plan": idx_a.plan()}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode_calls_equal_no_grad(backend):
    """Under torch.inference_mode the plan of an index of inference tensors (no version counters) is built,
    cached and passed like any other: every call equals the no_grad one."""
    q, k, v, idx = _inputs(seed=5)
    with torch.no_grad():
        want = st.sparse_attention(q, k, v, idx, backend=backend)
    with torch.inference_mode():
        inference_idx = st.BlockIndex(idx.indices.clone(), idx.counts.clone(), 64, 16, 16)
        calls = [
            st.sparse_attention(q, k, v, idx, backend=backend),
            st.sparse_attention(q, k, v, inference_idx, backend=backend),
            st.sparse_attention(q, k, v, inference_idx, backend=backend),
            st.sparse_attention(q, k, v, inference_idx, kernel_options={"plan": inference_idx.plan()}, backend=backend),
        ]
    assert inference_idx.plan() is inference_idx.plan()
    for got in calls:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_of_index_modified_in_place_is_refused(backend):
    q, k, v, idx = _inputs(seed=3)
    _, _, _, other = _inputs(seed=4)
    plan = idx.plan()
    idx.indices.copy_(other.indices)
    idx.counts.copy_(other.counts)
    with pytest.raises(ValueError, match="modified in place after this plan was built"):
        st.sparse_attention(q, k, v, idx, kernel_options={"plan": plan}, backend=backend)
    fresh = idx.plan()
    assert fresh is not plan
    assert torch.equal(fresh.kv_qblocks, other.plan().kv_qblocks)
    st.sparse_attention(q, k, v, idx, kernel_options={"plan": fresh}, backend=backend)


# ------------------------------------------------------------------------------ dropout seed domain
SEEDS_AT_THE_TOP = [2**63 - 1, 2**63, 2**64 - 2**31, DROPOUT_SEED_LIMIT - 1]


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seed", SEEDS_AT_THE_TOP, ids=lambda s: f"seed{s:#x}")
def test_dropout_seed_at_the_top_of_the_domain_same_bits_both_backends(seed):
    """Seeds >= 2**63 run on the Triton path (the op's int is int64) with the reference's keep bits.
    Recover the kernel's keep bits with q = 0 (uniform P) and V = identity, forward and backward."""
    B, HQ, HKV, N, D, p = 1, 2, 1, 32, 16, 0.4
    idx = st.BlockIndex.full(B, HKV, N, 16, 16, device=DEV)
    q = torch.zeros(B, HQ, N, D, device=DEV, dtype=DTYPE)
    k = torch.randn(B, HKV, N, D, device=DEV, dtype=DTYPE)
    v = torch.eye(N, D, device=DEV, dtype=DTYPE).expand(B, HKV, N, D).contiguous()
    o = st.sparse_attention(q, k, v, idx, dropout_p=p, dropout_seed=seed, backend="triton")
    pos = torch.arange(N, device=DEV)
    keep = dropout_keep_mask(
        seed,
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device=DEV),
        torch.arange(HQ, device=DEV).view(1, HQ, 1, 1),
        pos.view(1, 1, N, 1),
        pos.view(1, 1, 1, N),
        HQ,
        N,
        p,
    ) & (pos.view(1, 1, 1, N) <= pos.view(1, 1, N, 1))
    assert torch.equal(o > 0, keep[..., :D])  # V = identity: o[..., j] > 0 iff key j was kept
    q, k, v, _ = _inputs(b=1, n=N, seed=6)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(DEV, DTYPE)

    def grads(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, do.to(inputs[0].dtype))

    got = grads(
        lambda a, b, c: st.sparse_attention(a, b, c, idx, dropout_p=p, dropout_seed=seed, backend="triton"), q, k, v
    )

    def reference(**kw):
        return lambda a, b, c: reference_sparse_attention(a, b, c, idx, dropout_p=p, dropout_seed=seed, **kw)[0]

    want = grads(reference(), q.double(), k.double(), v.double())
    lowp = grads(reference(upcast=False), q, k, v)
    for name, a, w, lo in zip(("dq", "dk", "dv"), got, want, lowp):
        check_close(name, a, w, lo, DTYPE)


# ------------------------------------------------------------------------------ torch.compile
@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_validation_traces_without_graph_break():
    """The validation (plan binding, seed domain, seq_lens) must not break a fullgraph trace: the
    seq_lens range check (a host sync) and the plan's version check are skipped while compiling."""
    q, k, v, idx = _inputs(seed=5)
    plan = idx.plan(2)
    lens = torch.tensor([64, 41], device=DEV)

    def f(q, k, v):
        o = st.sparse_attention(
            q,
            k,
            v,
            idx,
            kernel_options={"plan": plan, "r0": 2},
            seq_lens=lens,
            dropout_p=0.1,
            dropout_seed=2**64 - 5,
            backend="triton",
        )
        return o.float().square().sum()

    qs = q.detach().clone().requires_grad_()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(qs, k, v)
    (g,) = torch.autograd.grad(out, qs)
    qe = q.detach().clone().requires_grad_()
    oute = f(qe, k, v)
    (ge,) = torch.autograd.grad(oute, qe)
    assert torch.equal(out, oute) and torch.equal(g, ge)
