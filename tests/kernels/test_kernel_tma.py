"""TMA tensor-descriptor loads (``kernel_options`` ``fwd_tma``, ``dq_tma``, ``kv_tma``): the forward's K/V tiles,
the dQ kernel's K/V tiles and the KV-centric kernel's q/dO slices, against the fp64 reference and against the
pointer loads they replace.

On the CPU the Triton interpreter emulates the descriptors, so these tests run the TMA branch of every
kernel; there both load paths must give bitwise equal results (same data, same arithmetic). The GPU tests
(marker ``gpu``) run the copy engine of a Hopper GPU at real sizes against the fp32 reference.
Tolerance: the error-ratio rule of ``builders.check_close``.
"""

import os

import pytest
import torch
from builders import check_close, make_qkv, random_index

from sparse_train.kernels.reference.attention import reference_sparse_attention

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from sparse_train.kernels.triton import _launch  # noqa: E402
from sparse_train.kernels.triton import backward as kb  # noqa: E402
from sparse_train.kernels.triton import forward as kf  # noqa: E402
from sparse_train.kernels.triton.op import triton_sparse_attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton kernels' TMA and pointer loads: the Gluon kernels (the default on Hopper, always loading by TMA;
# tests/kernels/test_kernel_gluon.py) are switched off, or on an H200 the dQ and KV-centric Triton kernels would not
# run.
TRITON_ONLY = {"fwd_gluon": False, "dq_gluon": False, "kv_gluon": False}
ALL_ON = {"fwd_tma": True, "dq_tma": True, "kv_tma": True, **TRITON_ONLY}
ALL_OFF = {"fwd_tma": False, "dq_tma": False, "kv_tma": False, **TRITON_ONLY}

pytestmark = pytest.mark.usefixtures("poison_fresh_outputs", "small_kv_chunks")  # conftest.py


@pytest.fixture
def descriptors(monkeypatch):
    """Every descriptor a launcher asked for: ``[(launcher module, tensor shape, made)]``."""
    asked = []
    real = _launch.tma_operands
    for module, name in ((kf, "forward"), (kb, "backward")):

        def spy(a, b, rows, enabled, _name=name):
            first, second, made = real(a, b, rows, enabled)
            if enabled:
                asked.extend([(_name, tuple(a.shape), made), (_name, tuple(b.shape), made)])
            return first, second, made

        monkeypatch.setattr(module, "tma_operands", spy)
    return asked


def _bnhd(x):
    """``x`` ``[B, H, N, D]`` as a view of ``[B, N, H, D]`` memory (the projections' layout)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _leaf(x):
    """A copy of ``x`` with its exact strides (clone would make a padded layout contiguous), requiring grad."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x).requires_grad_()


def _run(idx, q, k, v, do, options, **kw):
    qs, ks, vs = (_leaf(t) for t in (q, k, v))
    o, lse = triton_sparse_attention(qs, ks, vs, idx, kernel_options=options, **kw)
    return (o, lse, *torch.autograd.grad(o, (qs, ks, vs), do))


def _reference(idx, q, k, v, do, dtype, **kw):
    """o, lse and the gradients of the reference in ``dtype`` (its own precision throughout: no upcast)."""
    inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    o, lse = reference_sparse_attention(*inputs, idx, upcast=False, **kw)
    return (o, lse, *torch.autograd.grad(o, inputs, do.to(dtype)))


