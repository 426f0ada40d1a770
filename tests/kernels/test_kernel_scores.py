"""The selector's block-logits kernel (kernels/triton/scores.py) against its PyTorch reference
(``selection.scorer.reference_block_logits``) in float64, by the error-ratio rule: values and the gradients of the
projected queries and keys, the temperature and the distance bias; odd sizes, a selector dim that is not a power of
two, unequal block sizes, context-parallel rows; validation; the scorer on the GPU."""

import pytest
import torch
from builders import check_close

from sparse_train.kernels.triton.scores import triton_block_logits
from sparse_train.selection import BlockScorer, selection_geometry
from sparse_train.selection.scorer import DISTANCE_BUCKETS, reference_block_logits

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")


def _inputs(B, H, R, NKB, S, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    qs = torch.randn(B, H, R, S, generator=g)
    ks = torch.randn(B, H, NKB, S, generator=g)
    temperature = torch.rand(H, generator=g) + 0.5
    bias = torch.randn(H, DISTANCE_BUCKETS, generator=g)
    return [t.to(device).requires_grad_() for t in (qs, ks, temperature, bias)]


CASES = [
    # (B, H, N, BQ, BK, S, bias, query blocks)
    pytest.param(1, 2, 4096, 64, 64, 32, True, None, id="p64-bias"),
    pytest.param(2, 3, 2500, 64, 16, 20, True, None, id="odd-n-bq64-bk16-s20"),
    pytest.param(1, 2, 2500, 32, 64, 8, False, None, id="no-bias-s8"),
    pytest.param(1, 2, 5120, 64, 64, 32, True, (70, 0, 63, 5, 79), id="listed-query-blocks"),
]


@pytest.mark.parametrize("B,H,N,BQ,BK,S,with_bias,query_blocks", CASES)
def test_block_logits_match_reference(B, H, N, BQ, BK, S, with_bias, query_blocks):
    geometry = selection_geometry(N, BQ, BK, 4, 2, 1)
    rows = geometry.num_q_blocks if query_blocks is None else len(query_blocks)
    qs, ks, temperature, bias = _inputs(B, H, rows, geometry.num_k_blocks, S)
    bias = bias if with_bias else None
    blocks = None if query_blocks is None else torch.tensor(query_blocks, device=DEV)
    got = triton_block_logits(qs, ks, temperature, bias, geometry, blocks)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(9)).to(DEV)
    leaves = [t for t in (qs, ks, temperature, bias) if t is not None]
    got_grads = torch.autograd.grad(got, leaves, grad)

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in leaves]
        q64, k64, t64 = inputs[:3]
        out = reference_block_logits(q64, k64, t64, inputs[3] if with_bias else None, geometry, blocks)
        return out, torch.autograd.grad(out, inputs, grad.to(dtype))

    ref, ref_grads = reference(torch.float64)
    low, low_grads = reference(torch.float32)
    assert got.shape == ref.shape == (B, H, rows, geometry.num_k_blocks) and got.dtype == torch.float32
    assert torch.isfinite(got).all(), "an element of the logits was left unwritten"
    check_close("logits", got, ref, low, torch.float32)
    for name, g_got, g_ref, g_low in zip(("qs", "ks", "temperature", "bias"), got_grads, ref_grads, low_grads):
        check_close(f"grad {name}", g_got, g_ref, g_low, torch.float32)


