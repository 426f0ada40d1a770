"""The index-query kernel (kernels/triton/index_queries.py) against its PyTorch reference
(kernels/reference/index_queries.py) in float64, by the error-ratio rule: both RoPE conventions, partial RoPE (a
tail of plain channels), no RoPE, GQA groups 1 / 3 / 4, index widths 8 to 64 (padded to the dot's 16), positions
shifted / restarting / float, lengths with NaN padding (an empty row), transposed strides, float16; validation;
compiled for sm_90a without spills; the custom op ``sparse_train::index_queries`` (opcheck, the public function
compiled fullgraph against eager). The token indexer on that path (its selection scores) against the two-step path.
GPU-marked tests: bf16 at 16K with late positions and a cut row (both RoPE conventions); no host sync and CUDA-graph
capture (the indexer's bf16 scores on the GPU: tests/selection/test_selector_indexer.py)."""

import pytest
import torch
from builders import (
    assert_sync_free_and_capturable,
    check_close,
    compile_report_in_subprocess,
    compiled_fullgraph,
    ptxas_path,
    ptxas_usage,
    rope_inputs,
    warmup_for_hopper,
)

import sparse_train.selection.indexer as indexer_module
from sparse_train.kernels.reference.index_queries import reference_index_queries
from sparse_train.kernels.triton.index_queries import triton_index_queries
from sparse_train.selection import rope_inverse_frequencies, selection_geometry
from sparse_train.selection.indexer import IndexQueries, TokenIndexer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh outputs start as NaN


def _inputs(B, HKV, G, N, D, X, *, rope, positions, lengths, dtype=torch.float32, device=DEV, layout="bhnd", seed=0):
    """(q [B, HKV * G, N, D] with NaN past ``lengths``, weight [HKV, G * D, X], inv_freq, positions, valid_len)."""
    q, inv_freq, pos, valid = rope_inputs(
        B, HKV * G, N, D, rope=rope, positions=positions, lengths=lengths, dtype=dtype, device=device, layout=layout,
        seed=seed,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(HKV, G * D, X, generator=g) / D**0.5).to(device, dtype)
    return q, weight, inv_freq, pos, valid


CASES = [
    # (B, HKV, G, N, D, X, rope channels, positions, lengths, style)
    pytest.param(2, 2, 4, 147, 64, 32, 64, None, None, "rotate_half", id="gqa4-full-rope-odd-n"),
    pytest.param(2, 2, 4, 147, 64, 32, 64, None, None, "interleaved", id="gqa4-interleaved"),
    pytest.param(2, 1, 3, 100, 32, 24, 16, "shifted", (100, 41), "rotate_half", id="gqa3-partial-rope-nan-rows"),
    pytest.param(2, 3, 1, 90, 16, 8, 16, "per_row", (0, 90), "interleaved", id="gqa1-x8-restarting-empty-row"),
    pytest.param(1, 2, 2, 65, 128, 64, 128, "float", None, "rotate_half", id="d128-x64-float-positions"),
    pytest.param(1, 2, 4, 70, 64, 16, 0, None, (51,), "rotate_half", id="no-rope"),
    pytest.param(1, 1, 1, 1, 16, 16, 16, None, None, "rotate_half", id="one-row"),
]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("B,HKV,G,N,D,X,rope,positions,lengths,style", CASES)
def test_index_queries_match_reference(B, HKV, G, N, D, X, rope, positions, lengths, style, layout):
    q, weight, inv_freq, pos, valid = _inputs(
        B, HKV, G, N, D, X, rope=rope, positions=positions, lengths=lengths, layout=layout
    )
    got = triton_index_queries(q, weight, inv_freq, pos, style, valid_len=valid)
    freq64 = None if inv_freq is None else inv_freq.double()
    ref = reference_index_queries(q.double(), weight.double(), freq64, pos, style, valid)
    low = reference_index_queries(q, weight, inv_freq, pos, style, valid)
    assert got.shape == (B, HKV, N, X) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.isfinite(got).all(), "a padded (NaN) row reached the output"
    check_close("index queries", got, ref, low, torch.float32)
    if valid is not None:  # rows past the length are exactly 0
        for b, length in enumerate(lengths):
            assert torch.all(got[b, :, length:] == 0)


def test_index_queries_float16():
    """float16 in and out (bf16 only on the GPU: the interpreter's bf16 arithmetic is wrong), against PyTorch's
    float16 two-step path."""
    q, weight, inv_freq, pos, valid = _inputs(
        2, 2, 4, 100, 64, 32, rope=48, positions="shifted", lengths=(100, 9), dtype=torch.float16
    )
    got = triton_index_queries(q, weight, inv_freq, pos, "rotate_half", valid_len=valid)
    ref = reference_index_queries(q.double(), weight.double(), inv_freq.double(), pos, "rotate_half", valid)
    low = reference_index_queries(q, weight, inv_freq, pos, "rotate_half", valid)
    assert got.dtype == low.dtype == torch.float16
    check_close("index queries fp16", got, ref, low, torch.float16)


