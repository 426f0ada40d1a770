"""The RoPE un-rotation kernel (kernels/triton/unrotate.py) against its PyTorch reference
(kernels/reference/pool.py ``unrotate``) in float64, by the error-ratio rule; validation; the custom op
``sparse_train::unrotate`` (opcheck, the public function compiled fullgraph against eager); the token indexer's inputs
on the GPU."""

import pytest
import torch
from builders import check_close, compiled_fullgraph, rope_inputs

from sparse_train.kernels.reference.pool import unrotate
from sparse_train.kernels.triton.unrotate import triton_unrotate
from sparse_train.selection import rope_inverse_frequencies
from sparse_train.selection.indexer import TokenIndexer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh outputs start as NaN


def _inputs(B, H, N, D, *, device=DEV, **kwargs):
    return rope_inputs(B, H, N, D, device=device, **kwargs)


def _reference(x, inv_freq, pos, valid, style):
    """unrotate with the rows at or past ``valid`` zero (read as 0, so their NaN stays out)."""
    if valid is not None:
        keep = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1) < valid.view(-1, 1, 1, 1)
        x = torch.where(keep, x, 0.0)
    return unrotate(x, inv_freq, pos, style)


CASES = [
    # (B, H, N, D, rope channels, positions, lengths)
    pytest.param(1, 4, 100, 64, 64, None, None, id="full-rope-odd-n"),
    pytest.param(2, 3, 150, 32, 32, None, (150, 70), id="odd-heads-lengths"),
    pytest.param(2, 1, 96, 64, 32, "per_row", (0, 50), id="partial-rope-restarting-empty-row"),
    pytest.param(1, 5, 33, 16, 8, "float", None, id="float-positions-five-heads"),
    pytest.param(1, 2, 64, 128, 128, "shifted", None, id="large-angles-d128"),
    pytest.param(1, 1, 1, 16, 16, None, None, id="one-row"),
]


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("B,H,N,D,rope,positions,lengths", CASES)
def test_unrotate_matches_reference(B, H, N, D, rope, positions, lengths, layout, style):
    x, inv_freq, pos, valid = _inputs(B, H, N, D, rope=rope, positions=positions, lengths=lengths, layout=layout)
    got = triton_unrotate(x, inv_freq, pos, style, valid_len=valid)
    ref = _reference(x.double(), inv_freq.double(), pos, valid, style)
    ref_low = _reference(x, inv_freq, pos, valid, style)
    assert got.shape == x.shape and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.isfinite(got).all(), "a padded (NaN) row reached the output"
    check_close("unrotate", got, ref, ref_low, torch.float32)
    if valid is not None:  # rows past the length are exactly 0
        for b, length in enumerate(lengths):
            assert torch.all(got[b, :, length:] == 0)


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_unrotate_half_precision_keeps_the_dtype(style):
    """float16 in, float16 out: the float32 result rounded once, as the reference's result cast to float16 (on
    the GPU also bfloat16, which the interpreter does not compute correctly)."""
    dtypes = [torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float16]
    for dtype in dtypes:
        x, inv_freq, pos, valid = _inputs(2, 3, 70, 64, rope=48, positions="shifted", lengths=(70, 9), dtype=dtype)
        got = triton_unrotate(x, inv_freq, pos, style, valid_len=valid)
        ref = _reference(x.double(), inv_freq.double(), pos, valid, style)
        ref_low = _reference(x, inv_freq, pos, valid, style).to(dtype)
        assert got.dtype == dtype
        check_close(f"unrotate {dtype}", got, ref, ref_low, dtype)


def test_unrotate_empty_batch():
    x = torch.randn(0, 2, 16, 16, device=DEV)
    out = triton_unrotate(x, rope_inverse_frequencies(10000.0, 16).to(DEV))
    assert out.shape == x.shape


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, f: triton_unrotate(x[0], f), "must be \\[B, H, N, D\\]"),
        (lambda x, f: triton_unrotate(x.double(), f), "float16, bfloat16 or float32"),
        (lambda x, f: triton_unrotate(x, f, style="half"), "RoPE style"),
        (lambda x, f: triton_unrotate(x, f[:0]), "non-empty 1-D"),
        (lambda x, f: triton_unrotate(x, torch.cat([f, f, f])), "rotate 24 channels"),
        (lambda x, f: triton_unrotate(x, f, torch.arange(19)), "positions must be"),
        (lambda x, f: triton_unrotate(x, f, valid_len=torch.tensor([3.0])), "valid_len must be"),
        (lambda x, f: triton_unrotate(x, f, valid_len=torch.tensor([3, 4])), "valid_len must be"),
    ],
    ids=["three-dims", "float64", "style", "no-freqs", "too-many-freqs", "positions-shape", "float-lengths", "lengths"],
)
def test_unrotate_rejects_bad_arguments(call, match):
    x = torch.randn(1, 2, 20, 16)
    with pytest.raises(ValueError, match=match):
        call(x, rope_inverse_frequencies(10000.0, 8))