def _poison_padding(k, v, seq_lens):
    """K/V with NaN in every row at or past the batch row's length: padding must never reach a result."""
    k, v = k.clone(), v.clone()
    for b, length in enumerate(seq_lens.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    return k, v


TMA_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, layout, seq_lens, dropout_p, backward options
    pytest.param(1, 4, 2, 150, 16, 32, 16, "bhnd", None, 0.0, {}, id="gqa2-odd150-bq32-bk16"),
    pytest.param(2, 4, 1, 99, 16, 16, 16, "bnhd", (99, 58), 0.0, {}, id="gqa4-b2-odd99-bnhd-seqlens-nan-padding"),
    pytest.param(2, 2, 2, 97, 32, 16, 32, "bhnd", (97, 70), 0.2, {}, id="mha-b2-odd97-bk32-seqlens-dropout"),
    pytest.param(1, 4, 2, 128, 32, 64, 64, "bnhd", None, 0.0, {}, id="gqa2-d32-b64-bnhd"),
    pytest.param(
        2,
        4,
        1,
        99,
        16,
        16,
        32,
        "bnhd",
        (99, 58),
        0.0,
        {"stored_ds": True},
        id="stored-ds-gqa4-b2-odd99-bk32-bnhd-seqlens-nan-padding",
    ),
]


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,layout,lengths,dropout_p,backward", TMA_CASES)
def test_tma_loads_equal_pointer_loads_and_reference(
    descriptors, B, HQ, HKV, N, D, BQ, BK, layout, lengths, dropout_p, backward
):
    idx = random_index(B, HKV, N, BQ, BK, 3, 1, 1, seed=N + BQ, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    kw = dict(dropout_p=dropout_p, dropout_seed=5)
    if lengths is not None:
        kw["seq_lens"] = torch.tensor(lengths, device=DEV)
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    ref64 = _reference(idx, q, k, v, do, torch.float64, **kw)
    ref32 = _reference(idx, q, k, v, do, torch.float32, **kw)
    kernel_k, kernel_v = (k, v) if lengths is None else _poison_padding(k, v, kw["seq_lens"])
    with_tma = _run(idx, q, kernel_k, kernel_v, do, {"r0": 1, **ALL_ON, **backward}, **kw)
    assert {(module, made) for module, _, made in descriptors} == {("forward", True), ("backward", True)}
    assert len(descriptors) == 6, descriptors  # K and V of the forward and the dQ kernel, q and dO of KV-centric
    descriptors.clear()
    with_pointers = _run(idx, q, kernel_k, kernel_v, do, {"r0": 1, **ALL_OFF, **backward}, **kw)
    assert descriptors == []
    for name, a, p, r, l in zip(("o", "lse", "dq", "dk", "dv"), with_tma, with_pointers, ref64, ref32):
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(a), finite), f"{name}: NaN or inf where the reference has none"
        check_close(
            name, torch.where(finite, a, 0), torch.where(finite, r, 0), torch.where(finite, l, 0), torch.float32
        )
        if DEV == "cpu":
            assert torch.equal(a.nan_to_num(), p.nan_to_num()), f"{name}: TMA and pointer loads differ"