def test_index_queries_empty_batch():
    q = torch.randn(0, 4, 16, 16, device=DEV)
    out = triton_index_queries(q, torch.randn(2, 32, 8, device=DEV), rope_inverse_frequencies(10000.0, 16).to(DEV))
    assert out.shape == (0, 2, 16, 8)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q, w, f: triton_index_queries(q[0], w, f), "q must be \\[B, HQ, N, D\\]"),
        (lambda q, w, f: triton_index_queries(q.double(), w, f), "float16, bfloat16 or float32"),
        (lambda q, w, f: triton_index_queries(q, w[:, :16], f), "weight must be \\[HKV, G \\* D, X\\]"),
        (lambda q, w, f: triton_index_queries(q, torch.randn(3, 32, 8), f), "weight must be"),
        (lambda q, w, f: triton_index_queries(q, torch.randn(2, 32, 300), f), "X <= 256"),
        (lambda q, w, f: triton_index_queries(q, w, f, style="half"), "RoPE style"),
        (lambda q, w, f: triton_index_queries(q, w, f[:0]), "non-empty 1-D"),
        (lambda q, w, f: triton_index_queries(q, w, torch.cat([f, f, f])), "rotate 24 channels"),
        (lambda q, w, f: triton_index_queries(q, w, f, torch.arange(19)), "positions must be"),
        (lambda q, w, f: triton_index_queries(q, w, f, valid_len=torch.tensor([3.0])), "valid_len must be"),
    ],
    ids=[
        "three-dims", "float64", "weight-rows", "weight-heads", "wide-x", "style", "no-freqs", "too-many-freqs",
        "positions-shape", "float-lengths",
    ],
)  # fmt: skip
def test_index_queries_reject_bad_arguments(call, match):
    q = torch.randn(1, 4, 20, 16)
    with pytest.raises(ValueError, match=match):
        call(q, torch.randn(2, 32, 8), rope_inverse_frequencies(10000.0, 8))


# ---------------------------------------------------------------------------------------------- custom op
OP_CASES = [
    # (B, HKV, G, N, D, X, rope channels, positions, lengths, style)
    pytest.param(2, 2, 3, 37, 32, 24, 16, "per_row", (37, 20), "interleaved", id="gqa3-partial-rope-lengths"),
    pytest.param(1, 3, 1, 21, 16, 8, 0, None, None, "rotate_half", id="mha-no-rope"),
]


@pytest.mark.parametrize("B,HKV,G,N,D,X,rope,positions,lengths,style", OP_CASES)
def test_index_queries_op_passes_opcheck(B, HKV, G, N, D, X, rope, positions, lengths, style):
    """The op's schema, fake (shape, dtype, strides) and AOT dispatch, on transposed q."""
    q, weight, inv_freq, pos, valid = _inputs(
        B, HKV, G, N, D, X, rope=rope, positions=positions, lengths=lengths, layout="bnhd"
    )
    valid = None if valid is None else valid.to(torch.int32)
    pos = None if inv_freq is None else pos
    args = (q, weight.contiguous(), inv_freq, pos, valid, style == "interleaved")
    torch.library.opcheck(torch.ops.sparse_train.index_queries.default, args)


@pytest.mark.parametrize("B,HKV,G,N,D,X,rope,positions,lengths,style", OP_CASES)
def test_index_queries_compiled_fullgraph_equals_eager(B, HKV, G, N, D, X, rope, positions, lengths, style):
    """The public function compiled with fullgraph runs the kernel through the op: the eager result bit for bit."""
    q, weight, inv_freq, pos, valid = _inputs(
        B, HKV, G, N, D, X, rope=rope, positions=positions, lengths=lengths, layout="bnhd"
    )

    def project(q, weight):
        return triton_index_queries(q, weight, inv_freq, pos, style, valid_len=valid)

    assert torch.equal(compiled_fullgraph(project)(q, weight), project(q, weight))