OP_CASES = [
    # (B, H, N, D, rope channels, positions, lengths, style, dtype)
    pytest.param(2, 3, 37, 32, 16, "per_row", (37, 20), "interleaved", torch.float32, id="partial-rope-lengths"),
    pytest.param(1, 5, 21, 16, 16, "float", None, "rotate_half", torch.float16, id="float-positions-fp16"),
]


@pytest.mark.parametrize("B,H,N,D,rope,positions,lengths,style,dtype", OP_CASES)
def test_unrotate_op_passes_opcheck(B, H, N, D, rope, positions, lengths, style, dtype):
    """The op's schema, fake (shape, dtype, strides) and AOT dispatch, on transposed x."""
    x, inv_freq, pos, valid = _inputs(
        B, H, N, D, rope=rope, positions=positions, lengths=lengths, layout="bnhd", dtype=dtype
    )
    valid = None if valid is None else valid.to(torch.int32)
    out_dtype = torch.float32 if dtype == torch.float32 else dtype
    args = (x, inv_freq, pos, valid, out_dtype, style == "interleaved")
    torch.library.opcheck(torch.ops.sparse_train.unrotate.default, args)


@pytest.mark.parametrize("B,H,N,D,rope,positions,lengths,style,dtype", OP_CASES)
def test_unrotate_compiled_fullgraph_equals_eager(B, H, N, D, rope, positions, lengths, style, dtype):
    """The public function compiled with fullgraph runs the kernel through the op: the eager result bit for bit."""
    x, inv_freq, pos, valid = _inputs(
        B, H, N, D, rope=rope, positions=positions, lengths=lengths, layout="bnhd", dtype=dtype
    )

    def unrotated(x):
        return triton_unrotate(x, inv_freq, pos, style, valid_len=valid)

    assert torch.equal(compiled_fullgraph(unrotated)(x), unrotated(x))


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
def test_indexer_pool_on_gpu_matches_reference(style):
    """TokenIndexer.pool's keys and its queries' un-rotated rows take the kernel on the GPU (bf16, GQA 4, late
    positions, a padded row) and give the PyTorch path's inputs (the same module on the CPU)."""
    B, HKV, G, N, D = 2, 2, 4, 4096, 128
    x_q, _, _, valid = _inputs(B, HKV * G, N, D, rope=D, positions=None, lengths=(4096, 3001), dtype=torch.bfloat16)
    x_k, _, _, _ = _inputs(B, HKV, N, D, rope=D, positions=None, lengths=(4096, 3001), dtype=torch.bfloat16, seed=1)
    pos = torch.arange(N, device="cuda") + 60_000
    indexer = TokenIndexer(HKV * G, HKV, D, 32, rope_style=style)
    indexer.set_rope(rope_inverse_frequencies(10000.0, D))
    queries, keys = indexer.cuda().pool(x_q, x_k, 64, 64, seq_lens=valid, positions=pos)
    got = queries.unrotated(), keys
    indexer_cpu = TokenIndexer(HKV * G, HKV, D, 32, rope_style=style)
    indexer_cpu.set_rope(rope_inverse_frequencies(10000.0, D))
    queries, keys = indexer_cpu.pool(x_q.cpu(), x_k.cpu(), 64, 64, seq_lens=valid.cpu(), positions=pos.cpu())
    want = queries.unrotated(), keys
    for name, a, b, x in zip(("q", "k"), got, want, (x_q, x_k)):
        ref = _reference(x.double(), indexer.rope_inv_freq.double(), pos, valid, style)
        assert a.dtype == b.dtype == torch.bfloat16
        check_close(f"indexer pool {name}", a, ref, b.to(a.device), torch.bfloat16)