def test_block_logits_buckets_equal_the_reference_table():
    """With a zero product the logits are the bias lookup itself: every (row, key block) takes exactly the bias
    of its reference bucket (on and past the causal edge, one block back, 2-3 back, ..., 256-299 back)."""
    geometry = selection_geometry(64 * 300, 64, 64, 4, 2, 1)
    nqb, nkb = geometry.num_q_blocks, geometry.num_k_blocks
    qs = torch.zeros(1, 2, nqb, 16, device=DEV)
    ks = torch.zeros(1, 2, nkb, 16, device=DEV)
    bias = torch.arange(2 * DISTANCE_BUCKETS, dtype=torch.float32, device=DEV).view(2, -1)
    got = triton_block_logits(qs, ks, torch.ones(2, device=DEV), bias, geometry)
    ref = reference_block_logits(qs, ks, torch.ones(2, device=DEV), bias, geometry)
    assert torch.equal(got, ref)
    assert set(got[0, 0].unique().tolist()) == set(range(10)), "299 blocks back is bucket 9"


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q, k, t, b, g: triton_block_logits(q[0], k, t, b, g), r"qs \[B, H, R, S\] and ks"),
        (lambda q, k, t, b, g: triton_block_logits(q.double(), k, t, b, g), "qs must be float32"),
        (lambda q, k, t, b, g: triton_block_logits(q, k, t[:1], b, g), r"temperature must be \[H\] = \[2\]"),
        (lambda q, k, t, b, g: triton_block_logits(q, k, t, b, None), "needs the selection geometry"),
        (lambda q, k, t, b, g: triton_block_logits(q, k, t, b[:1], g), r"bias must be \[H, C\] = \[2, 16\]"),
        (lambda q, k, t, b, g: triton_block_logits(q, k, t, b[:, :4], g), r"bias must be \[H, C\] = \[2, 16\]"),
        (lambda q, k, t, b, g: triton_block_logits(q, k[:, :, :3], t, b, g), "ks has 3 key blocks, the geometry 4"),
        (lambda q, k, t, b, g: triton_block_logits(q, k, t, b, g, torch.tensor([0])), "query_blocks must list the 4"),
    ],
    ids=[
        "qs-3d",
        "qs-float64",
        "temperature-shape",
        "bias-without-geometry",
        "bias-heads",
        "bias-buckets",
        "key-blocks",
        "query-blocks-length",
    ],
)
def test_block_logits_reject_bad_arguments(call, match):
    geometry = selection_geometry(256, 64, 64, 1, 1, 1)
    qs, ks, temperature, bias = (t.detach() for t in _inputs(1, 2, 4, 4, 16, device="cpu"))
    with pytest.raises(ValueError, match=match):
        call(qs, ks, temperature, bias, geometry)


@pytest.mark.gpu
def test_scorer_takes_the_kernel_on_gpu_and_matches_reference():
    """BlockScorer.forward on CUDA (distance bias on) goes through the kernel and gives the reference's logits and
    parameter gradients, at 16K with 64-blocks."""
    import sparse_train.kernels.triton.scores as scores_module

    geometry = selection_geometry(16384, 64, 64, 16, 8, 1)
    scorer = BlockScorer(32, 8, 64, 32, distance_bias=True, query_pooling="mean_max", key_pooling="mean_max").cuda()
    with torch.no_grad():
        scorer.distance_bias.normal_()
        scorer.log_temperature.normal_(std=0.3)
    g = torch.Generator(device="cuda").manual_seed(0)
    qbar = torch.randn(1, 8, geometry.num_q_blocks, 128, device="cuda", generator=g)
    kbar = torch.randn(1, 8, geometry.num_k_blocks, 128, device="cuda", generator=g)
    calls = []
    real_launch = scores_module.block_logits_launch
    scores_module.block_logits_launch = lambda *a: calls.append(1) or real_launch(*a)
    try:
        got = scorer(qbar, kbar, 0.125, geometry)
    finally:
        scores_module.block_logits_launch = real_launch
    assert calls, "the scorer did not take the kernel on the GPU"
    params = [scorer.query_proj, scorer.key_proj, scorer.log_temperature, scorer.distance_bias]
    grad = torch.randn(got.shape, device="cuda", generator=g)
    got_grads = torch.autograd.grad(got, params, grad)
    multiplier = scorer.lr_multiplier.double()

    def reference(dtype):
        wq, wk, log_t, bias = (p.detach().to(dtype).requires_grad_() for p in params)
        qs = torch.einsum("bhnd,hds->bhns", qbar.to(dtype), wq * multiplier.to(dtype))
        ks = torch.einsum("bhmd,hds->bhms", kbar.to(dtype), wk * multiplier.to(dtype))
        out = reference_block_logits(
            qs, ks, torch.exp(log_t * multiplier.to(dtype)) * 0.125, bias * multiplier.to(dtype), geometry
        )
        return out, torch.autograd.grad(out, (wq, wk, log_t, bias), grad.to(dtype))

    ref, ref_grads = reference(torch.float64)
    low, low_grads = reference(torch.float32)
    check_close("scorer logits", got, ref, low, torch.float32)
    for name, g_got, g_ref, g_low in zip(
        ("query_proj", "key_proj", "log_temperature", "distance_bias"), got_grads, ref_grads, low_grads
    ):
        check_close(f"grad {name}", g_got, g_ref, g_low, torch.float32)