# ---------------------------------------------------------------------------------------------- the indexer's path
@pytest.mark.parametrize("candidates", [None, 3], ids=["exact", "candidates"])
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_indexer_selection_through_the_kernel_equals_the_two_step_path(monkeypatch, style, candidates):
    """The selection's scores (no gradient) with the index queries from the kernel equal those from the un-rotated
    copy and the einsum; with a gradient the indexer takes the two-step path, whose rows :meth:`IndexQueries.rows`
    also gives."""
    torch.manual_seed(3)
    hq, hkv, n, d, block = 4, 2, 150, 32, 16
    indexer = TokenIndexer(
        hq, hkv, d, index_dim=16, index_heads=2, distance_bias=True, rope_style=style, candidates=candidates,
        window=1, sinks=1,
    )  # fmt: skip
    indexer.set_rope(rope_inverse_frequencies(10000.0, d))
    q, k = torch.randn(2, hq, n, d, device=DEV), torch.randn(2, hkv, n, d, device=DEV)
    lens = torch.tensor([150, 77], device=DEV)
    positions = (torch.arange(n, device=DEV) % 61).expand(2, n).contiguous()
    q = q.masked_fill(torch.arange(n, device=DEV).view(1, 1, n, 1) >= lens.view(2, 1, 1, 1), float("nan"))
    geometry = selection_geometry(n, block, block, 3, 1, 1)
    queries, keys = indexer.to(DEV).pool(q, k, block, block, lens, positions)
    assert isinstance(queries, IndexQueries)
    two_step = indexer(queries.unrotated(), keys, 0.3, geometry, seq_lens=lens)
    monkeypatch.setattr(indexer_module, "_kernels_take", lambda x: True)  # the interpreter runs the kernel on CPU
    with torch.no_grad():
        fused = indexer(queries, keys, 0.3, geometry, seq_lens=lens)
    torch.testing.assert_close(fused, two_step, rtol=1e-5, atol=1e-5)
    blocks = torch.tensor([9, 0, 4], device=DEV)
    rows = queries.rows(blocks, block)
    want = indexer.query_rows(queries.unrotated(), blocks, block)
    torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- compile for Hopper
def hopper_compile_report(cases):
    """[(registers, spill store bytes)] of the kernel compiled for sm_90a at the launcher's tile for each
    ``(D, X, G, rope channels)`` case (bf16, positions and lengths given). Runs in a process without the interpreter
    (the test below starts one, :func:`builders.compile_report_in_subprocess`)."""
    import triton

    from sparse_train.kernels.triton.index_queries import MIN_DOT, _index_queries_kernel, program_tile

    report = []
    for D, X, G, rope in cases:
        N = 256
        q = torch.zeros(1, 2 * G, N, D, dtype=torch.bfloat16)
        weight = torch.zeros(2, G * D, X, dtype=torch.bfloat16)
        freq, pos, ints = (
            torch.zeros(max(rope // 2, 1)),
            torch.zeros(N, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int32),
        )
        out = torch.zeros(1, 2, N, X, dtype=torch.bfloat16)
        compiled = warmup_for_hopper(
            _index_queries_kernel,
            q, weight, freq, pos, ints, out, *q.stride(), 0, 1, N, 2, X,
            GROUP=G, ROWS=program_tile(D)[0], HEAD_DIM=D, ROT_HALF=rope // 2,
            HALF_P2=max(MIN_DOT, triton.next_power_of_2(max(rope // 2, 1))),
            TAIL_P2=max(MIN_DOT, triton.next_power_of_2(max(D - rope, 1))),
            X_P2=max(MIN_DOT, triton.next_power_of_2(X)),
            HAS_POS=True, HAS_VALID_LEN=True, FAST_TRIG=True, INTERLEAVED=False, IEEE=False,
            num_warps=program_tile(D)[1], grid=(1, 1, 1),
        )  # fmt: skip
        report.append(ptxas_usage(compiled))
    return report


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
def test_kernel_compiles_for_hopper_without_spills():
    """The interpreter accepts programs the compiler rejects (a bf16 operand next to an fp32 one): the kernel compiles
    for sm_90a at the launcher's tile for D 64 / 128, X 32 / 64, GQA 1 / 4 / 8, full, partial and no RoPE, without
    register spills; D = 256 compiles (with a few spilled registers, :func:`program_tile`)."""
    if ptxas_path() is None:
        pytest.skip("this triton ships no ptxas")
    cases = [(128, 32, 4, 128), (128, 32, 8, 64), (64, 64, 1, 64), (128, 32, 4, 0), (256, 32, 4, 256)]
    report = compile_report_in_subprocess(__file__, "hopper_compile_report", cases)
    for case, (registers, spills) in zip(cases, report):
        print(f"D, X, G, rope = {case}: {registers} registers, {spills} bytes spilled")
        assert spills == 0 or case[0] > 128, case


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_gpu_bf16_16k(style):
    """bf16, N = 16384, B = 2, HKV = 8, G = 4, D = 128, X = 32, positions from 60,000, row 1 cut by seq_lens with NaN
    padding."""
    q, weight, inv_freq, _, valid = _inputs(
        2, 8, 4, 16384, 128, 32, rope=128, positions=None, lengths=(16384, 12001), dtype=torch.bfloat16, device="cuda"
    )
    pos = torch.arange(16384, device="cuda") + 60_000
    got = triton_index_queries(q, weight, inv_freq, pos, style, valid_len=valid)
    ref = reference_index_queries(q.double(), weight.double(), inv_freq.double(), pos, style, valid)
    low = reference_index_queries(q, weight, inv_freq, pos, style, valid)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    check_close(f"index queries bf16 {style}", got, ref, low, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_never_synchronises_and_captures():
    q, weight, inv_freq, pos, valid = _inputs(
        2, 2, 4, 4097, 128, 32, rope=128, positions="per_row", lengths=(4097, 3000), dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip

    assert_sync_free_and_capturable(
        lambda: triton_index_queries(q, weight, inv_freq, pos, "rotate_half", valid_len=valid)
    )
