"""The selector's block-pooling kernel (kernels/triton/pool.py) against its PyTorch reference
(kernels/reference/pool.py) in float64, by the error-ratio rule; validation; the scorer's pooling on the GPU."""

import math

import pytest
import torch
from builders import check_close, rope_inputs

from sparse_train.kernels.reference.pool import reference_block_pool
from sparse_train.kernels.triton.pool import triton_block_pool
from sparse_train.selection import BlockScorer, rope_inverse_frequencies

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh outputs start as NaN


def _inputs(B, HP, G, N, D, *, device=DEV, **kwargs):
    """:func:`builders.rope_inputs` with HP pooled heads of G heads each."""
    return rope_inputs(B, HP * G, N, D, device=device, **kwargs)


CASES = [
    # (B, HP, G, N, D, block, rope channels, positions, lengths, with_max)
    pytest.param(1, 2, 4, 128, 32, 32, 0, None, None, True, id="gqa4-mean-max"),
    pytest.param(2, 2, 4, 150, 32, 32, 32, None, (150, 70), True, id="gqa4-rope-full-odd-lengths"),
    pytest.param(1, 3, 1, 100, 16, 16, 0, None, None, False, id="keys-mean-odd-n"),
    pytest.param(2, 1, 2, 96, 64, 64, 32, "per_row", (0, 50), True, id="rope-partial-restarting-empty-row"),
    pytest.param(1, 2, 1, 130, 32, 48, 16, "float", None, True, id="block48-float-positions"),
    pytest.param(1, 1, 4, 64, 64, 64, 64, "shifted", None, False, id="large-angles-mean"),
    pytest.param(1, 2, 2, 70, 16, 128, 0, None, (33,), True, id="one-partial-block128"),
    pytest.param(1, 3, 2, 300, 32, 128, 16, "shifted", None, True, id="rope-block128-one-step"),
]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("B,HP,G,N,D,block,rope,positions,lengths,with_max", CASES)
def test_pool_matches_reference(B, HP, G, N, D, block, rope, positions, lengths, with_max, layout):
    if lengths is not None and len(lengths) != B:
        lengths = lengths * B
    x, inv_freq, pos, valid = _inputs(B, HP, G, N, D, rope=rope, positions=positions, lengths=lengths, layout=layout)
    got = triton_block_pool(x, block, G, valid_len=valid, inv_freq=inv_freq, positions=pos, with_max=with_max)
    ref = reference_block_pool(
        x.double(),
        block,
        G,
        valid_len=valid,
        inv_freq=None if inv_freq is None else inv_freq.double(),
        positions=pos,
        with_max=with_max,
    )
    ref_low = reference_block_pool(x, block, G, valid_len=valid, inv_freq=inv_freq, positions=pos, with_max=with_max)
    assert got.shape == ref.shape == (B, HP, math.ceil(N / block), (2 if with_max else 1) * D)
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all(), "a padded (NaN) row reached the pooled values"
    check_close("pool", got, ref, ref_low, torch.float32)
    if valid is not None:  # blocks without a valid row pool to exactly 0
        for b, length in enumerate(lengths):
            assert torch.all(got[b, :, math.ceil(length / block) :] == 0)


@pytest.mark.parametrize(
    "rows,heads_per_program",
    [(16, 1), (64, 3), (16, 4)],
    ids=["row-steps-one-head", "one-step-uneven-head-chunks", "row-steps-all-heads"],
)
@pytest.mark.parametrize("rope", [0, 24, 64], ids=["no-rope", "rope-12-pairs-tail", "rope-full"])
def test_pool_tilings_match_reference(rope, rows, heads_per_program):
    """Every tiling the launcher can choose gives the reference's values: the block in several row steps (the
    angles recomputed per step) or in one (computed once for all heads), heads per program not dividing the
    heads, and a rotated half that is not a power of two followed by unrotated channels."""
    from sparse_train.kernels.triton.pool import block_pool_launch

    x, inv_freq, pos, valid = _inputs(2, 4, 2, 150, 64, rope=rope, positions="shifted", lengths=(150, 77))
    got = block_pool_launch(
        x,
        64,
        2,
        valid.to(torch.int32),
        inv_freq,
        pos,
        True,
        rows=rows,
        num_warps=2,
        heads_per_program=heads_per_program,
    )
    ref = reference_block_pool(
        x.double(),
        64,
        2,
        valid_len=valid,
        inv_freq=None if inv_freq is None else inv_freq.double(),
        positions=pos,
        with_max=True,
    )
    ref_low = reference_block_pool(x, 64, 2, valid_len=valid, inv_freq=inv_freq, positions=pos, with_max=True)
    assert torch.isfinite(got).all()
    check_close(f"pool rows={rows} heads/program={heads_per_program}", got, ref, ref_low, torch.float32)