def test_kv_centric_takes_pointer_loads_for_stacked_heads(descriptors):
    """Two heads per KV-centric step stack rows of two heads in one slice: no descriptor tile covers them, so
    the launcher keeps the pointer loads (and the result is still exact)."""
    B, HQ, HKV, N, D = 1, 4, 1, 96, 16
    idx = random_index(B, HKV, N, 16, 16, 3, 1, 1, seed=4, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=4, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    got = _run(idx, q, k, v, do, {"r0": 1, "kv_heads_per_program": 2, "kv_tile_rows": 32, **ALL_ON})
    assert ("backward", (B, HQ, N, D), True) not in descriptors  # no q/dO descriptor
    assert ("backward", (B, HKV, N, D), True) in descriptors  # the dQ kernel's K/V still
    ref64 = _reference(idx, q, k, v, do, torch.float64)
    ref32 = _reference(idx, q, k, v, do, torch.float32)
    for name, a, r, l in zip(("o", "lse", "dq", "dk", "dv"), got, ref64, ref32):
        check_close(name, a, r, l, torch.float32)


def test_layout_without_descriptor_falls_back_to_pointer_loads(descriptors):
    """K/V rows 17 floats apart (68 bytes: not a multiple of 16, which TMA needs): no descriptor, pointer loads,
    the same result."""
    B, HQ, HKV, N, D = 1, 2, 1, 80, 16
    idx = random_index(B, HKV, N, 16, 16, 2, 1, 1, seed=8, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=8, device=DEV)
    k_padded = torch.zeros(B, HKV, N, D + 1, device=DEV)
    v_padded = torch.zeros(B, HKV, N, D + 1, device=DEV)
    k_padded[..., :D] = k
    v_padded[..., :D] = v
    k_view, v_view = k_padded[..., :D], v_padded[..., :D]
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    got = _run(idx, q, k_view, v_view, do, {"r0": 1, **ALL_ON})
    assert ("forward", (B, HKV, N, D), False) in descriptors
    ref64 = _reference(idx, q, k, v, do, torch.float64)
    ref32 = _reference(idx, q, k, v, do, torch.float32)
    for name, a, r, l in zip(("o", "lse", "dq", "dk", "dv"), got, ref64, ref32):
        check_close(name, a, r, l, torch.float32)


@pytest.mark.parametrize(
    "make,expected",
    [
        pytest.param(lambda: torch.zeros(2, 3, 40, 16), True, id="contiguous-fp32"),
        pytest.param(lambda: torch.zeros(2, 40, 3, 32, dtype=torch.bfloat16).transpose(1, 2), True, id="bnhd-bf16"),
        pytest.param(lambda: torch.zeros(2, 3, 40, 17)[..., :16], False, id="row-stride-68-bytes"),
        pytest.param(lambda: torch.zeros(1, 3, 40, 16).expand(2, 3, 40, 16), False, id="expanded-batch-stride-0"),
        pytest.param(lambda: torch.zeros(2, 3, 40, 4, dtype=torch.bfloat16), False, id="row-of-8-bytes"),
        pytest.param(lambda: torch.zeros(2, 3, 40, 8, dtype=torch.bfloat16), True, id="row-of-16-bytes"),
        pytest.param(lambda: torch.zeros(2, 3, 40, 32)[..., 1:17], False, id="base-4-bytes-off"),
    ],
)
def test_tma_descriptor_takes_only_what_the_copy_engine_addresses(make, expected):
    x = make().to(DEV)
    assert _launch.tma_descriptor(x, 8, False) is None
    desc = _launch.tma_descriptor(x, 8, True)
    if DEV == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        expected = False
    assert (desc is not None) == expected
    if expected:
        assert list(desc.shape) == list(x.shape) and list(desc.strides) == list(x.stride())
        assert list(desc.block_shape) == [1, 1, 8, x.shape[-1]]


GPU_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, dtype, layout, lengths
    pytest.param(2, 8, 2, 4099, 128, 64, 64, torch.bfloat16, "bnhd", (4099, 2500), id="bf16-d128-b64-odd-bnhd-seqlens"),
    pytest.param(1, 8, 2, 8192, 128, 128, 128, torch.bfloat16, "bhnd", None, id="bf16-d128-b128-8k"),
    pytest.param(2, 8, 1, 5000, 64, 128, 128, torch.float16, "bnhd", (5000, 3333), id="fp16-d64-b128-gqa8-seqlens"),
    pytest.param(1, 4, 2, 3000, 64, 64, 64, torch.bfloat16, "bhnd", (2047,), id="bf16-d64-b64-seqlen-mid-block"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,layout,lengths", GPU_CASES)
def test_tma_loads_on_gpu(descriptors, B, HQ, HKV, N, D, BQ, BK, dtype, layout, lengths):
    """The copy engine's loads (all three kernels) and the pointer loads, each against the fp32 reference, with
    NaN in the K/V padding; o, lse and the gradients."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or newer")
    idx = random_index(B, HKV, N, BQ, BK, 8, 4, 1, seed=N, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, seed=N, device="cuda")
    kw = {} if lengths is None else {"seq_lens": torch.tensor(lengths, device="cuda")}
    if layout == "bnhd":
        q, k, v = _bnhd(q), _bnhd(k), _bnhd(v)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    ref32 = _reference(idx, q, k, v, do, torch.float32, **kw)
    refl = _reference(idx, q, k, v, do, dtype, **kw)
    kernel_k, kernel_v = (k, v) if lengths is None else _poison_padding(k, v, kw["seq_lens"])
    for options in (ALL_ON, ALL_OFF, {**ALL_ON, "stored_ds": True}):
        descriptors.clear()
        got = _run(idx, q, kernel_k, kernel_v, do, options, **kw)
        assert all(made for _, _, made in descriptors) and len(descriptors) == (6 if options["fwd_tma"] else 0)
        for name, a, r, l in zip(("o", "lse", "dq", "dk", "dv"), got, ref32, refl):
            finite = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), finite), f"{name}: NaN or inf where the reference has none"
            check_close(
                f"{name} {options}",
                torch.where(finite, a, 0).float(),
                torch.where(finite, r, 0),
                torch.where(finite, l, 0).float(),
                dtype,
                c=3.0,
                floor=1e-4,
            )