def test_pool_max_without_rope_is_exact():
    x, _, _, valid = _inputs(2, 2, 1, 90, 32, rope=0, positions=None, lengths=(90, 41))
    got = triton_block_pool(x, 32, 1, valid_len=valid, with_max=True)
    ref = reference_block_pool(x, 32, 1, valid_len=valid, with_max=True)
    assert torch.equal(got[..., 32:], ref[..., 32:])


def test_pool_fp16_input():
    x, inv_freq, pos, _ = _inputs(1, 2, 4, 96, 32, rope=16, positions=None, lengths=None, dtype=torch.float16)
    got = triton_block_pool(x, 32, 4, inv_freq=inv_freq, with_max=True)
    ref = reference_block_pool(x.double(), 32, 4, inv_freq=inv_freq.double(), with_max=True)
    ref_low = reference_block_pool(x, 32, 4, inv_freq=inv_freq, with_max=True)
    check_close("pool fp16 input", got, ref, ref_low, torch.float32)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: triton_block_pool(x[0], 16), r"\[B, H \* group, N, D\]"),
        (lambda x: triton_block_pool(x[..., :12], 16), "power-of-two head dim"),
        (lambda x: triton_block_pool(x, 16, 3), "group=3 must be a positive int dividing the 4 heads"),
        (lambda x: triton_block_pool(x, 0), "block must be a positive int"),
        (lambda x: triton_block_pool(x, 16, valid_len=torch.tensor([3.0])), "valid_len must be an integer tensor"),
        (
            lambda x: triton_block_pool(x, 16, valid_len=torch.tensor([3, 4])),
            r"valid_len must be an integer tensor \[B\]",
        ),
        (lambda x: triton_block_pool(x, 16, inv_freq=torch.ones(9)), "rotate 18 channels but the head dim is 16"),
        (lambda x: triton_block_pool(x, 16, inv_freq=torch.ones(4), positions=torch.arange(5)), "positions must be"),
    ],
    ids=[
        "not-4d",
        "head-dim-12",
        "group-3",
        "block-0",
        "float-lengths",
        "lengths-shape",
        "too-many-freqs",
        "positions-shape",
    ],
)
def test_pool_rejects_bad_arguments(call, match):
    x = torch.randn(1, 4, 20, 16)
    with pytest.raises(ValueError, match=match):
        call(x)


@pytest.mark.gpu
@pytest.mark.parametrize("rope", [0, 64], ids=["no-rope", "rope"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scorer_pool_on_gpu_matches_reference(rope, dtype):
    """BlockScorer.pool (mean_max queries and keys, the module's defaults) takes the kernel on the GPU and gives
    the reference's values: an 8K sequence with late positions (large RoPE angles) and padded rows."""
    B, HKV, G, N, D, block = 2, 2, 4, 8192, 64, 64
    x_q, _, _, valid = _inputs(
        B, HKV, G, N, D, rope=0, positions=None, lengths=(8192, 5000), dtype=dtype, device="cuda", layout="bnhd"
    )
    x_k, _, _, _ = _inputs(
        B, HKV, 1, N, D, rope=0, positions=None, lengths=(8192, 5000), dtype=dtype, device="cuda", seed=1
    )
    pos = torch.arange(N, device="cuda") + 120_000
    scorer = BlockScorer(HKV * G, HKV, D, 32, key_pooling="mean_max", query_pooling="mean_max").cuda()
    if rope:
        scorer.set_rope(rope_inverse_frequencies(10000.0, rope))
    inv_freq = scorer.rope_inv_freq if rope else None
    qbar, kbar = scorer.pool(x_q, x_k, block, block, seq_lens=valid, positions=pos)
    for name, got, x, group in (("qbar", qbar, x_q, G), ("kbar", kbar, x_k, 1)):
        ref = reference_block_pool(
            x.double(),
            block,
            group,
            valid_len=valid,
            inv_freq=None if inv_freq is None else inv_freq.double(),
            positions=pos,
            with_max=True,
        )
        ref_low = reference_block_pool(
            x, block, group, valid_len=valid, inv_freq=inv_freq, positions=pos, with_max=True
        )
        assert torch.isfinite(got).all()
        check_close(f"scorer {name}", got, ref, ref_low, torch.float32)


def _rope_forward(x, inv_freq, style):
    """RoPE as a model applies it (the inverse of ``unrotate``), in float64, positions 0..N-1."""
    half = inv_freq.shape[0]
    angles = torch.arange(x.shape[2], dtype=torch.float64).unsqueeze(-1) * inv_freq.double()
    cos, sin = angles.cos(), angles.sin()
    x = x.double()
    if style == "interleaved":
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        turned = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((turned, x[..., 2 * half :]), dim=-1)


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("rope", [16, 32], ids=["rope-partial", "rope-full"])
def test_unrotate_inverts_each_convention(style, rope):
    """``unrotate`` recovers the content a model rotated in either convention, and the other convention's
    un-rotation does not (the mismatch the selector would otherwise suffer silently)."""
    from sparse_train.kernels.reference.pool import unrotate

    x = torch.randn(2, 3, 50, 32, dtype=torch.float64)
    inv_freq = rope_inverse_frequencies(10000.0, rope).double()
    rotated = _rope_forward(x, inv_freq, style)
    torch.testing.assert_close(unrotate(rotated, inv_freq, style=style), x, rtol=0, atol=1e-12)
    other = "interleaved" if style == "rotate_half" else "rotate_half"
    assert (unrotate(rotated, inv_freq, style=other) - x).abs().max() > 0.1


@pytest.mark.parametrize(
    "G,rope,lengths",
    [(1, 32, None), (4, 32, (150, 70)), (2, 16, (0, 99))],
    ids=["keys-rope-full", "gqa4-odd-lengths", "partial-rope-empty-row"],
)
def test_pool_interleaved_matches_reference(G, rope, lengths):
    x, inv_freq, pos, valid = _inputs(2, 2, G, 150, 32, rope=rope, positions="shifted", lengths=lengths)
    got = triton_block_pool(
        x, 32, G, valid_len=valid, inv_freq=inv_freq, positions=pos, with_max=True, rope_style="interleaved"
    )
    ref = reference_block_pool(
        x.double(),
        32,
        G,
        valid_len=valid,
        inv_freq=inv_freq.double(),
        positions=pos,
        with_max=True,
        rope_style="interleaved",
    )
    ref_low = reference_block_pool(
        x, 32, G, valid_len=valid, inv_freq=inv_freq, positions=pos, with_max=True, rope_style="interleaved"
    )
    rotate_half = reference_block_pool(
        x.double(), 32, G, valid_len=valid, inv_freq=inv_freq.double(), positions=pos, with_max=True
    )
    assert torch.isfinite(got).all()
    check_close("pool interleaved", got, ref, ref_low, torch.float32)
    assert (ref - rotate_half).abs().max() > 1e-3  # the two conventions pool different values


def test_pool_rejects_unknown_rope_style():
    x, inv_freq, _, _ = _inputs(1, 1, 1, 64, 32, rope=32, positions=None, lengths=None)
    with pytest.raises(ValueError, match="rope_style"):
        triton_block_pool(x, 32, 1, inv_freq=inv_freq, rope_style="neox")
